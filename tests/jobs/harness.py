"""Jobs for the job tests: `python -m msjax.train` and `python -m msjax.launch` started in the
background with one child environment, and launch/slurm/train.sbatch submitted to a Slurm cluster,
waited on by events read from their own records (output, RUN_DIR's jsonl files, heartbeats,
committed checkpoints, Slurm's job state), signalled, and finished.

No wait here is a sleep for a fixed time: a wait polls for its event and fails the test, naming
the event, only past a safety timeout far longer than any machine should need.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest

from msjax.launch.launches import read_launches
from msjax.resilience.heartbeat import HeartbeatRecord
from msjax.run_dir import RunDir

REPO = Path(__file__).resolve().parents[2]
SAFETY_TIMEOUT_S = 900.0  # a safety net against a stuck job, never a speed assumption
POLL_S = 0.02
OUTPUT_TAIL_CHARS = 5000
# variables a worker reads from its supervisor: a test's child never inherits them by chance
WORKER_ONLY_VARIABLES = ("MSJAX_FAULT", "MSJAX_ATTEMPT", "MSJAX_COORDINATOR", "SLURM_JOB_ID")
T = TypeVar("T")


def job_env(**extra: str) -> dict[str, str]:
    """The environment of every process a job test starts: this one's (conftest.py's devices
    and caches), msjax from this checkout, unbuffered output, and `extra` on top."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    for name in WORKER_ONLY_VARIABLES:
        env.pop(name, None)
    return {**env, **extra}


def distributed_env(coordinator: str, num_processes: int, process_id: int) -> dict[str, str]:
    """The variables that make a `python -m msjax.train` one process of a jax.distributed job."""
    return {
        "MSJAX_COORDINATOR": coordinator,
        "MSJAX_NUM_PROCESSES": str(num_processes),
        "MSJAX_PROCESS_ID": str(process_id),
    }


def free_port() -> int:
    import portpicker

    return portpicker.pick_unused_port()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a jsonl file, also while its writer may be adding one (a last line that is
    not yet whole JSON is left out); [] if there is no file."""
    if not path.exists():
        return []
    *whole, last = path.read_text().split("\n")
    records = [json.loads(line) for line in whole if line.strip()]
    try:
        return records + ([json.loads(last)] if last.strip() else [])
    except json.JSONDecodeError:
        return records


def worker_pids(launcher_output: str) -> list[int]:
    """Every worker pid a launcher named in its output ("... pids 123 456, ...")."""
    found = re.findall(r"pids ([\d ]+)", launcher_output)
    return [int(pid) for pids in found for pid in pids.split()]


def wait_until(
    event: Callable[[], T], what: str, timeout_s: float = SAFETY_TIMEOUT_S, poll_s: float = POLL_S
) -> T:
    """Poll event() every poll_s until it gives something true, and return that; past the safety
    timeout, fail the test with a line naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not (found := event()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: never came within {timeout_s:.0f} s")
        time.sleep(poll_s)
    return found


class RunRecords:
    """Readers of what a job leaves in its run directory."""

    run_dir: Path

    def jsonl(self, name: str) -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / name)

    def incidents(self) -> list[dict[str, Any]]:
        return read_jsonl(RunDir(self.run_dir).incidents_log)

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(RunDir(self.run_dir).metrics)

    def launches(self) -> list[dict[str, Any]]:
        """The launcher's sessions, oldest first, each as its last record (msjax's own reader)."""
        return read_launches(RunDir(self.run_dir))

    def firings(self) -> list[dict[str, Any]]:
        """The injected faults that fired (RUN_DIR/faults.jsonl)."""
        return read_jsonl(RunDir(self.run_dir).faults)

    def steps(self) -> list[dict[str, Any]]:
        """The metrics records of training steps."""
        return [record for record in self.metrics() if "loss" in record]

    def losses(self) -> dict[int, float]:
        """Each step's loss as last logged (the attempt that went on from it)."""
        return {record["step"]: record["loss"] for record in self.steps()}

    def heartbeat(self, rank: int) -> HeartbeatRecord | None:
        return HeartbeatRecord.read(RunDir(self.run_dir).heartbeat(rank))

    def committed_steps(self) -> list[int]:
        from msjax.checkpoint.commits import committed_steps

        return committed_steps(RunDir(self.run_dir).checkpoints)


@dataclass(frozen=True)
class Finished(RunRecords):
    """A job that has ended: its exit code, its output and (through RunRecords) its records."""

    run_dir: Path
    exit_code: int
    output: str


