"""Each exit code of `python -m msjax.launch` reached by a real supervised job (one worker each,
run side by side), and the start-up watch: long start-up phases that progress are not hangs, a
start-up that never progresses is."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from harness import Finished, LaunchJob, finish_all, free_port
from small_runs import QUICK_RUN

from msjax.resilience import exit_codes

STEP_DEADLINE_S = 3.0
SMALL = [
    *QUICK_RUN,
    "train.eval_every=0",
    "resilience.heartbeat_every_s=0.1",
    f"resilience.step_deadline_s={STEP_DEADLINE_S}",
    "resilience.stop_grace_s=2",
    "resilience.restart_backoff_s=0.1",
]


@dataclass
class Case:
    """A job, what is done to it once its rank 0 trains, and the exit code it must end with."""

    code: int
    launch_flags: list[str] = field(default_factory=list)
    train_args: list[str] = field(default_factory=list)
    signal_when_training: int | None = None
    fresh_token_cache: bool = False
    stopped_in_compile_s: float = 0.0  # rank 0 SIGSTOPped this long once it starts compiling


def cases(tmp: Path) -> dict[str, Case]:
    empty_checkpoints = tmp / "no-checkpoints"
    empty_checkpoints.mkdir(exist_ok=True)
    return {
        # long start-up phases (tokenizing 32 MiB, compiling) beside a 3 s step deadline; the
        # compile is stretched past it by a stop, however fast the machine compiles
        "done": Case(
            exit_codes.OK,
            train_args=[
                "train.steps=3",
                "data.max_corpus_mib=32",
                "resilience.data_deadline_s=1",
            ],
            fresh_token_cache=True,
            stopped_in_compile_s=STEP_DEADLINE_S + 1,
        ),
        "user_error": Case(
            exit_codes.USER_ERROR, train_args=[f"checkpoint.resume_from={empty_checkpoints}"]
        ),
        "nonfinite_loss": Case(
            exit_codes.NONFINITE_LOSS,
            ["--fault=nan@step=1,rank=0"],
            ["train.steps=200", "resilience.on_nonfinite_loss=stop"],
        ),
        # saves that keep failing end the attempt (worker exit 6), which is restarted: here the
        # restart budget is 0
        "restarts_exhausted": Case(
            exit_codes.RESTARTS_EXHAUSTED,
            ["--max-restarts=0", "--fault=save_error@step=1,rank=0,times=1000"],
            [
                "train.steps=100000",  # it ends by exit 6, however fast it steps
                "checkpoint.every_steps=1",
                "checkpoint.max_unsaved_minutes=0.02",
            ],
        ),
        # a full disk before the first step, at every start: restarted after a doubling
        # back-off of its own, never taken for a mistake (the same failure in a row), and when
        # the restart budget is spent, the retryable infrastructure code
        "infrastructure": Case(
            exit_codes.INFRASTRUCTURE,
            ["--max-restarts=2", "--fault=disk_full@step=0,rank=0,times=9"],
            [
                "resilience.max_attempts_without_progress=2",
                "resilience.infrastructure_backoff_s=0.2",
                "resilience.infrastructure_backoff_max_s=0.3",
            ],
        ),
        # node 0 of 2 alone: distributed init never completes, a hang of the start-up
        "job_restart_needed": Case(
            exit_codes.JOB_RESTART_NEEDED,
            ["--nnodes=2", "--node-rank=0", f"--coordinator=127.0.0.1:{free_port()}"],
            ["resilience.init_deadline_s=8"],
        ),
        "interrupted": Case(
            exit_codes.INTERRUPTED,
            train_args=["train.steps=2000"],
            signal_when_training=signal.SIGINT,
        ),
        "terminated": Case(
            exit_codes.TERMINATED,
            train_args=["train.steps=2000"],
            signal_when_training=signal.SIGTERM,
        ),
    }


@dataclass(frozen=True)
class Seen:
    """What the test saw of a job's rank 0 heartbeat while the job ran."""

    phases_s: dict[str, float]  # how long rank 0's heartbeat stayed in each phase, as seen
    data_progress: int  # the highest progress rank 0 reported while reading the corpus


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Finished], dict[str, Seen]]:
    base = tmp_path_factory.mktemp("exit_codes")
    specs = cases(base)
    assert {name: case.code for name, case in specs.items()} == CODES
    jobs: dict[str, LaunchJob] = {}
    for name, case in specs.items():
        env = {"MSJAX_CACHE_DIR": str(base / f"{name}-cache")} if case.fresh_token_cache else {}
        overrides = [*SMALL, "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", *case.train_args]
        jobs[name] = LaunchJob.start(
            base / name,
            overrides,
            launch_flags=case.launch_flags,
            log_path=base / f"{name}.log",
            env=env,
        )

    phases: dict[str, dict[str, list[float]]] = {name: {} for name in jobs}
    progress = dict.fromkeys(jobs, 0)
    signalled: set[str] = set()
    stopped: dict[str, tuple[int, float]] = {}  # job: its rank 0's pid, when to let it go on

    def look_at_rank_0_of_each_job() -> None:
        for name, case in specs.items():
            job = jobs[name]
            record = job.heartbeat(0)
            if record is None or not job.running():
                continue
            now = time.monotonic()
            seen = phases[name].setdefault(record.phase, [now, now])
            seen[1] = now
            if record.phase == "data":
                progress[name] = max(progress[name], record.progress)
            wants_signal = case.signal_when_training and name not in signalled
            if wants_signal and record.phase == "step" and record.step >= 2:
                job.send(case.signal_when_training)
                signalled.add(name)
            stops = case.stopped_in_compile_s and name not in stopped
            if stops and record.phase == "compile":
                os.kill(record.pid, signal.SIGSTOP)
                stopped[name] = (record.pid, now + case.stopped_in_compile_s)
        for name, (pid, until) in stopped.items():
            if until and time.monotonic() >= until:
                os.kill(pid, signal.SIGCONT)
                stopped[name] = (pid, 0.0)  # stopped once, and let go

    try:
        finished = finish_all(jobs, while_running=look_at_rank_0_of_each_job)
    finally:
        for pid, until in stopped.values():
            if until:
                os.kill(pid, signal.SIGCONT)
    seen = {
        name: Seen(
            {phase: last - first for phase, (first, last) in phases[name].items()},
            progress[name],
        )
        for name in jobs
    }
    return finished, seen


