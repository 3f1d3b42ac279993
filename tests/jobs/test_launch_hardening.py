"""The supervisor and the workers under real signals and real processes: SIGTERM is a request to
save and leave however often it comes, stack dumps answer in every phase, no process of an
attempt outlives it, and attempts that cannot progress end the job with the right exit code."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import (
    Finished,
    LaunchJob,
    TrainJob,
    finish_all,
    free_port,
    job_env,
    wait_until,
    worker_pids,
)
from small_runs import QUICK_RUN

from msjax.checkpoint.commits import committed_steps
from msjax.config import ResilienceConfig
from msjax.launch.attempt import Attempt
from msjax.launch.fault_detection import Poll, exit_fault
from msjax.launch.job_options import job_config
from msjax.launch.workers import WorkerProcess, stop_workers
from msjax.resilience import exit_codes
from msjax.run_dir import RunDir
from msjax.training.decisions import StopSignal

ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
SMALL = [
    *QUICK_RUN,
    *ONE_DEVICE,
    "train.eval_every=0",
    "resilience.heartbeat_every_s=0.2",
    "resilience.stop_grace_s=5",
    "resilience.restart_backoff_s=0.1",
]
GRAIN_PROCESSES = ["data.num_workers=2"]


def live_group_members(pgid: int) -> dict[int, str]:
    """The processes of group pgid that have not ended, by pid: their command line. A zombie
    has ended (on a node whose init does not reap, an orphan's zombie stays)."""
    members = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members[int(entry.name)] = command
    return members


# --- the stop signal, in this process ----------------------------------------------------------


def test_any_number_of_sigterms_is_one_request_to_save_and_stop():
    with StopSignal() as stop:  # grace: resilience.checkpoint_deadline_s's default
        for _ in range(5):
            os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # the first SIGINT after them: still the same request
        time.sleep(0.05)
    assert (stop.received, stop.count) == ("SIGTERM", 6)


def test_a_second_sigint_or_a_signal_past_the_grace_leaves_at_once():
    with pytest.raises(KeyboardInterrupt), StopSignal(grace_s=60) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
    assert stop.received == "SIGINT"
    with pytest.raises(KeyboardInterrupt), StopSignal(grace_s=0.2):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is put back


# --- a worker's process group, pipe and thread -------------------------------------------------

# a worker that leaves a child behind holding its output pipe, the way a Grain data process would
LEAVES_A_CHILD = (
    "import subprocess, sys;"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
    "print('child started', flush=True); sys.exit(1)"
)


def test_when_an_attempt_ends_nothing_of_a_workers_group_is_left_nor_its_pipe_or_thread(
    tmp_path,
):
    worker = WorkerProcess(
        0, [sys.executable, "-c", LEAVES_A_CHILD], job_env(), tmp_path / "rank0.log", 0, None
    )
    assert worker.wait(60)
    wait_until(lambda: "child started" in worker.log_path.read_text(), "the child started")
    assert len(live_group_members(worker.pid)) == 1  # the child, alive past its parent
    started = time.monotonic()
    stop_workers([worker], grace_s=5)
    assert live_group_members(worker.pid) == {}
    assert time.monotonic() - started < 5  # the pipe reached its end once the child was gone
    assert not worker._forward.is_alive()
    assert worker.process.stdout is not None and worker.process.stdout.closed
    assert "child started" in worker.log_path.read_text()


# a worker that waits (at most 60 s) for word of its peer's death (a file), then fails as a
# survivor does once a peer is gone (crash code 1): its exit follows the kill by its delay,
# however slowly it started
FOLLOWS_A_PEER = (
    "import os, sys, time\n"
    "deadline = time.monotonic() + 60\n"
    "while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline: time.sleep(0.01)\n"
    "time.sleep(float(sys.argv[1])); sys.exit(1)"
)


def test_the_worker_killed_first_is_named_though_its_peers_exits_are_seen_in_the_same_poll(
    tmp_path,
):
    """Rank 2 is SIGKILLed from outside; ranks 0, 1 and 3 exit (code 1) 1 to 2 s after it, 0 last,
    and one poll sees all four: the fault names rank 2, not the lowest rank seen exited."""
    follow_s = {0: 2.0, 1: 1.2, 3: 1.0}  # after the kill
    peer_gone = tmp_path / "peer-gone"
    workers = [
        WorkerProcess(
            rank,
            [sys.executable, "-c", FOLLOWS_A_PEER, str(follow_s.get(rank, 600)), str(peer_gone)],
            job_env(),
            tmp_path / f"rank{rank}.log",
            0,
            None,
        )
        for rank in range(4)
    ]
    attempt = Attempt.started(0, workers)
    os.kill(workers[2].pid, signal.SIGKILL)
    peer_gone.touch()
    wait_until(lambda: all(w.state() in ("Z", "?") for w in workers), "all four workers ended")
    exited = [w for w in workers if w.poll() is not None]  # one poll sees all four, as _watch
    poll = Poll(attempt, exited, time.time(), time.time(), ResilienceConfig(), 10, {})
    fault = exit_fault(poll)
    stop_workers(workers, grace_s=1)
    assert fault is not None
    assert (fault.rank, fault.detail, fault.cause) == (2, "killed by SIGKILL", "crash")
    ended = {w.rank: w.exited_unix_s for w in workers}
    assert ended[2] < min(ended[rank] for rank in (0, 1, 3))  # as they ended, not as polled


# --- one run dir for every node ----------------------------------------------------------------


def test_several_nodes_take_their_run_dir_from_the_slurm_job_never_from_their_clocks():
    config = job_config(["train.steps=3"], None, nnodes=2, environ={"SLURM_JOB_ID": "4242"})
    assert config.run.dir == "runs/tiny-slurm4242"
    one_node = job_config(["train.steps=3"], None, nnodes=1, environ={"SLURM_JOB_ID": "4242"})
    assert re.fullmatch(r"runs/tiny-\d{8}-\d{6}", one_node.run.dir)
    given = job_config(["run.dir=/tmp/x"], None, nnodes=2, environ={})
    assert given.run.dir == "/tmp/x"


# --- real training processes -------------------------------------------------------------------


def start_launch(
    base: Path, name: str, launch_flags: list[str], train_args: list[str]
) -> LaunchJob:
    return LaunchJob.start(
        base / name,
        [*SMALL, *train_args],
        launch_flags=launch_flags,
        log_path=base / f"{name}.log",
    )


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Finished]]:
    """Supervised jobs side by side, each run to its end."""
    base = tmp_path_factory.mktemp("hardening")
    jobs = [
        # every attempt gets past its first step and crashes before any checkpoint: attempts
        # that make steps but commit nothing; the crash leaves the Grain processes behind
        start_launch(
            base,
            "no_progress",
            ["--max-restarts=6", "--fault=crash@step=2,rank=0,times=20"],
            ["train.steps=50", "checkpoint.every_steps=1000", *GRAIN_PROCESSES],
        ),
        # the same crash before the first step, at every attempt
        start_launch(
            base,
            "same_start_up_crash",
            ["--max-restarts=6", "--fault=crash@step=0,rank=0,times=20"],
            ["train.steps=50"],  # resilience.max_attempts_without_progress: 3, the default
        ),
        # a NaN at step 2 (a bad batch: rolled back, skipped), then on the first step the
        # restarted attempt runs (the state it restored: not a batch to skip)
        start_launch(
            base,
            "nonfinite_first_step",
            ["--max-restarts=6", "--fault=nan@step=2,rank=0;nan@step=3,rank=0"],
            ["train.steps=50", "checkpoint.every_steps=2", "resilience.on_nonfinite_loss=rollback"],
        ),
        # node 0 of 2 alone: its worker waits in distributed init for a peer that never joins
        start_launch(
            base,
            "init_hang",
            ["--nnodes=2", "--node-rank=0", f"--coordinator=127.0.0.1:{free_port()}"],
            ["resilience.init_deadline_s=25"],
        ),
    ]
    yield finish_all({job.run_dir.name: job for job in jobs})