class WatchedJob(RunRecords):
    """What every background job gives its waits: whether it still runs, how it ended, its
    output, a way to end it; and wait_for, the one wait on an event of its records."""

    poll_s = POLL_S  # how often a wait looks at the job's records and its state

    @property
    def output(self) -> str:
        raise NotImplementedError

    def running(self) -> bool:
        raise NotImplementedError

    def ended_as(self) -> str:
        """How the job ended, in a few words for a failure message."""
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def printed(self, text: str) -> bool:
        """An event: `text` is in the job's output."""
        return text in self.output

    def wait_for(self, event: Callable[[], T], what: str, timeout_s: float = SAFETY_TIMEOUT_S) -> T:
        """Poll event() until it gives something true, and return that. Fails the test, naming
        `what` and with the tail of the job's output, if the job ends first or past the safety
        timeout (then the job is ended too)."""
        deadline = time.monotonic() + timeout_s
        while not (found := event()):
            if not self.running():
                found = event()  # what the job wrote just before it ended
                if found:
                    return found
                pytest.fail(
                    f"{what}: never came; the job ended ({self.ended_as()}) first:\n"
                    + self.output[-OUTPUT_TAIL_CHARS:]
                )
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(
                    f"{what}: never came within {timeout_s:.0f} s:\n"
                    + self.output[-OUTPUT_TAIL_CHARS:]
                )
            time.sleep(self.poll_s)
        return found


class Job(WatchedJob):
    """One process started in the background, its stdout and stderr in a log file."""

    def __init__(
        self,
        command: Sequence[str],
        run_dir: Path,
        log_path: Path,
        env: dict[str, str],
        new_session: bool = False,
    ):
        self.run_dir = run_dir
        self.log_path = log_path
        self.command = list(command)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=log_path.parent,
                start_new_session=new_session,  # its own group: it and its Grain processes
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def output(self) -> str:
        return self.log_path.read_text()

    def worker_pids(self) -> list[int]:
        return worker_pids(self.output)

    def running(self) -> bool:
        return self.process.poll() is None

    def ended_as(self) -> str:
        return f"exit {self.process.returncode}"

    def finish(self, timeout_s: float = SAFETY_TIMEOUT_S) -> Finished:
        """Wait for the job's end; its exit code and output."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(
                f"the job did not end within {timeout_s:.0f} s:\n"
                + self.output[-OUTPUT_TAIL_CHARS:]
            )
        return Finished(self.run_dir, code, self.output)

    def send(self, signum: int) -> None:
        """Send signum to the job's own process."""
        self.process.send_signal(signum)

    def stop(self, signum: int) -> Finished:
        """Send signum and wait for the job's end."""
        self.send(signum)
        return self.finish()

    def send_to_group(self, signum: int) -> None:
        """Send signum to the job's process group (started with new_session), as a scheduler
        does."""
        os.killpg(self.process.pid, signum)

    def kill(self) -> None:
        """SIGKILL the job if it still runs, and reap it."""
        if self.running():
            self.process.kill()
        self.process.wait()


def train_command(run_dir: Path | None, overrides: Iterable[str]) -> list[str]:
    """`python -m msjax.train OVERRIDES run.dir=RUN_DIR` (no run.dir where run_dir is None)."""
    run_dir_override = [f"run.dir={run_dir}"] if run_dir is not None else []
    return [sys.executable, "-m", "msjax.train", *overrides, *run_dir_override]


def launch_command(
    run_dir: Path | None,
    overrides: Iterable[str],
    nprocs: int = 1,
    devices_per_proc: int | None = 1,
    launch_flags: Iterable[str] = (),
) -> list[str]:
    """`python -m msjax.launch --nprocs N --devices-per-proc D FLAGS -- OVERRIDES run.dir=...`:
    launch_flags are the launcher's own options (--fault, --max-restarts, --spares...),
    overrides the trainer's; devices_per_proc None leaves it to the launcher (the mesh's)."""
    run_dir_override = [f"run.dir={run_dir}"] if run_dir is not None else []
    devices = [f"--devices-per-proc={devices_per_proc}"] if devices_per_proc is not None else []
    return [
        sys.executable,
        "-m",
        "msjax.launch",
        f"--nprocs={nprocs}",
        *devices,
        *launch_flags,
        "--",
        *overrides,
        *run_dir_override,
    ]


def run_to_end(
    command: Sequence[str], timeout_s: float = SAFETY_TIMEOUT_S, cwd: Path | None = None, **env: str
) -> subprocess.CompletedProcess:
    """A short job run in the foreground, its stdout and stderr captured apart."""
    return subprocess.run(
        command, capture_output=True, text=True, env=job_env(**env), timeout=timeout_s, cwd=cwd
    )


class TrainJob(Job):
    """`python -m msjax.train OVERRIDES run.dir=RUN_DIR` in the background."""

    @classmethod
    def start(
        cls,
        run_dir: Path,
        overrides: Iterable[str],
        *,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        new_session: bool = False,
    ) -> TrainJob:
        """env: variables on top of job_env(); the log beside run_dir unless log_path says."""
        log_path = log_path or run_dir.parent / f"{run_dir.name}.log"
        command = train_command(run_dir, overrides)
        return cls(command, run_dir, log_path, job_env(**(env or {})), new_session)


class LaunchJob(Job):
    """`python -m msjax.launch ... -- OVERRIDES run.dir=RUN_DIR` in the background."""

    @classmethod
    def start(
        cls,
        run_dir: Path,
        overrides: Iterable[str],
        *,
        nprocs: int = 1,
        devices_per_proc: int | None = 1,
        launch_flags: Iterable[str] = (),
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        new_session: bool = False,
    ) -> LaunchJob:
        """See launch_command; env: variables on top of job_env()."""
        command = launch_command(run_dir, overrides, nprocs, devices_per_proc, launch_flags)
        log_path = log_path or run_dir.parent / f"{run_dir.name}-launch.log"
        return cls(command, run_dir, log_path, job_env(**(env or {})), new_session)


