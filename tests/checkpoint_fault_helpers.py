"""Real `python -m msjax.train` runs for the checkpoint fault tests (started by
tests/jobs/harness.py), and readers of the metrics and checkpoints they leave on disk."""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import TrainJob, kill_all, read_jsonl

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
TMP_MARKER = "orbax-checkpoint-tmp"
COMMIT_MARKER = "_CHECKPOINT_METADATA"


@pytest.fixture(scope="module")
def start_run() -> Iterator[Callable[..., TrainJob]]:
    """Starts training runs (env: variables on top of the harness's job_env); kills any still
    running when the module's tests are done."""
    started: list[TrainJob] = []

    def start(run_dir: Path, overrides: list[str], **env: str) -> TrainJob:
        log_path = run_dir.parent / f"{run_dir.name}-{len(started)}.log"
        started.append(TrainJob.start(run_dir, overrides, log_path=log_path, env=env))
        return started[-1]

    yield start
    kill_all(started)


def records_so_far(run_dir: Path) -> list[dict[str, Any]]:
    """The complete lines of metrics.jsonl while a run may be writing it."""
    return read_jsonl(run_dir / "metrics.jsonl")


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