@pytest.mark.slow
def test_attempts_that_commit_no_newer_checkpoint_end_the_job_with_exit_8(launches):
    job = launches["no_progress"]
    assert job.exit_code == exit_codes.NO_PROGRESS, job.output[-4000:]
    incidents = job.incidents()
    assert [(r["cause"], r["action"]) for r in incidents] == [
        ("crash", "restart"),
        ("crash", "restart"),
        ("crash", "stop"),
    ]
    assert committed_steps(RunDir(job.run_dir).checkpoints) == []  # steps made, none saved
    reason = "3 attempts in a row committed no checkpoint newer than the one they resumed from"
    assert incidents[-1]["stop_reason"].startswith(reason)
    assert f"exit code {exit_codes.NO_PROGRESS}" in job.output


@pytest.mark.slow
def test_grain_processes_of_every_attempt_are_gone_when_it_ends(launches):
    job = launches["no_progress"]
    pids = worker_pids(job.output)
    assert len(pids) == 3, job.output[-4000:]
    assert {pid: live_group_members(pid) for pid in pids} == {pid: {} for pid in pids}


@pytest.mark.slow
def test_the_same_crash_before_the_first_step_in_a_row_is_a_user_error(launches):
    job = launches["same_start_up_crash"]
    assert job.exit_code == exit_codes.USER_ERROR, job.output[-4000:]
    incidents = job.incidents()
    assert [(r["cause"], r["phase"], r["action"]) for r in incidents] == [
        ("crash", "compile", "restart"),
        ("crash", "compile", "restart"),
        ("crash", "compile", "stop"),
    ]
    assert incidents[-1]["stop_reason"].startswith(
        "the same failure before the first step in 3 attempts in a row (exit code 1 in phase "
        "compile: "
    )


