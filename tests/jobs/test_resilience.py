"""Supervised multi-process jobs under real faults: a worker SIGKILLed and SIGSTOPped from outside,
a crash during a checkpoint save and a NaN loss injected, a fault storm past the restart budget.

Every run is a real `python -m msjax.launch` with two `python -m msjax.train` workers of one
`jax.distributed` job (2 processes x 2 CPU devices). One run takes all four faults in turn and
must end with parameters bitwise equal to an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import REPO, Finished, LaunchJob, job_env

from msjax.launch.incidents import IncidentDir
from msjax.resilience import exit_codes
from msjax.resilience.faults import parse_faults, read_firings
from msjax.resilience.heartbeat import STARTUP_MARKS, HeartbeatRecord
from msjax.resilience.skips import read_skipped_steps, record_skipped_step
from msjax.run_dir import RunDir

STEPS = 12
SAVE_EVERY = 3
NAN_STEP = 8
STEP_DEADLINE_S = 8.0
STOP_GRACE_S = 2.0


def train_args(cache_dir: Path) -> list[str]:
    return [
        "model.num_layers=2",
        "data.seq_len=32",
        "data.max_corpus_mib=1",
        "train.global_batch=8",
        f"train.steps={STEPS}",
        "train.eval_every=0",
        "train.peak_tflops=0.5",
        f"checkpoint.every_steps={SAVE_EVERY}",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=1",
        "resilience.heartbeat_every_s=0.02",
        f"resilience.step_deadline_s={STEP_DEADLINE_S}",
        f"resilience.stop_grace_s={STOP_GRACE_S}",
        "resilience.restart_backoff_s=0.1",
        f"resilience.compile_cache_dir={cache_dir}",
    ]


def launch(
    run_dir: Path, cache_dir: Path, launch_flags: list[str] = (), overrides: list[str] = ()
) -> LaunchJob:
    """One `python -m msjax.launch --nprocs 2 --devices-per-proc 2` job."""
    return LaunchJob.start(
        run_dir,
        [*train_args(cache_dir), *overrides],
        nprocs=2,
        devices_per_proc=2,
        launch_flags=launch_flags,
    )


def checkpoint_arrays(run_dir: Path, step: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Every array of a checkpoint, read onto one local device (fingerprints verified), and its
    meta."""
    import jax

    from msjax.checkpoint.fingerprint import leaf_name
    from msjax.checkpoint.manager import Checkpointer
    from msjax.config import CheckpointConfig

    reader = Checkpointer(RunDir(run_dir).checkpoints, CheckpointConfig(), read_only=True)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
        reader.array_metadata(step),
    )
    restored = reader.restore(step, abstract)
    reader.close()
    leaves = jax.tree_util.tree_flatten_with_path(restored.state)[0]
    return {leaf_name(path): np.asarray(leaf) for path, leaf in leaves}, restored.meta


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One compilation cache for every run of this module (restarts are meant to hit it)."""
    return tmp_path_factory.mktemp("compile_cache")


@pytest.fixture(scope="module")
def started(tmp_path_factory, cache_dir) -> Iterator[dict[str, LaunchJob]]:
    """The reference job and the fault-storm job, run side by side (the timing-sensitive faulty
    job runs alone afterwards)."""
    reference_dir = tmp_path_factory.mktemp("reference") / "run"
    reference_dir.mkdir()
    record_skipped_step(reference_dir, NAN_STEP, "the faulty run's rollback skips it too")
    storm = "crash@step=4,rank=1,times=5"
    jobs = {
        "reference": launch(reference_dir, cache_dir),
        "storm": launch(
            tmp_path_factory.mktemp("storm") / "run",
            cache_dir,
            ["--max-restarts=1", f"--fault={storm}"],
        ),
    }
    yield jobs
    for job in jobs.values():
        job.kill()


@pytest.fixture(scope="module")
def reference(started) -> Finished:
    """The same job, uninterrupted, told to skip the batch the faulty run's NaN makes it skip."""
    return started["reference"].finish()


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, cache_dir, started, reference) -> Finished:
    """One job through four faults, in this order:
    1. rank 1 SIGKILLed from outside after step 4 (checkpoint 3 on disk);
    2. rank 1 crashes while checkpoint 6 is being written (injected);
    3. rank 0 reads a NaN loss at step 8 (injected): roll back to checkpoint 6, skip step 8;
    4. rank 0 SIGSTOPped from outside after step 10: a hang, caught by its heartbeat deadline.
    The signals are sent while the rank waits in an injected hang (before step 5 and step 11),
    once the save before it has committed (and attempt 0's standbys have started), so they land
    between the same steps however fast the machine steps.
    Its restarts take warm standbys (started from each attempt's first step on), so the
    reference's parameters are also those of workers that waited with their imports done."""
    started["storm"].finish()  # alone on the CPUs: hang detection is about time
    run_dir = tmp_path_factory.mktemp("faulty") / "run"
    faults = ";".join(
        [
            "hang@step=5,rank=1",
            "crash_in_save@step=6,rank=1",
            f"nan@step={NAN_STEP},rank=0",
            "hang@step=11,rank=0",
        ]
    )
    standbys = ["resilience.warm_standby_after_s=0"]
    job = launch(run_dir, cache_dir, [f"--fault={faults}"], standbys)
    pid = job.wait_for(hanging(run_dir, rank=1, step=5), "rank 1 waiting before step 5")
    job.wait_for(lambda: SAVE_EVERY in job.committed_steps(), "checkpoint 3 committed")
    job.wait_for(lambda: job.printed("attempt 0: warm standbys start"), "standbys started")
    os.kill(pid, signal.SIGKILL)
    pid = job.wait_for(hanging(run_dir, rank=0, step=11), "rank 0 waiting before step 11")
    job.wait_for(lambda: 3 * SAVE_EVERY in job.committed_steps(), "checkpoint 9 committed")
    os.kill(pid, signal.SIGSTOP)
    return job.finish()


