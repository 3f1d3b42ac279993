"""Real `python -m msjax.train` runs for the checkpoint fault tests: start, watch and signal
them, and read the metrics and checkpoints they leave on disk."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SMALL_RUN = [
    "train.steps=400",  # far more than any test lets run: every run here is stopped or shortened
    "train.global_batch=16",
    "data.seq_len=64",
    "data.max_corpus_mib=2",
    "train.eval_every=0",
    "train.peak_tflops=0.5",
]
NO_PERIODIC_SAVES = ["checkpoint.every_steps=1000"]
SAVE_EVERY_STEP = ["checkpoint.every_steps=1"]
START_TIMEOUT_S = 240  # start-up and compilation, on a busy 2-core machine
POLL_S = 0.01
TMP_MARKER = "orbax-checkpoint-tmp"
COMMIT_MARKER = "_CHECKPOINT_METADATA"


class TrainProcess:
    """One `python -m msjax.train` child; stdout and stderr go to a log file."""

    def __init__(self, run_dir: Path, overrides: list[str], log_path: Path):
        self.run_dir = run_dir
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        env.setdefault("JAX_NUM_CPU_DEVICES", "8")
        with log_path.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "msjax.train", *overrides, f"run.dir={run_dir}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=run_dir.parent,
            )

    @property
    def output(self) -> str:
        return self.log_path.read_text()

    def wait_until(self, condition: Callable[[], bool], what: str) -> None:
        """Poll until condition() holds; fail with the log if the run ends or takes too long."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not condition():
            if self.process.poll() is not None:
                pytest.fail(
                    f"the run ended (exit {self.process.returncode}) before {what}:\n{self.output}"
                )
            if time.monotonic() > deadline:
                self.process.kill()
                pytest.fail(f"no {what} within {START_TIMEOUT_S} s:\n{self.output}")
            time.sleep(POLL_S)

    def stop(self, signum: int) -> int:
        """Send signum and wait for the exit code."""
        self.process.send_signal(signum)
        return self.finish()

    def finish(self) -> int:
        try:
            return self.process.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            pytest.fail(f"the run did not end within {START_TIMEOUT_S} s:\n{self.output}")

    def kill_if_running(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def start_run() -> Iterator[Callable[[Path, list[str]], TrainProcess]]:
    """Starts training runs; kills any still running when the module's tests are done."""
    started: list[TrainProcess] = []

    def start(run_dir: Path, overrides: list[str]) -> TrainProcess:
        log_path = run_dir.parent / f"{run_dir.name}-{len(started)}.log"
        started.append(TrainProcess(run_dir, overrides, log_path))
        return started[-1]

    yield start
    for run in started:
        run.kill_if_running()


def records_so_far(run_dir: Path) -> list[dict[str, Any]]:
    """The complete lines of metrics.jsonl while a run may be writing it."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


def steps_after_last_resume(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Step records after the last resume event (none while no run has resumed yet)."""
    resumes = [i for i, record in enumerate(records) if record.get("event") == "resume"]
    if not resumes:
        return []
    return [record for record in records[resumes[-1] + 1 :] if "loss" in record]


def step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [record for record in records if "loss" in record]


def committed_on_disk(checkpoints: Path) -> list[int]:
    """Steps whose final directory exists with Orbax's metadata file in it."""
    if not checkpoints.is_dir():
        return []
    return sorted(
        int(entry.name)
        for entry in checkpoints.iterdir()
        if entry.name.isdigit() and (entry / COMMIT_MARKER).exists()
    )


def unfinished_on_disk(checkpoints: Path) -> list[str]:
    """Step entries a save started and never finalized: Orbax's tmp dirs, or no metadata file."""
    if not checkpoints.is_dir():
        return []
    return sorted(
        entry.name
        for entry in checkpoints.iterdir()
        if entry.name.split(".")[0].isdigit()
        and (TMP_MARKER in entry.name or not (entry / COMMIT_MARKER).exists())
    )


def stopped_step(output: str) -> int:
    match = re.search(r"stopped by SIGTERM after step (\d+)", output)
    assert match, output
    return int(match.group(1))


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, size_mib: int) -> Iterator[Path]:
    """A tmpfs of size_mib mounted at mount (made if missing; root only, else the test skips),
    unmounted after the block: a disk that fills for real."""
    mount.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mount)])
    if made.returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
