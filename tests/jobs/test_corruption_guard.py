"""Specifications of the corruption guard: the comparison and the rerun state machine on tables
of fingerprints, then real 2-process `jax.distributed` jobs (data 2) whose rank 1 gets a bit of
a parameter flipped in device memory, once (transient), at every replay (persistent) and on the
same element at every replay (a stuck bit), rank 0 a bit of its optimizer state, and rank 1
wrong matmuls before the gradients' all-reduce (the known-answer check)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from harness import Job, LaunchJob, TrainJob, distributed_env, free_port, kill_all, read_jsonl

from msjax.observe.metrics import read_metrics
from msjax.resilience import exit_codes
from msjax.resilience.replica_guard import (
    Replay,
    RerunStateMachine,
    SilentCorruption,
    compare,
)
from msjax.run_dir import RunDir

NAMES = ("params/embedding", "params/layers/mlp/up", "params/layers/mlp/down", "params/norm")


def table(data: int, tensor: int = 1) -> np.ndarray:
    """[data, fsdp 1, expert 1, pipe 1, tensor, 4 tensors] of equal replicas (MESH_AXES order)."""
    places = np.arange(tensor * len(NAMES), dtype=np.uint64).reshape(1, 1, 1, tensor, len(NAMES))
    return np.repeat(places[None] * np.uint64(7919) + np.uint64(1), data, axis=0)


def rank_of(place: tuple[int, ...]) -> int:
    """Each data replica on its own process, as in a data-only job."""
    return place[0]


# ---- the comparison ----------------------------------------------------------------------------


def test_equal_replicas_are_no_mismatch():
    assert compare(table(3, tensor=2), 10, 0, NAMES, rank_of) is None


def test_a_replica_off_the_majority_is_named_with_its_rank_place_tensor_and_window():
    fingerprints = table(3, tensor=2)
    fingerprints[1, 0, 0, 0, 1, 2] ^= np.uint64(1 << 20)
    mismatch = compare(fingerprints, 200, 100, NAMES, rank_of)
    assert mismatch is not None and mismatch.majority
    assert mismatch.devices == ((1, 0, 0, 0, 1),) and mismatch.ranks == (1,)
    assert mismatch.tensor == "params/layers/mlp/down"
    text = mismatch.describe()
    assert "rank 1 (data=1 fsdp=0 pipe=0 tensor=1) differs" in text
    assert "steps 100..200" in text


def test_two_replicas_that_disagree_are_both_named_for_want_of_a_majority():
    fingerprints = table(2)
    fingerprints[1, 0, 0, 0, 0, 0] += np.uint64(1)
    mismatch = compare(fingerprints, 8, 4, NAMES, rank_of)
    assert mismatch is not None and not mismatch.majority
    assert mismatch.ranks == (0, 1) and mismatch.tensor == "params/embedding"


# ---- the rerun state machine --------------------------------------------------------------------


def machine(on_corruption: str = "rerun") -> tuple[RerunStateMachine, list[dict]]:
    events: list[dict] = []
    return RerunStateMachine(on_corruption, 0, lambda record, line: events.append(record)), events


def observed(state_machine: RerunStateMachine, step: int, fingerprints: np.ndarray):
    return state_machine.observe(
        step, fingerprints, compare(fingerprints, step, state_machine.agreed_step, NAMES, rank_of)
    )


def corrupted(data: int, replica: int, amount: int = 1) -> np.ndarray:
    fingerprints = table(data)
    fingerprints[replica, 0, 0, 0, 0, 1] += np.uint64(amount)
    return fingerprints


def test_a_transient_mismatch_is_blamed_on_the_replica_that_differs_from_its_own_replay():
    state_machine, events = machine()
    assert observed(state_machine, 8, corrupted(2, 1)) == Replay(at_most=0, until=8)
    for step in range(1, 9):
        assert observed(state_machine, step, table(2)) is None
    assert events[0]["ranks"] == [0, 1]  # two replicas: the mismatch alone names both
    assert events[1]["event"] == "transient" and events[1]["ranks"] == [1]
    assert events[1]["named_by_mismatch"] == [0, 1]


def test_two_replicas_that_each_reproduce_themselves_are_undecided_and_nobody_is_blamed():
    state_machine, events = machine()
    observed(state_machine, 8, corrupted(2, 1))
    observed(state_machine, 6, corrupted(2, 1))
    with pytest.raises(SilentCorruption, match="none is marked bad") as raised:
        observed(state_machine, 6, corrupted(2, 1))  # bitwise as in the first replay
    assert raised.value.ranks == ()
    assert events[-1]["event"] == "undecided" and events[-1]["bad_ranks"] == []


def test_without_a_majority_the_known_answer_check_names_the_rank_that_fails_it():
    events: list[dict] = []
    state_machine = RerunStateMachine(
        "stop", 0, lambda record, line: events.append(record), known_answer=lambda: (1,)
    )
    with pytest.raises(SilentCorruption, match="known-answer check failed") as raised:
        observed(state_machine, 8, corrupted(2, 0))
    assert raised.value.ranks == (1,) and events[-1]["bad_ranks"] == [1]


def test_a_mismatch_that_does_not_come_back_in_the_replay_is_transient():
    state_machine, events = machine()
    assert observed(state_machine, 4, table(3)) is None
    assert observed(state_machine, 8, corrupted(3, 2)) == Replay(at_most=4, until=8)
    assert [state_machine.checks_every_step(step) for step in (5, 8, 9)] == [True, True, False]
    for step in range(5, 9):
        assert observed(state_machine, step, table(3)) is None
    assert [event["event"] for event in events] == ["mismatch", "transient"]
    assert events[1]["window"] == [4, 8] and events[1]["ranks"] == [2]
    assert state_machine.agreed_step == 8 and not state_machine.checks_every_step(9)


def test_a_mismatch_that_comes_back_marks_the_minority_rank_bad():
    state_machine, events = machine()
    observed(state_machine, 8, corrupted(3, 2))
    with pytest.raises(SilentCorruption, match="rank 2 marked bad") as raised:
        observed(state_machine, 6, corrupted(3, 2))
    assert raised.value.ranks == (2,) and events[-1]["bad_ranks"] == [2]


def test_without_a_majority_the_replica_that_does_not_reproduce_itself_is_bad():
    state_machine, _ = machine()
    observed(state_machine, 8, corrupted(2, 1))
    assert observed(state_machine, 6, corrupted(2, 1, amount=3)) == Replay(at_most=0, until=6)
    assert observed(state_machine, 5, table(2)) is None
    with pytest.raises(SilentCorruption) as raised:
        observed(state_machine, 6, corrupted(2, 1, amount=5))  # replica 0 reproduced itself
    assert raised.value.ranks == (1,)
    assert "a second replay reproduced every other replica bitwise" in str(raised.value)


def test_on_corruption_stop_marks_the_ranks_bad_at_the_first_mismatch():
    state_machine, _ = machine("stop")
    with pytest.raises(SilentCorruption, match="on_corruption=stop") as raised:
        observed(state_machine, 8, corrupted(3, 0))
    assert raised.value.ranks == (0,)


# ---- checkpoints ---------------------------------------------------------------------------------


def test_a_restore_passes_over_a_checkpoint_whose_replicas_differed_for_an_earlier_good_one(
    tmp_path: Path,
):
    import jax
    import jax.numpy as jnp

    from msjax.checkpoint.manager import Checkpointer
    from msjax.config import CheckpointConfig

    def state(value: float) -> dict:
        return {"weights": jnp.full((8, 8), value, jnp.float32)}

    checkpointer = Checkpointer(tmp_path, CheckpointConfig())
    for step, agreed in ((2, True), (4, True), (6, False)):
        checkpointer.save(step, state(step), {"replicas": {"checked": True, "agreed": agreed}})
        checkpointer.wait()
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state(0)
    )
    warnings: list[str] = []
    restored = checkpointer.restore_newest_valid(abstract, warnings.append)
    assert restored is not None and restored.step == 4
    assert float(restored.state["weights"][0, 0]) == 4.0
    assert warnings == [
        f"skipped checkpoint {tmp_path / '6'}: its data-parallel replicas differed when it was "
        "saved, and an earlier one's agreed"
    ]
    assert (tmp_path / "6").is_dir()  # kept for a look, not moved aside as damaged
    checkpointer.close()


# ---- real 2-process jobs ------------------------------------------------------------------------

STEPS, CHECK_EVERY, FLIP_STEP = 12, 4, 5  # the flip after step 5's update is found at step 8
COMPUTE_CHECK_EVERY = 2
JOB_TIMEOUT_S = 900


def train_args(cache_dir: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "model.num_layers=2",
        "model.embed_dim=64",
        "model.mlp_dim=128",
        "data.seq_len=32",
        "data.max_corpus_mib=1",
        "train.global_batch=8",
        f"train.steps={STEPS}",
        "train.eval_every=0",
        "train.peak_tflops=0.5",
        f"checkpoint.every_steps={CHECK_EVERY}",
        f"resilience.replica_check_every={CHECK_EVERY}",
        f"resilience.compile_cache_dir={cache_dir}",
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        *extra,
    ]


def start_by_hand(run_dir: Path, cache_dir: Path, fault: str = "") -> list[Job]:
    """Two `python -m msjax.train` processes of one job, one CPU device each."""
    coordinator = f"127.0.0.1:{free_port()}"
    return [
        TrainJob.start(
            run_dir,
            train_args(cache_dir),
            log_path=run_dir.parent / f"rank{rank}.log",
            env={
                "JAX_NUM_CPU_DEVICES": "1",
                **distributed_env(coordinator, 2, rank),
                "MSJAX_FAULT": fault,
            },
        )
        for rank in range(2)
    ]


def launch(run_dir: Path, cache_dir: Path, fault: str, extra: tuple[str, ...] = ()) -> list[Job]:
    """Under the supervisor, with no restart: its first incident is the one to read."""
    flags = ["--max-restarts=0", f"--fault={fault}"]
    args = train_args(cache_dir, extra)
    return [LaunchJob.start(run_dir, args, nprocs=2, devices_per_proc=1, launch_flags=flags)]


@dataclass(frozen=True)
class Outcome:
    """How the processes of one job ended, and what it left in its run directory."""

    run_dir: Path
    exit_codes: list[int]
    logs: list[str]  # each worker's output (under the launcher: its own first)
    events: list[dict]  # RUN_DIR/replica_mismatches.jsonl
    incidents: list[dict]  # RUN_DIR/incidents.jsonl (the launcher's)

    def final_loss(self) -> float:
        records = [r for r in read_metrics(RunDir(self.run_dir).metrics) if "loss" in r]
        return [r for r in records if r["step"] == STEPS - 1][-1]["loss"]


def finish(processes: list[Job]) -> Outcome:
    try:
        ended = [process.finish(JOB_TIMEOUT_S) for process in processes]
    finally:
        kill_all(processes)
    run_dir = processes[0].run_dir
    logs = [job.output for job in ended]
    if isinstance(processes[0], LaunchJob):
        logs += [path.read_text() if path.exists() else "" for path in worker_logs(run_dir)]
    run = RunDir(run_dir)
    return Outcome(
        run_dir,
        [job.exit_code for job in ended],
        logs,
        read_jsonl(run.replica_mismatches),
        read_jsonl(run.incidents_log),
    )


def worker_logs(run_dir: Path) -> list[Path]:
    return [RunDir(run_dir).log(rank) for rank in range(2)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Outcome]]:
    """The uninterrupted job first (it fills the compile cache), then the transient flip and,
    under the supervisor, the persistent one side by side."""
    cache_dir = tmp_path_factory.mktemp("compile_cache")

    def run_dir(name: str) -> Path:
        return tmp_path_factory.mktemp(name) / "run"

    finished = {"reference": finish(start_by_hand(run_dir("reference"), cache_dir))}
    flip = f"bitflip@step={FLIP_STEP},rank=1"
    # rank 0's optimizer state, after the last update: the final check and save come next
    optimizer_flip = f"opt_bitflip@step={STEPS - 1},rank=0"
    started = {
        "transient": launch(run_dir("transient"), cache_dir, f"{flip};{optimizer_flip}"),
        "persistent": launch(run_dir("persistent"), cache_dir, f"{flip},times=99"),
        "stuck": launch(run_dir("stuck"), cache_dir, f"stuck_bit@step={FLIP_STEP},rank=1"),
        "compute": launch(
            run_dir("compute"),
            cache_dir,
            "corrupt_compute@rank=1",
            (f"resilience.compute_check_every={COMPUTE_CHECK_EVERY}",),
        ),
    }
    finished.update({name: finish(job) for name, job in started.items()})
    yield finished


@pytest.mark.slow
def test_a_flipped_bit_is_found_at_the_next_check_with_its_ranks_tensor_and_window(jobs):
    transient = jobs["transient"]
    assert transient.exit_codes == [0], transient.logs[0][-3000:]
    first = transient.events[0]
    assert first["event"] == "mismatch" and first["step"] == 8 and first["window"] == [4, 8]
    assert first["tensor"] == "params/embedding"  # the first parameter: where the bit flipped
    assert first["ranks"] == [0, 1] and not first["majority"]  # two replicas: no majority
    assert first["devices"] == [
        {"data": replica, "fsdp": 0, "pipe": 0, "tensor": 0} for replica in (0, 1)
    ]
    assert jobs["reference"].events == []  # an uninterrupted job finds nothing


@pytest.mark.slow
def test_a_flip_that_does_not_come_back_is_transient_and_the_run_ends_bitwise_as_without_it(jobs):
    transient, reference = jobs["transient"], jobs["reference"]
    assert [event["event"] for event in transient.events][:2] == ["mismatch", "transient"]
    assert transient.events[1]["replayed_from"] == 4
    assert transient.events[1]["ranks"] == [1]  # the replica that differed from its own replay
    assert "was transient" in transient.logs[1]
    assert reference.exit_codes == [0, 0]
    assert transient.final_loss() == reference.final_loss()  # bitwise
    for step in (4, 8, 12):  # every checkpoint records that its replicas agreed
        meta = json.loads(
            (RunDir(transient.run_dir).checkpoints / str(step) / "meta" / "metadata").read_bytes()
        )
        assert meta["replicas"] == {"checked": True, "agreed": True}


@pytest.mark.slow
def test_a_flip_that_comes_back_on_rank_1_is_persistent_its_workers_exit_11_naming_it(jobs):
    persistent = jobs["persistent"]
    last = persistent.events[-1]
    assert last["event"] == "persistent" and last["bad_ranks"] == [1], persistent.logs[0][-3000:]
    assert "a second replay reproduced every other replica bitwise" in last["how"]
    for worker_log in persistent.logs[1:]:  # its own line, or process 0's ending the job
        assert "rank 1 marked bad" in worker_log or "silent corruption on rank 1" in worker_log
    checkpoints = RunDir(persistent.run_dir).checkpoints
    assert 8 not in [int(name) for name in os.listdir(checkpoints) if name.isdigit()]


@pytest.mark.slow
def test_the_supervisor_names_rank_1_as_the_cause_and_marks_its_slot_bad(jobs):
    persistent = jobs["persistent"]
    assert persistent.exit_codes == [exit_codes.RESTARTS_EXHAUSTED], persistent.logs[0][-3000:]
    incident = persistent.incidents[0]
    assert incident["cause"] == "silent_corruption" and incident["rank"] == 1
    assert f"exit code {exit_codes.SILENT_CORRUPTION}" in incident["detail"]
    assert incident["bad_slot"]["slot"] == "1"


def checkpoint_meta(run_dir: Path, step: int) -> dict:
    return json.loads((RunDir(run_dir).checkpoints / str(step) / "meta" / "metadata").read_bytes())


@pytest.mark.slow
def test_a_flip_in_the_optimizer_state_is_caught_before_its_save_and_not_spread(jobs):
    transient, reference = jobs["transient"], jobs["reference"]
    mismatch, verdict = transient.events[2:4]
    assert mismatch["event"] == "mismatch" and mismatch["step"] == STEPS
    assert mismatch["tensor"].startswith("opt_state/")  # the parameters still agreed
    assert verdict["event"] == "transient" and verdict["ranks"] == [0]
    assert verdict["replayed_from"] == 8
    saved, expected = (
        checkpoint_meta(transient.run_dir, STEPS),
        checkpoint_meta(reference.run_dir, STEPS),
    )
    assert saved["replicas"] == {"checked": True, "agreed": True}
    assert saved["fingerprints"] == expected["fingerprints"]  # the flipped copy was not saved


@pytest.mark.slow
def test_a_stuck_bit_on_one_of_two_replicas_stops_the_job_without_excluding_the_healthy_slot(jobs):
    stuck = jobs["stuck"]
    assert stuck.exit_codes == [exit_codes.SILENT_CORRUPTION], stuck.logs[0][-3000:]
    verdict = stuck.events[-1]
    assert verdict["event"] == "undecided" and verdict["ranks"] == [0, 1]
    assert verdict["bad_ranks"] == [] and "reproduced each replica as before" in verdict["how"]
    (incident,) = stuck.incidents
    assert incident["cause"] == "silent_corruption" and incident["action"] == "stop"
    assert incident["rank"] is None  # not the first of the two ranks named
    assert "bad_slot" not in incident  # neither slot is left out: no replica could be blamed
    assert incident["corruption"]["event"] == "undecided"
    assert "slot 0 is marked bad" not in stuck.logs[0]
    assert "slot 1 is marked bad" not in stuck.logs[0]
    assert "(silent_corruption, no rank named)" in stuck.logs[0]


@pytest.mark.slow
def test_wrong_compute_before_the_all_reduce_is_caught_by_the_known_answer_check(jobs):
    compute = jobs["compute"]
    assert compute.exit_codes == [exit_codes.RESTARTS_EXHAUSTED], compute.logs[0][-3000:]
    (verdict,) = compute.events
    assert verdict["event"] == "compute_check" and verdict["step"] == COMPUTE_CHECK_EVERY
    assert verdict["bad_ranks"] == [1]
    incident = compute.incidents[0]
    assert incident["cause"] == "silent_corruption" and incident["rank"] == 1
    assert incident["bad_slot"]["slot"] == "1"
    assert incident["corruption"]["event"] == "compute_check"


@pytest.mark.slow
def test_every_corruption_verdict_is_an_incident_and_counted_in_goodput(jobs):
    transient, persistent = jobs["transient"], jobs["persistent"]
    assert [(i["cause"], i["action"], i["rank"], i["step"]) for i in transient.incidents] == [
        ("silent_corruption", "replay", 1, 8),
        ("silent_corruption", "replay", 0, STEPS),
    ]
    assert [i["corruption"]["window"] for i in transient.incidents] == [[4, 8], [8, STEPS]]
    assert all(i["corruption"]["event"] == "transient" for i in transient.incidents)
    goodput = json.loads(RunDir(transient.run_dir).goodput.read_text())
    assert goodput["corruption_verdicts"] == {"transient": 2}
    (final,) = persistent.incidents
    assert final["corruption"]["event"] == "persistent"
    assert final["corruption"]["window"] == [4, 6] and final["corruption"]["bad_ranks"] == [1]
    goodput = json.loads(RunDir(persistent.run_dir).goodput.read_text())
    assert goodput["corruption_verdicts"] == {"persistent": 1}
