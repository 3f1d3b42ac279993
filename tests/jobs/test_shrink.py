"""Going on without a broken slot: the mesh re-planned for fewer processes keeps the global
batch, and a job excluding a crash-looping slot finishes on the shrunk mesh, restored there from
the full mesh's in-memory snapshots, resharded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from harness import Finished, Job, LaunchJob, finish_all, job_env, wait_until

from msjax.config import load_config
from msjax.errors import MsjaxError
from msjax.launch.membership import MeshPlan, Slots, replan_mesh
from msjax.run_dir import RunDir
from tests.slurm_step import SLURM_STEP_ENV
from tests.small_runs import QUICK_RUN


def config_of(*overrides: str):
    return load_config(None, [*QUICK_RUN, *overrides])


# --- re-planning the mesh ------------------------------------------------------------------------


def test_replan_keeps_tensor_shrinks_data_and_fsdp_and_accumulates_to_keep_the_batch():
    config = config_of("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.global_batch=8")
    plan = replan_mesh(config, devices_per_proc=2, job_processes=4, healthy_processes=3)
    # 3 processes hold 6 devices, tensor 2 leaves 3 replicas, which do not divide 8: 2 do, and
    # fsdp stays the larger (memory per device); 4 rows per replica in 2 passes of 2, as before
    assert plan == MeshPlan(data=1, fsdp=2, pipe=1, tensor=2, grad_accum_steps=2, processes=2)
    assert plan.overrides() == [
        "mesh.data=1",
        "mesh.fsdp=2",
        "mesh.expert=1",
        "mesh.pipe=1",
        "mesh.tensor=2",
        "train.grad_accum_steps=2",
    ]


def moe_config_of(*overrides: str):
    """configs/tiny_moe.yaml (8 experts) on the given mesh."""
    return load_config(Path(__file__).parents[2] / "configs" / "tiny_moe.yaml", list(overrides))


def test_replan_of_an_expert_parallel_mesh_keeps_the_expert_axis_where_the_devices_allow():
    config = moe_config_of(
        "mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2", "train.global_batch=16"
    )
    plan = replan_mesh(config, devices_per_proc=2, job_processes=4, healthy_processes=3)
    # 2 processes hold 4 devices: tensor 2 leaves 2 replicas, expert 2 kept before fsdp 2;
    # 4 rows per replica and pass as before, 8 per replica now: 2 passes
    assert plan == MeshPlan(
        data=1, fsdp=1, pipe=1, tensor=2, grad_accum_steps=2, processes=2, expert=2
    )
    assert "mesh.expert=2" in plan.overrides()
    assert plan.describe() == (
        "data 1 x fsdp 1 x expert 2 x pipe 1 x tensor 2 on 2 processes, train.grad_accum_steps=2"
    )
    assert plan.applied(config).mesh.expert == 2


def test_replan_shrinks_the_expert_axis_to_a_divisor_of_the_jobs_when_it_must():
    config = moe_config_of(
        "mesh.data=1", "mesh.fsdp=1", "mesh.expert=4", "mesh.tensor=1", "train.global_batch=16"
    )
    # 3 healthy processes of one device: expert 3 would not divide the 8 experts; 2 does
    plan = replan_mesh(config, devices_per_proc=1, job_processes=4, healthy_processes=3)
    assert plan == MeshPlan(
        data=1, fsdp=1, pipe=1, tensor=1, grad_accum_steps=2, processes=2, expert=2
    )
    # the plan's config passes the trainer's checks with the experts split 2 ways
    assert plan.applied(config).mesh.expert == 2
    plan = replan_mesh(config, devices_per_proc=1, job_processes=4, healthy_processes=1)
    assert (plan.expert, plan.processes, plan.grad_accum_steps) == (1, 1, 4)
    assert plan.describe().startswith("data 1 x fsdp 1 x pipe 1 x tensor 1 on 1 processes")


def test_replan_uses_every_healthy_process_when_the_batch_allows():
    config = config_of("mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1", "train.global_batch=12")
    plan = replan_mesh(config, devices_per_proc=1, job_processes=4, healthy_processes=3)
    # 3 rows per replica and pass before; 4 rows per replica now, in 2 passes of at most 3
    assert (plan.data, plan.fsdp, plan.processes, plan.grad_accum_steps) == (3, 1, 3, 2)
    # 12 rows over 4 replicas in 3 passes: 1 row per pass; on 3 replicas 4 passes keep that
    config = config_of(
        "mesh.data=4",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "train.global_batch=12",
        "train.grad_accum_steps=3",
    )
    plan = replan_mesh(config, devices_per_proc=1, job_processes=4, healthy_processes=3)
    assert (plan.data, plan.grad_accum_steps) == (3, 4)


def test_replan_with_every_process_healthy_is_the_jobs_own_mesh_with_its_minus_one_filled():
    config = config_of("mesh.data=-1", "mesh.fsdp=2", "mesh.tensor=1", "train.grad_accum_steps=2")
    plan = replan_mesh(config, devices_per_proc=2, job_processes=4, healthy_processes=4)
    assert plan == MeshPlan(data=4, fsdp=2, pipe=1, tensor=1, grad_accum_steps=2, processes=4)


def test_replan_keeps_the_pipeline_and_its_microbatches_dividing_each_pass():
    config = config_of(
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.pipe=2",
        "mesh.tensor=1",
        "pipeline.microbatches=2",
        "train.global_batch=8",
    )
    plan = replan_mesh(config, devices_per_proc=2, job_processes=2, healthy_processes=1)
    # one replica of 2 stages on the healthy process: 8 rows in 2 passes of 4 (as before, 4
    # rows per replica per pass), each pass split into the pipeline's 2 microbatches
    assert (plan.data, plan.fsdp, plan.pipe, plan.grad_accum_steps, plan.processes) == (
        1,
        1,
        2,
        2,
        1,
    )


def test_replan_refuses_in_one_line_where_no_mesh_fits_the_healthy_processes():
    config = config_of("mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4")
    with pytest.raises(MsjaxError) as refused:
        replan_mesh(config, devices_per_proc=2, job_processes=4, healthy_processes=1)
    message = str(refused.value)
    assert "\n" not in message
    assert "1 healthy processes x 2 devices" in message and "pipe x tensor = 4" in message


def test_slots_give_an_excluded_slots_rank_to_a_spare_then_shrink_then_readmit_when_checked():
    slots = Slots(nprocs=4, spares=1)
    assert slots.exclude(3, now_unix_s=100.0) == 4  # the spare takes rank 3
    assert (slots.rank_slots, slots.slot_of(3)) == ([0, 1, 2, 4], 4)
    assert slots.exclude(1, now_unix_s=200.0) is None  # no spare left
    slots.arrange(2)  # a mesh on 2 of the 3 healthy slots
    assert slots.describe() == {"active": [0, 2], "spare": [], "idle": [4], "excluded": [1, 3]}
    assert slots.readmit_due(now_unix_s=350.0, after_s=0) == []  # 0: never
    assert slots.readmit_due(now_unix_s=250.0, after_s=100.0) == [3]  # slot 1: not yet
    assert slots.readmit_due(now_unix_s=350.0, after_s=100.0) == [3, 1]  # longest out first
    # due is not re-admitted: slot 3 failed its check and waits another time out, 1 passed
    slots.keep_out(3, now_unix_s=350.0)
    slots.readmit(1)
    assert slots.readmit_due(now_unix_s=400.0, after_s=100.0) == []
    assert slots.healthy() == [0, 1, 2, 4]
    slots.arrange(4)
    assert (slots.rank_slots, slots.describe()["excluded"]) == ([0, 1, 2, 4], [3])
    # slot 3 failed once: its time out doubled (200 s from 350), then doubles again
    assert slots.readmit_due(now_unix_s=450.0, after_s=100.0) == []
    assert slots.readmit_due(now_unix_s=550.0, after_s=100.0) == [3]
    slots.keep_out(3, now_unix_s=550.0)
    assert slots.readmit_due(now_unix_s=900.0, after_s=100.0) == []
    assert slots.readmit_due(now_unix_s=950.0, after_s=100.0) == [3]


# --- a job with a crash-looping slot -------------------------------------------------------------
# 4 processes x 2 devices (data 2 x fsdp 2 x tensor 2); the slot holding rank 3 at the start
# crashes before step CRASH_STEP at every start. After FAULTS_PER_SLOT crashes in a row it is
# excluded: a spare takes its rank (mesh unchanged), or with none the job shrinks to
# data 1 x fsdp 2 x tensor 2 on 2 processes with 2 accumulation passes (8 rows, as before).

# one fault marks the slot bad: the count of faults in a row is test_bad_slots.py's; each fault
# here costs an attempt of 4 processes
STEPS, SAVE_EVERY, CRASH_STEP, FAULTS_PER_SLOT = 12, 4, 6, 1
BAD_SLOT_FAULT = f"crash@step={CRASH_STEP},rank=3,times=99"
HEALED_SLOT_FAULT = f"crash@step={CRASH_STEP},rank=3,times={FAULTS_PER_SLOT}"  # then it works
# the attempt after slot 3's exclusion (attempt FAULTS_PER_SLOT); its rank 0 is held in its
# compile until slot 3's self-check for re-admission (seconds of imports and compiling) is over,
# so the check ends while the job runs however fast the machine steps, as in a long real job
AFTER_EXCLUSION = FAULTS_PER_SLOT
SHRUNK_MESH = ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "train.grad_accum_steps=2"]
# the shrink job snapshots every step in memory: its shrunk attempt puts its state together from
# the 4 processes' snapshots on the node, resharded, and reads nothing from the checkpoints
MEMORY_SNAPSHOTS = "checkpoint.memory_every_steps=1"
# the spare job runs as a Slurm task on a node given GPUs 20-29: slot s owns 20+2s and 21+2s
SPARE_NODE_ENV = {
    **SLURM_STEP_ENV,
    "CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in range(20, 30)),
}


def job_args(cache_dir: Path, *overrides: str) -> list[str]:
    return [
        *QUICK_RUN,
        f"train.steps={STEPS}",
        "train.eval_every=0",
        f"checkpoint.every_steps={SAVE_EVERY}",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "resilience.heartbeat_every_s=0.05",
        # a rank held stopped in its compile (HeldInCompile) stops its coordination heartbeats
        # too: on a loaded machine the hold can outlast JAX's default 100 s
        "resilience.peer_timeout_s=900",
        "resilience.stop_grace_s=2",
        "resilience.restart_backoff_s=0.1",
        f"resilience.max_faults_per_slot={FAULTS_PER_SLOT}",
        "resilience.readmit_after_s=0",
        f"resilience.compile_cache_dir={cache_dir}",
        *overrides,
    ]


class HeldInCompile:
    """A job's rank 0 SIGSTOPped once it compiles in attempt AFTER_EXCLUSION, and let go on once
    until(job) holds (held once at most). The held process may end meanwhile without this test's
    doing (the job's own fault handling may end a stopped rank): signalling it is then a no-op,
    and the job's records say what happened."""

    def __init__(self, job: LaunchJob, until: Callable[[LaunchJob], bool]):
        self.job = job
        self.until: Callable[[LaunchJob], bool] | None = until
        self.held_pid: int | None = None

    def poll(self) -> None:
        if self.until is None:
            return
        if self.until(self.job):
            self.release()
            self.until = None
            return
        if self.held_pid is not None:
            return
        record = self.job.heartbeat(0)
        compiling_after_exclusion = record is not None and (record.attempt, record.phase) == (
            AFTER_EXCLUSION,
            "compile",
        )
        if compiling_after_exclusion and signal_if_alive(record.pid, signal.SIGSTOP):
            self.held_pid = record.pid

    def release(self) -> None:
        if self.until is not None and self.held_pid is not None:
            signal_if_alive(self.held_pid, signal.SIGCONT)


def signal_if_alive(pid: int, signum: int) -> bool:
    """Send signum to pid; False where the process has already ended."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True


def run_jobs(jobs: dict[str, LaunchJob], holds: list[HeldInCompile] = ()) -> dict[str, Finished]:
    try:
        return finish_all(jobs, while_running=lambda: [hold.poll() for hold in holds])
    finally:
        for hold in holds:
            hold.release()


def job(run_dir: Path, nprocs: int, flags: list[str], args: list[str], **env: str) -> LaunchJob:
    return LaunchJob.start(
        run_dir, args, nprocs=nprocs, devices_per_proc=2, launch_flags=flags, env=env
    )


def readmitted(job: LaunchJob) -> bool:
    return job.printed("slot 3 re-admitted")


def readmitted_as_a_waiting_spare(job: LaunchJob) -> bool:
    waiting = job.run_dir / "logs" / "spare-slot3.log"
    return readmitted(job) and waiting.exists() and "imports done" in waiting.read_text()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Finished]:
    """The uninterrupted reference and the crash-looping job without a spare side by side;
    then the shrunk mesh started from the shrinking job's checkpoint, and the job with a spare."""
    cache = tmp_path_factory.mktemp("compile_cache")
    folder = {
        name: tmp_path_factory.mktemp(name) / "run" for name in ("ref", "shrink", "spare", "regrow")
    }
    finished = run_jobs(
        {
            "reference": job(folder["ref"], 4, [], job_args(cache)),
            "shrink": job(
                folder["shrink"],
                4,
                [f"--fault={BAD_SLOT_FAULT}"],
                job_args(cache, MEMORY_SNAPSHOTS),
            ),
        }
    )
    # the newest checkpoint before the crash-looping step (the shrunk attempt restored a newer
    # step from memory)
    from_checkpoint = tmp_path_factory.mktemp("from_checkpoint") / "run"
    resume = f"checkpoint.resume_from={folder['shrink'] / 'checkpoints' / str(SAVE_EVERY)}"
    shrunk_args = job_args(cache, *SHRUNK_MESH, resume)
    started = {
        "from_checkpoint": job(from_checkpoint, 2, [], shrunk_args),
        "spare": job(
            folder["spare"],
            4,
            ["--spares=1", f"--fault={HEALED_SLOT_FAULT}"],
            job_args(cache, "resilience.readmit_after_s=1"),
            **SPARE_NODE_ENV,
        ),
        "regrow": job(
            folder["regrow"],
            4,
            [f"--fault={HEALED_SLOT_FAULT}"],
            job_args(cache, "resilience.readmit_after_s=1"),
        ),
    }
    holds = [
        HeldInCompile(started["spare"], readmitted_as_a_waiting_spare),
        HeldInCompile(started["regrow"], readmitted),
    ]
    finished |= run_jobs(started, holds)
    return finished


@pytest.mark.slow
def test_crash_looping_slot_is_excluded_and_the_job_finishes_on_a_shrunk_mesh(jobs):
    shrink = jobs["shrink"]
    assert shrink.exit_code == 0, shrink.output[-4000:]
    assert "slot 3 is marked bad: the named cause of 1 fault (incident 1: crash;" in shrink.output
    assert "slot 3 (rank 3) excluded; no spare left" in shrink.output
    assert "data 1 x fsdp 2 x pipe 1 x tensor 2 on 2 processes" in shrink.output
    incidents = shrink.jsonl("incidents.jsonl")
    assert [(i["cause"], i["rank"]) for i in incidents] == [("crash", 3)] * FAULTS_PER_SLOT
    membership = incidents[-1]["membership"]
    assert (membership["action"], membership["slot"]) == ("shrink", 3)
    assert membership["incidents"] == list(range(1, FAULTS_PER_SLOT + 1))
    assert membership["slots"] == {"active": [0, 1], "spare": [], "idle": [2], "excluded": [3]}
    # the timings of the change: first fault <= detected <= excluded <= first step on the mesh
    assert (
        membership["first_fault_unix_s"]
        <= membership["detected_unix_s"]
        <= membership["excluded_unix_s"]
        <= membership["first_step_unix_s"]
    )
    assert membership["first_fault_to_new_mesh_s"] > 0
    # the slot's fault fired at each of its starts and never after it left the job
    firings = shrink.jsonl("faults.jsonl")
    assert [(f["slot"], f["step"]) for f in firings] == [(3, CRASH_STEP)] * FAULTS_PER_SLOT
    assert set(shrink.losses()) == set(range(STEPS))


@pytest.mark.slow
def test_shrunk_attempt_restores_from_the_full_meshs_snapshots_in_memory_resharded(jobs):
    shrink = jobs["shrink"]
    incident = shrink.incidents()[-1]
    restored = incident["resumed_from_step"]
    assert incident["resumed_from"] == "memory"
    assert SAVE_EVERY < restored <= CRASH_STEP  # newer than the newest checkpoint
    by_rank = incident["restored_by_rank"]
    assert sorted(by_rank) == ["0", "1"]
    assert {(r["source"], r["from_processes"]) for r in by_rank.values()} == {("resharded", 4)}
    assert all(r["bytes"] > 0 for r in by_rank.values())
    # one node: every piece was in its own memory, none came over the network
    assert [r["remote_bytes"] for r in by_rank.values()] == [0, 0]
    for rank in (0, 1):
        log = RunDir(shrink.run_dir).log(rank).read_text().splitlines()
        (line,) = [line for line in log if "resharded from 4 processes" in line]
        assert f"restored step {restored} from memory" in line
        assert "(0 bytes from other nodes)" in line
        assert "0 bytes read from the checkpoint directory" in line


@pytest.mark.slow
def test_shrunk_job_matches_a_run_started_on_that_mesh_from_the_same_checkpoint(jobs):
    shrink, started = jobs["shrink"], jobs["from_checkpoint"]
    assert started.exit_code == 0, started.output[-4000:]
    restored = shrink.incidents()[-1]["resumed_from_step"]
    shrunk, fresh = shrink.losses(), started.losses()
    assert sorted(fresh) == list(range(SAVE_EVERY, STEPS))
    # the shrunk job trained the steps before `restored` on the full mesh: the same rows, summed
    # in another order (another batch would differ by ~1e-1)
    steps = range(restored, STEPS)
    np.testing.assert_allclose([shrunk[s] for s in steps], [fresh[s] for s in steps], atol=1e-4)


@pytest.mark.slow
def test_shrunk_mesh_sees_the_same_global_batches_as_the_full_one(jobs):
    # 2 processes accumulating over 2 passes, 4 processes in one: the same rows at each step,
    # so the same losses up to float32 summation order (another batch would differ by ~1e-1)
    shrunk, reference = jobs["shrink"].losses(), jobs["reference"].losses()
    assert jobs["reference"].exit_code == 0
    steps = range(SAVE_EVERY, STEPS)
    np.testing.assert_allclose(
        [shrunk[s] for s in steps], [reference[s] for s in steps], rtol=0, atol=1e-4
    )


@pytest.mark.slow
def test_spare_takes_the_excluded_slots_rank_and_the_run_is_bitwise_the_uninterrupted_one(jobs):
    spare, reference = jobs["spare"], jobs["reference"]
    assert spare.exit_code == 0, spare.output[-4000:]
    assert "spare slot 4 takes rank 3, the mesh is unchanged" in spare.output
    incidents = spare.jsonl("incidents.jsonl")
    causes = [(i["cause"], i["rank"]) for i in incidents]
    assert causes == [("crash", 3)] * FAULTS_PER_SLOT, unexpected_incidents(spare, incidents)
    membership = incidents[FAULTS_PER_SLOT - 1]["membership"]
    assert (membership["action"], membership["slot"], membership["spare_slot"]) == ("spare", 3, 4)
    assert membership["slots"]["active"] == [0, 1, 2, 4]
    assert membership["first_fault_to_new_mesh_s"] > 0
    # the spare ran rank 3 (it did not inherit slot 3's fault) in the waiting process itself
    assert "imports done" in (spare.run_dir / "logs" / "spare-slot4.log").read_text()
    # and what it printed as rank 3 is in rank 3's log, after the header of its attempt
    rank_log = (spare.run_dir / "logs" / "rank3.log").read_text()
    as_rank = rank_log.split(", rank 3, pid ")[-1]  # the attempt the spare took rank 3 in
    assert " waited " in as_rank.splitlines()[0] and "slot 4 takes rank 3" in as_rank
    # each slot's worker saw its own GPUs alone: slot 3's while it crashed, then the spare's
    devices = "msjax: process {}: devices CUDA_VISIBLE_DEVICES={}, local devices 0,1"
    assert devices.format(3, "26,27") in rank_log.split(", rank 3, pid ")[0]
    assert devices.format(3, "28,29") in as_rank and "26,27" not in as_rank
    assert devices.format(0, "20,21") in (spare.run_dir / "logs" / "rank0.log").read_text()
    # slot 3's check for re-admission ran on slot 3's GPUs, alone
    check_log = (spare.run_dir / "logs" / "check-slot3.log").read_text()
    assert devices.format(0, "26,27") in check_log
    crashes = [f for f in spare.jsonl("faults.jsonl") if f["kind"] == "crash"]
    assert [f["slot"] for f in crashes] == [3] * FAULTS_PER_SLOT
    # on the job's own mesh, slot 3 (healed) re-admitted after its check and its training probe
    # past step CRASH_STEP passed waits as a spare
    readmitted = (
        "slot 3 re-admitted after resilience.readmit_after_s=1, its self-check passed and its "
        "probe trained (probes/slot3-1)"
    )
    assert f"{readmitted}: a spare now" in spare.output
    assert (spare.run_dir / "logs" / "check-slot3.log").exists()
    assert "imports done" in (spare.run_dir / "logs" / "spare-slot3.log").read_text()
    losses, expected = spare.losses(), reference.losses()
    assert sorted(losses) == list(range(STEPS))
    assert [losses[s] for s in range(STEPS)] == [expected[s] for s in range(STEPS)]  # bitwise


def unexpected_incidents(job: Finished, incidents: list[dict]) -> str:
    """What a failed assertion shows of the incidents past the injected ones: each record whole,
    and the end of its rank's log in the attempt it happened in."""
    described = []
    for incident in incidents[FAULTS_PER_SLOT:]:
        log = job.run_dir / "logs" / f"rank{incident['rank']}.log"
        text = log.read_text() if log.exists() else "(no log)"
        after_header = text.split(f"=== msjax.launch: attempt {incident['attempt']}, ")[-1]
        attempt = after_header.split("=== msjax.launch: attempt ")[0]
        described.append(f"{json.dumps(incident)}\n{attempt[-3000:]}")
    return "\n\n".join(described)


def first_number(output: str) -> int | None:
    """The number on output's first line, once that line is whole."""
    first, newline, _ = output.partition("\n")
    return int(first) if newline else None


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"  # ended, not reaped by its new parent


def test_a_waiting_process_imports_everything_and_starts_no_jax_backend():
    """What a spare or a warm standby imports while it waits starts no backend: on a GPU node it
    holds no device memory beside the rank's own worker, and XLA_FLAGS set later still count."""
    script = (
        "import importlib\n"
        "from msjax.launch.spare import WARM_IMPORTS\n"
        "for name in WARM_IMPORTS: importlib.import_module(name)\n"
        "from jax._src import xla_bridge\n"
        "print('backends started:', xla_bridge.backends_are_initialized())\n"
    )
    env = job_env()
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "backends started: False", result.stdout


@pytest.mark.slow
def test_spare_waits_bounded_and_leaves_when_its_supervisor_is_gone(tmp_path):
    env = job_env()
    spare = [sys.executable, "-m", "msjax.launch.spare", str(tmp_path)]
    # never handed a rank, it leaves after --max-wait-s with nothing written
    waited = subprocess.run(
        [*spare, "0", "--max-wait-s=0.5"], capture_output=True, text=True, env=env, timeout=300
    )
    assert waited.returncode == 0, waited.stderr[-2000:]
    assert "slot 0 ready in" in waited.stdout and "slot 0 not needed; leaving" in waited.stdout
    assert list(tmp_path.iterdir()) == []
    # its supervisor killed, it leaves at once (it had no deadline of its own)
    # its stdin a pipe only the supervisor holds, as msjax.launch's spares have (a command put
    # in the background would read /dev/null, the end of its input, at once)
    log, pipe = tmp_path / "spare1.log", tmp_path / "assignments"
    supervise = f"mkfifo {pipe}; {' '.join(spare)} 1 < {pipe} > {log} 2>&1 & exec 3> {pipe}; "
    supervisor = Job(
        ["bash", "-c", supervise + "echo $!; sleep 600 3>&-"],
        tmp_path,
        tmp_path / "supervisor.log",
        env,
    )
    pid = supervisor.wait_for(lambda: first_number(supervisor.output), "the spare's pid")
    try:
        ready = lambda: log.exists() and "waiting for a rank" in log.read_text()  # noqa: E731
        supervisor.wait_for(lambda: ready() or _gone(pid), "the spare's 'waiting for a rank'")
        assert not _gone(pid), "the spare did not get ready"
        supervisor.kill()
        wait_until(lambda: _gone(pid), f"the spare {pid} leaving once its supervisor is gone")
    finally:
        supervisor.kill()
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_readmitted_slot_brings_the_job_back_to_the_full_mesh_at_its_next_checkpoint(jobs):
    regrow, reference = jobs["regrow"], jobs["reference"]
    assert regrow.exit_code == 0, regrow.output[-4000:]
    incidents = regrow.jsonl("incidents.jsonl")
    assert [i["cause"] for i in incidents] == ["crash"] * FAULTS_PER_SLOT + ["regrow"]
    assert incidents[FAULTS_PER_SLOT - 1]["membership"]["action"] == "shrink"
    back = incidents[-1]
    assert back["membership"]["mesh"].endswith("on 4 processes, train.grad_accum_steps=1")
    assert back["membership"]["slots"]["active"] == [0, 1, 2, 3]
    # re-admitted once its own self-check passed (a crash does not show in it), slot 3 alone
    assert "slot 3 re-admitted after resilience.readmit_after_s=1, its self-check passed" in (
        regrow.output
    )
    readmitted = back["membership"]["readmitted"]["3"]
    check = json.loads((regrow.run_dir / readmitted["health"]).read_text())
    assert (check["passed"], sorted(check["ranks"])) == (True, ["0"])
    # on the job's mesh shrunk onto one process: its tensor pairs, within the slot
    [tensor] = check["ranks"]["0"]["collectives"]
    assert (tensor["axis"], tensor["size"], tensor["ok"]) == ("tensor", 2, True)
    excluded_unix_s = incidents[FAULTS_PER_SLOT - 1]["membership"]["excluded_unix_s"]
    assert readmitted["checked_unix_s"] >= excluded_unix_s + 1 + check["wall_s"] - 0.5
    assert (regrow.run_dir / "logs" / "check-slot3.log").exists()
    # it waited for a checkpoint the shrunk mesh committed, and resumed from it on 4 processes
    assert back["resumed_from_step"] > SAVE_EVERY
    assert f"attempt {FAULTS_PER_SLOT + 1}: 4 workers (ranks 0-3 of 4)" in regrow.output
    crashes = [f for f in regrow.jsonl("faults.jsonl") if f["kind"] == "crash"]
    assert [f["slot"] for f in crashes] == [3] * FAULTS_PER_SLOT
    losses, expected = regrow.losses(), reference.losses()
    np.testing.assert_allclose(
        [losses[s] for s in range(STEPS)], [expected[s] for s in range(STEPS)], atol=1e-4
    )