SBATCH_SCRIPT = REPO / "launch" / "slurm" / "train.sbatch"
SLURM_END_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def sbatch_command(
    name: str,
    base: Path,
    overrides: Iterable[str],
    launch_flags: Iterable[str] = (),
    sbatch_flags: Iterable[str] = (),
) -> list[str]:
    """`sbatch --parsable --job-name=NAME --chdir=BASE --output=BASE/NAME.out SBATCH_FLAGS
    train.sbatch LAUNCH_FLAGS -- OVERRIDES run.dir=BASE/NAME`: launch_flags are msjax.launch's
    options on every node, overrides the trainer's, sbatch_flags Slurm's (--time, --signal...)."""
    return [
        "sbatch",
        "--parsable",
        f"--job-name={name}",
        f"--chdir={base}",
        f"--output={base / f'{name}.out'}",
        *sbatch_flags,
        str(SBATCH_SCRIPT),
        *launch_flags,
        "--",
        *overrides,
        f"run.dir={base / name}",
    ]


class SlurmJob(WatchedJob):
    """One sbatch submission of launch/slurm/train.sbatch (see sbatch_command): its output file,
    its run directory BASE/NAME, and Slurm's record of it (`scontrol show job`), kept in `final`
    once it ends (a requeued job has not ended)."""

    poll_s = 0.1  # each look at its state asks the Slurm controller

    def __init__(self, name: str, job_id: str, base: Path, env: dict[str, str]):
        self.name = name
        self.job_id = job_id
        self.output_path = base / f"{name}.out"
        self.run_dir = base / name
        self.env = env
        self.submitted_unix_s = time.time()
        self.final: dict[str, str] = {}

    @classmethod
    def submit(
        cls,
        name: str,
        base: Path,
        overrides: Iterable[str],
        *,
        launch_flags: Iterable[str] = (),
        sbatch_flags: Iterable[str] = (),
        env: dict[str, str] | None = None,
    ) -> SlurmJob:
        """env: variables on top of job_env() (SLURM_CONF names the cluster)."""
        env = job_env(**(env or {}))
        command = sbatch_command(name, base, overrides, launch_flags, sbatch_flags)
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.fail(f"sbatch refused job {name} (exit {done.returncode}): {done.stderr}")
        return cls(name, done.stdout.strip().split(";")[0], base, env)

    def show(self) -> dict[str, str]:
        """Slurm's record of the job now (`scontrol -o show job`), field by field."""
        done = subprocess.run(
            ["scontrol", "-o", "show", "job", self.job_id],
            env=self.env,
            capture_output=True,
            text=True,
        )
        return dict(token.split("=", 1) for token in done.stdout.split() if "=" in token)

    def running(self) -> bool:
        """Whether the job has not ended yet (pending, running or requeued)."""
        if not self.final:
            state = self.show()
            if state.get("JobState") in SLURM_END_STATES:
                self.final = state
        return not self.final

    def ended_as(self) -> str:
        return f"{self.final.get('JobState')}, exit code {self.final.get('ExitCode')}"

    @property
    def output(self) -> str:
        return self.output_path.read_text() if self.output_path.exists() else ""

    @property
    def wall_s(self) -> float:
        """From its submission to its end, as Slurm recorded the end (to the second)."""
        ended = datetime.fromisoformat(self.final["EndTime"]).timestamp()
        return ended - self.submitted_unix_s

    def finish(self, timeout_s: float = SAFETY_TIMEOUT_S) -> dict[str, str]:
        """Wait for the job's end; Slurm's record of it."""
        return self.wait_for(lambda: not self.running() and self.final, "the job's end", timeout_s)

    def signal(self, *flags: str) -> None:
        """scancel FLAGS JOB_ID (e.g. --signal=TERM: preempt it)."""
        subprocess.run(["scancel", *flags, self.job_id], env=self.env, check=True)

    def kill(self) -> None:
        """Cancel the job, whatever its state."""
        subprocess.run(["scancel", self.job_id], env=self.env, capture_output=True)


def finish_all(
    jobs: dict[str, Job],
    while_running: Callable[[], None] = lambda: None,
    timeout_s: float = SAFETY_TIMEOUT_S,
) -> dict[str, Finished]:
    """Jobs run side by side to their ends, while_running() called at each poll meanwhile; every
    job still running when this fails is killed."""
    deadline = time.monotonic() + timeout_s
    try:
        while any(job.running() for job in jobs.values()):
            if time.monotonic() > deadline:
                late = [name for name, job in jobs.items() if job.running()]
                pytest.fail(f"jobs {late} did not end within {timeout_s:.0f} s")
            while_running()
            time.sleep(POLL_S)
        return {name: job.finish() for name, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.kill()


def kill_all(jobs: Iterable[WatchedJob]) -> None:
    for job in jobs:
        job.kill()