def hanging(run_dir: Path, rank: int, step: int) -> Callable[[], int | None]:
    """A condition: rank's injected hang before `step` has fired; gives the hanging pid."""

    def fired() -> int | None:
        for firing in read_firings(run_dir):
            if (firing["kind"], firing["rank"], firing["step"]) == ("hang", rank, step):
                return firing["pid"]
        return None

    return fired


def incident(runs: Finished, number: int) -> dict[str, Any]:
    assert len(runs.incidents()) >= number, runs.output[-5000:]
    return runs.incidents()[number - 1]


@pytest.mark.slow
def test_uninterrupted_reference_job_finishes_with_no_incident(reference):
    assert reference.exit_code == exit_codes.OK, reference.output[-5000:]
    assert not RunDir(reference.run_dir).incidents_log.exists()
    assert STEPS in reference.committed_steps()


@pytest.mark.slow
def test_job_through_four_faults_reaches_the_last_step_by_itself(faulty):
    assert faulty.exit_code == exit_codes.OK, faulty.output[-5000:]
    assert [record["cause"] for record in faulty.incidents()] == [
        "crash",
        "crash",
        "nonfinite_loss",
        "hang",
    ], faulty.output[-5000:]
    assert STEPS in faulty.committed_steps()


@pytest.mark.slow
def test_job_through_four_faults_ends_with_parameters_bitwise_equal_to_the_reference(
    faulty, reference
):
    arrays, meta = checkpoint_arrays(faulty.run_dir, STEPS)
    expected, expected_meta = checkpoint_arrays(reference.run_dir, STEPS)
    assert meta["fingerprints"] == expected_meta["fingerprints"]
    assert sorted(arrays) == sorted(expected)
    for name, value in expected.items():
        assert arrays[name].tobytes() == value.tobytes(), name


@pytest.mark.slow
def test_restarts_take_the_warm_standbys_and_their_output_goes_to_the_ranks_logs(faulty):
    started = [line for line in faulty.output.splitlines() if "warm standbys start" in line]
    assert started[0].endswith("attempt 0: warm standbys start in slot(s) 0 1"), started
    attempts = [line for line in faulty.output.splitlines() if ": 2 workers (ranks 0-1" in line]
    assert len(attempts) == 5, attempts  # the first and four restarts
    assert "waiting with their imports done" not in attempts[0]
    assert attempts[1].endswith(", 2 of them waiting with their imports done"), attempts[1]
    for rank in (0, 1):
        log = RunDir(faulty.run_dir).log(rank).read_text()
        # the SIGKILLed worker's successor: the standby of attempt 0, its pid named in the header
        header = next(line for line in log.splitlines() if "attempt 1, rank" in line)
        pid = int(header.split(" pid ")[1].split()[0])
        assert str(pid) in attempts[1].split("pids ")[1].split(",")[0].split(), attempts[1]
        assert f"slot {rank} takes rank {rank}" in log.split(header)[1]
        standby = RunDir(faulty.run_dir).standby_log(rank).read_text()
        assert "imports done" in standby and "takes rank" not in standby
    # rank 0's output reaches the launcher's, as a fresh worker's would; rank 1's does not
    assert "msjax.launch.spare: slot 0 takes rank 0" in faulty.output
    assert "msjax.launch.spare: slot 1 takes rank 1" not in faulty.output