@pytest.fixture(scope="module")
def finished(ran) -> dict[str, Finished]:
    return ran[0]


CODES = {
    "done": exit_codes.OK,
    "user_error": exit_codes.USER_ERROR,
    "nonfinite_loss": exit_codes.NONFINITE_LOSS,
    "restarts_exhausted": exit_codes.RESTARTS_EXHAUSTED,
    "infrastructure": exit_codes.INFRASTRUCTURE,
    "job_restart_needed": exit_codes.JOB_RESTART_NEEDED,
    "interrupted": exit_codes.INTERRUPTED,
    "terminated": exit_codes.TERMINATED,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CODES))
def test_launcher_exit_code_of_a_real_job(finished, name):
    job = finished[name]
    assert job.exit_code == CODES[name], job.output[-4000:]


@pytest.mark.slow
def test_long_start_up_phases_that_progress_are_not_hangs(ran):
    job, seen = ran[0]["done"], ran[1]["done"]
    assert job.incidents() == [], job.output[-4000:]
    assert seen.data_progress > 0  # tokenizing reported its tokens
    assert seen.phases_s["compile"] > STEP_DEADLINE_S  # compiling outlasts the step deadline


@pytest.mark.slow
def test_a_start_up_that_never_progresses_is_a_hang(finished):
    (incident,) = finished["job_restart_needed"].incidents()
    assert (incident["cause"], incident["phase"]) == ("hang", "init")
    assert "deadline 8 s" in incident["detail"]


@pytest.mark.slow
def test_saves_that_keep_failing_end_the_attempt_with_their_own_exit_code(finished):
    job = finished["restarts_exhausted"]
    (incident,) = job.incidents()
    assert incident["detail"] == "exit code 6 (checkpoint saves kept failing)"
    assert "checkpoint saves kept failing for checkpoint.max_unsaved_minutes=0.02" in job.output


@pytest.mark.slow
def test_a_worker_user_error_is_one_line_and_no_restart(finished):
    job = finished["user_error"]
    (incident,) = job.incidents()
    assert (incident["cause"], incident["action"]) == ("user_error", "stop")
    assert "msjax.train: error: checkpoint.resume_from=" in job.output
    assert "no finished checkpoint in" in job.output


@pytest.mark.slow
def test_a_full_disk_at_every_start_backs_off_then_ends_retryable_not_as_a_mistake(finished):
    job = finished["infrastructure"]
    assert [(r["cause"], r["phase"], r["action"]) for r in job.incidents()] == [
        ("infrastructure", "compile", "restart"),
        ("infrastructure", "compile", "restart"),
        ("infrastructure", "compile", "stop"),
    ], job.output[-4000:]
    assert job.incidents()[0]["detail"].startswith("exit code 14 (a full disk"), job.incidents()[0]
    assert "msjax.train: [Errno 28] No space left on device (injected before step 0)" in job.output
    restarts = [line for line in job.output.splitlines() if "msjax.launch: restart " in line]
    assert [line.split(" in ")[1].split(" s,")[0] for line in restarts] == ["0.2", "0.3"]
    assert "2 of resilience.max_restarts=2 spent" in restarts[-1]
    assert job.incidents()[-1]["stop_reason"].startswith(
        "restart budget spent (resilience.max_restarts=2: restarts after an attempt that"
    )
    assert exit_codes.INFRASTRUCTURE in exit_codes.RETRYABLE