@pytest.mark.slow
def test_a_nonfinite_loss_on_the_first_step_after_a_restart_is_exit_3_not_a_skipped_batch(
    launches,
):
    job = launches["nonfinite_first_step"]
    assert job.exit_code == exit_codes.NONFINITE_LOSS, job.output[-4000:]
    incidents = job.incidents()
    assert [(r["cause"], r["step"], r["action"]) for r in incidents] == [
        ("nonfinite_loss", 2, "restart"),
        ("nonfinite_loss", 3, "stop"),
    ]
    assert "the first step after resuming at step 2" in incidents[-1]["stop_reason"]
    skipped = json.loads(RunDir(job.run_dir).skipped_steps.read_text())["skipped"]
    assert [entry["step"] for entry in skipped] == [2]  # the bad batch only


@pytest.mark.slow
def test_a_worker_hung_in_distributed_init_dumps_its_stack_on_sigusr1(launches):
    job = launches["init_hang"]
    assert job.exit_code == exit_codes.JOB_RESTART_NEEDED, job.output[-4000:]
    (incident,) = job.incidents()
    assert (incident["cause"], incident["phase"]) == ("hang", "init")
    stacks = RunDir(job.run_dir).incident(1) / "stacks-rank0.txt"
    assert stacks.exists(), job.output[-4000:]
    text = stacks.read_text()
    assert "initialize_distributed" in text and "msjax/distributed.py" in text, text
    summary = json.loads((RunDir(job.run_dir).incident(1) / "heartbeats.json").read_text())
    assert summary["ranks"]["0"]["exit"] != "killed by SIGUSR1"


# --- SIGTERM to a plain training process ---------------------------------------------------------


def start_train(run_dir: Path, overrides: list[str]) -> TrainJob:
    return TrainJob.start(
        run_dir,
        [*SMALL, *overrides],
        env={"JAX_NUM_CPU_DEVICES": "1"},
        new_session=True,  # its group: the worker and its Grain processes
    )


@dataclass
class SignalledRuns:
    storm_code: int
    storm_output: str
    storm_run_dir: Path
    storm_signals: int
    storm_group_left: dict[int, str]
    killed_group_left: dict[int, str]
    killed_output: str


@pytest.fixture(scope="module")
def signalled(tmp_path_factory: pytest.TempPathFactory) -> SignalledRuns:
    """Two runs with Grain processes: one SIGTERMed (its whole group, as a scheduler does) every
    10 ms from its third step until it has saved; one whose worker alone is SIGKILLed."""
    base = tmp_path_factory.mktemp("signalled")
    storm_dir, killed_dir = base / "storm", base / "killed"
    overrides = ["train.steps=2000", "checkpoint.every_steps=1000", *GRAIN_PROCESSES]
    storm = start_train(storm_dir, overrides)
    killed = start_train(killed_dir, overrides)
    try:
        storm.wait_for(lambda: len(storm.steps()) >= 3, "the storm run's third step")
        signals = 0
        while storm.running() and not storm.printed("stopped by SIGTERM"):
            storm.send_to_group(signal.SIGTERM)
            signals += 1
            time.sleep(0.01)  # the storm's pace: a signal every 10 ms
        storm_ended = storm.finish()
        wait_until(lambda: live_group_members(storm.pid) == {}, "the storm run's group gone")
        killed.wait_for(lambda: len(killed.steps()) >= 2, "the killed run's second step")
        assert len(live_group_members(killed.pid)) >= 3, killed.output[-3000:]
        killed.kill()  # the worker alone
        wait_until(lambda: live_group_members(killed.pid) == {}, "the killed run's group gone")
        return SignalledRuns(
            storm_ended.exit_code,
            storm_ended.output,
            storm_dir,
            signals,
            live_group_members(storm.pid),
            live_group_members(killed.pid),
            killed.output,
        )
    finally:
        for job in (storm, killed):
            if job.running():
                job.send_to_group(signal.SIGKILL)
            for pid in live_group_members(job.pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_sigterms_through_the_final_save_save_once_and_exit_zero(signalled):
    runs = signalled
    assert runs.storm_code == 0, runs.storm_output[-4000:]
    assert runs.storm_signals >= 3
    match = re.search(r"stopped by SIGTERM after step (\d+)", runs.storm_output)
    assert match, runs.storm_output[-4000:]
    step = int(match.group(1))
    checkpoint = runs.storm_run_dir / "checkpoints" / str(step)
    assert (checkpoint / "_CHECKPOINT_METADATA").exists()
    assert "interrupted" not in runs.storm_output
    assert runs.storm_group_left == {}  # the Grain processes ended with the pipeline


@pytest.mark.slow
def test_grain_processes_die_with_their_worker(signalled):
    assert signalled.killed_group_left == {}, signalled.killed_output[-3000:]