@pytest.mark.slow
def test_sigkill_of_a_worker_is_a_crash_of_that_rank_resumed_from_the_last_checkpoint(faulty):
    record = incident(faulty, 1)
    assert (record["rank"], record["detail"]) == (1, "killed by SIGKILL")
    assert record["step"] >= 4 and record["resumed_from_step"] == SAVE_EVERY
    assert record["steps_lost"] == record["step"] - SAVE_EVERY
    # timed by its exit, not by the injected hang the rank was waiting in when it was killed
    assert record["fault_time_from"] == "exit seen by polling"
    assert 0 <= record["detection_latency_s"] < 2.0
    assert record["restart_s"] > 0 and record["catch_up_s"] >= record["restart_s"]
    # where the restart's seconds went, in the order the ranks got there, up to the first step
    split = record["startup_s"]
    assert list(split) == [mark for mark in STARTUP_MARKS if mark in split]
    assert {"main", "distributed_joined", "train_step_compiled", "first_step_done"} <= set(split)
    assert list(split.values()) == sorted(split.values())


@pytest.mark.slow
def test_crash_during_a_save_resumes_from_the_checkpoint_before_it(faulty):
    record = incident(faulty, 2)
    assert (record["rank"], record["detail"]) == (1, "exit code 1")
    assert record["phase"] == "checkpoint"
    assert record["fault_time_from"] == "injection record (crash_in_save@step=6,rank=1)"
    assert record["resumed_from_step"] == SAVE_EVERY  # checkpoint 6 was never finalized


@pytest.mark.slow
def test_nonfinite_loss_rolls_back_and_skips_that_steps_batch(faulty):
    record = incident(faulty, 3)
    assert (record["cause"], record["rank"], record["skipped_step"]) == (
        "nonfinite_loss",
        0,
        NAN_STEP,
    )
    assert record["resumed_from_step"] == 2 * SAVE_EVERY
    assert read_skipped_steps(faulty.run_dir) == {NAN_STEP}
    metrics = faulty.metrics()
    skipped = [m for m in metrics if m.get("event") == "skipped"]
    assert skipped  # once per attempt that passed it: the hang later replays step 8 too
    assert all(
        m == {"step": NAN_STEP, "event": "skipped", "reason": "non-finite loss"} for m in skipped
    )


@pytest.mark.slow
def test_sigstopped_worker_is_a_hang_caught_by_its_heartbeat_deadline(faulty):
    record = incident(faulty, 4)
    assert (record["cause"], record["rank"]) == ("hang", 0)
    assert "stopped" in record["detail"]
    # from its last heartbeat with progress (the supervisor's clock reads it a little later)
    assert STEP_DEADLINE_S - 1 <= record["detection_latency_s"] < STEP_DEADLINE_S + 5
    assert record["resumed_from_step"] == 3 * SAVE_EVERY
    assert record["steps_lost"] == record["step"] - 3 * SAVE_EVERY
    diagnostics = IncidentDir(faulty.run_dir / record["diagnostics"])
    assert "File" in diagnostics.stacks(0).read_text()  # the stopped worker's, via SIGUSR1
    # the flight recorders agree: rank 0's dumps stopped while rank 1's went on
    assert record["flight_recorder"].startswith("rank 0 "), record["flight_recorder"]
    assert diagnostics.flight_copy(RunDir(faulty.run_dir).flight_record(1)).exists()


@pytest.mark.slow
def test_incidents_and_goodput_summary_are_in_the_run_dir(faulty):
    for record in faulty.incidents():
        diagnostics = IncidentDir(faulty.run_dir / record["diagnostics"])
        heartbeats = json.loads(diagnostics.heartbeats.read_text())
        assert heartbeats["cause"] == record["cause"]
        assert record["catch_up_s"] is not None, record
    goodput = json.loads(RunDir(faulty.run_dir).goodput.read_text())
    assert goodput["outcome"] == "done" and goodput["incidents"] == 4
    assert 0 < goodput["effective_training_time_ratio"] < 1
    assert sum(goodput["breakdown_s"].values()) == pytest.approx(goodput["wall_s"], abs=0.1)
    assert "goodput: effective training time" in faulty.output


@pytest.mark.slow
def test_fault_storm_past_the_restart_budget_stops_and_keeps_the_last_good_checkpoint(started):
    job = started["storm"].finish()
    run_dir = job.run_dir
    assert job.exit_code == exit_codes.RESTARTS_EXHAUSTED, job.output[-5000:]
    incidents = job.incidents()
    # the first attempt committed a checkpoint: its restart is free; the next two committed none
    assert [(r["cause"], r["rank"], r["action"]) for r in incidents] == [
        ("crash", 1, "restart"),
        ("crash", 1, "restart"),
        ("crash", 1, "stop"),
    ]
    reason = incidents[-1]["stop_reason"]
    assert reason.startswith("restart budget spent (resilience.max_restarts=1: restarts after")
    assert "restart 1 (0 of resilience.max_restarts=1 spent)" in job.output
    assert "restart 2 (1 of resilience.max_restarts=1 spent)" in job.output
    # the crash waited for its saves: rank 0, stuck in the step's collective with no save being
    # written, is SIGKILLed at once instead of waiting out its grace after SIGTERM
    assert [(r["killed_at_once"], r["killed_after_grace"]) for r in incidents] == [([0], [])] * 3
    assert all(r["stop_s"] < STOP_GRACE_S for r in incidents), incidents
    assert reason in job.output
    assert job.committed_steps() == [SAVE_EVERY]
    arrays, meta = checkpoint_arrays(run_dir, SAVE_EVERY)  # reads back with fingerprints intact
    assert meta["step"] == SAVE_EVERY and arrays


def test_fault_specs_parse_and_bad_ones_are_one_line_errors():
    (fault,) = parse_faults("slow@step=2,rank=1,percent=50")
    assert (fault.kind, fault.step, fault.rank, fault.percent) == ("slow", 2, 1, 50.0)
    from msjax.errors import MsjaxError

    for bad in ("boom@step=1,rank=0", "crash@step=1", "nan@step=x,rank=0", "slow@step=1,rank=0"):
        with pytest.raises(MsjaxError):
            parse_faults(bad)


# --- cluster launchers: their wiring to the exit codes -------------------------------------------


def run_sbatch_script(tmp_path: Path, srun_exit_code: int) -> tuple[int, str, str]:
    """launch/slurm/train.sbatch run by bash with stand-ins for srun and scontrol; returns its
    exit code, the srun command line and what scontrol was asked."""
    bin_dir = tmp_path / f"bin{srun_exit_code}"
    bin_dir.mkdir()
    calls = tmp_path / f"calls{srun_exit_code}"
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "srun $*" >> {calls}\nexit {srun_exit_code}\n')
    (bin_dir / "scontrol").write_text(
        f'#!/bin/sh\necho "scontrol $*" >> {calls}\n'
        'case "$*" in "show hostnames"*) echo n7; echo n8 ;;\n'
        '"show node n7") echo "NodeName=n7 Arch=x86_64 NodeAddr=10.0.0.7 NodeHostName=n7" ;; esac\n'
    )
    for stand_in in bin_dir.iterdir():
        stand_in.chmod(0o755)
    env = job_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_ID="42",
        SLURM_JOB_NODELIST="n[7-8]",
        # each exit code is a job of its own: none spends another's requeue budget
        REQUEUE_STATE=str(tmp_path / f"requeues{srun_exit_code}"),
    )
    script = REPO / "launch" / "slurm" / "train.sbatch"
    done = subprocess.run(
        ["bash", str(script), "--config", "configs/tiny.yaml"], env=env, capture_output=True
    )
    lines = calls.read_text().splitlines()
    srun = next(line for line in lines if line.startswith("srun "))
    scontrol = "\n".join(line for line in lines if line.startswith("scontrol requeue"))
    return done.returncode, srun, scontrol


def test_slurm_script_requeues_on_retryable_exit_codes_and_not_on_fatal_ones(tmp_path):
    script = (REPO / "launch" / "slurm" / "train.sbatch").read_text()
    directives = [line.split()[1] for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "--requeue" in directives and "--ntasks-per-node=1" in directives
    assert any(d.startswith("--signal=TERM@") for d in directives)  # time to save before a kill
    assert f'FATAL_EXIT_CODES="{" ".join(map(str, exit_codes.FATAL))}"' in script
    for code in (exit_codes.OK, *exit_codes.FATAL, *exit_codes.RETRYABLE, 137):
        exit_code, srun, scontrol = run_sbatch_script(tmp_path, code)
        assert exit_code == code
        # the coordinator: the first node at its NodeAddr, a port from the job id
        assert (
            "python -m msjax.launch --cluster slurm --coordinator 10.0.0.7:10042 --nprocs 1 -- "
            "--config configs/tiny.yaml" in srun
        )
        requeued = scontrol == "scontrol requeue 42"
        assert requeued == (code not in (exit_codes.OK, *exit_codes.FATAL)), (code, scontrol)


def test_k8s_jobset_fails_on_fatal_exit_codes_and_restarts_every_pod_otherwise():
    import yaml

    jobset = yaml.safe_load((REPO / "launch" / "k8s" / "jobset.yaml").read_text())
    name = jobset["metadata"]["name"]
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    (fatal_rule,) = job["podFailurePolicy"]["rules"]
    assert fatal_rule["action"] == "FailJob"
    assert fatal_rule["onExitCodes"]["operator"] == "In"
    assert sorted(fatal_rule["onExitCodes"]["values"]) == sorted(exit_codes.FATAL)
    assert fatal_rule["onExitCodes"]["containerName"] == container["name"]
    assert job["backoffLimit"] == 0  # any other failure fails the Job ...
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] >= 1  # ... and the JobSet restarts every pod
    assert policy["rules"][0]["action"] == "FailJobSet"
    assert policy["rules"][0]["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    assert container["command"] == ["python", "-m", "msjax.launch"]
    args = container["args"]
    assert f"--nnodes={job['parallelism']}" in args
    assert "--node-rank=$(JOB_COMPLETION_INDEX)" in args
    assert f"--coordinator={name}-{replicated['name']}-0-0.{name}:29500" in args
    assert args[args.index("--") + 1 :][0].startswith("--config=")


def test_launcher_reads_the_node_layout_from_slurm():
    from msjax.launch.job_options import first_slurm_host, slurm_layout

    assert first_slurm_host("gpu[003-005,9],cpu1") == "gpu003"
    assert first_slurm_host("node7") == "node7"
    environ = {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "a[10-13]"}
    assert slurm_layout(environ) == (4, 2, "a10:29500")


def test_injected_faults_fire_on_their_rank_as_often_as_asked_over_restarts(tmp_path):
    from msjax.resilience.faults import FaultInjector

    faults = parse_faults("nan@step=3,rank=1,times=2;nan@step=3,rank=0")
    for attempt in range(3):  # three attempts of rank 1 through step 3
        injector = FaultInjector(faults, tmp_path, rank=1, attempt=attempt)
        assert injector.loss(2, 1.5) == 1.5
        assert np.isnan(injector.loss(3, 1.5)) == (attempt < 2)
    assert [(f["fault"], f["attempt"]) for f in read_firings(tmp_path)] == [
        ("nan@step=3,rank=1,times=2", 0),
        ("nan@step=3,rank=1,times=2", 1),
    ]


def test_slow_fault_stretches_each_step_of_its_rank_by_the_given_share(tmp_path):
    from msjax.resilience.faults import FaultInjector

    injector = FaultInjector(parse_faults("slow@step=1,rank=0,percent=100"), tmp_path, 0, 0)
    started = []
    for step in range(5):
        started.append(time.perf_counter())
        injector.before_step(step, wait_for_saves=lambda: None)
        time.sleep(0.05)  # the step's own work
    gaps = np.diff(started)  # gaps[s]: the pause made for step s - 1, then step s's work
    assert all(gap < 0.09 for gap in gaps[:2])  # no pause for step 0
    assert all(gap >= 0.095 for gap in gaps[2:])  # from step 1 on, a pause as long as the step


def test_a_nonfinite_loss_lets_the_saves_in_flight_commit_before_the_rank_says_it_leaves(
    tmp_path,
):
    from msjax.resilience.heartbeat import Heartbeat
    from msjax.resilience.worker import NonFiniteLoss, WorkerResilience

    heartbeat = Heartbeat(tmp_path, 0, every_s=0.0)
    phases_while_waiting = []

    def wait_for_saves() -> None:  # the supervisor reads the heartbeat meanwhile
        record = HeartbeatRecord.read(heartbeat.path)
        phases_while_waiting.append(record.phase if record else None)

    worker = WorkerResilience(tmp_path, heartbeat, 0, wait_for_saves, lambda step: None)
    worker.step_end({"step": 4, "loss": 2.5})
    assert phases_while_waiting == []  # a finite loss waits for nothing
    with pytest.raises(NonFiniteLoss, match="the loss of step 5 is nan"):
        worker.step_end({"step": 5, "loss": float("nan")})
    # the save of the state before step 5 commits while the rank drains; only then does it say
    # its loss was not finite (the supervisor stops it at once on that)
    assert phases_while_waiting == ["drain"]
    record = HeartbeatRecord.read(heartbeat.path)
    assert record is not None and (record.phase, record.step) == ("nonfinite", 5)
