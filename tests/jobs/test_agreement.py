"""Processes of a real two-process `jax.distributed` job (plain `python -m msjax.train` workers on
127.0.0.1, no supervisor) decide together: a SIGTERM to one of them stops both at the same step
with one checkpoint, and an error in one ends both at once with its exit code."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from harness import (
    SAFETY_TIMEOUT_S,
    TrainJob,
    distributed_env,
    free_port,
    kill_all,
    read_jsonl,
    wait_until,
)
from small_runs import QUICK_RUN

from msjax.resilience import exit_codes
from msjax.run_dir import RunDir

STEPS = 100  # a signal after step 4 lands mid-run, though the vote it waits for may be 32 steps off
TRAIN_ARGS = [
    *QUICK_RUN,
    f"train.steps={STEPS}",
    "train.eval_every=0",
    "checkpoint.every_steps=1000",
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=1",
]


def start_pair(run_dir: Path, tag: str, **env: str) -> list[TrainJob]:
    """Two `python -m msjax.train` processes of one job, each logging to its own file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    coordinator = f"127.0.0.1:{free_port()}"
    return [
        TrainJob.start(
            run_dir,
            TRAIN_ARGS,
            log_path=run_dir.parent / f"{run_dir.name}-{tag}-rank{rank}.log",
            env={"JAX_NUM_CPU_DEVICES": "2", **distributed_env(coordinator, 2, rank), **env},
        )
        for rank in range(2)
    ]


def finish_pair(pair: list[TrainJob], timeout_s: float = SAFETY_TIMEOUT_S) -> list[int]:
    try:
        return [process.finish(timeout_s).exit_code for process in pair]
    finally:
        kill_all(pair)


def step_losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss in metrics.jsonl (the last record of a step wins, as on a resume)."""
    return {r["step"]: r["loss"] for r in read_jsonl(RunDir(run_dir).metrics) if "loss" in r}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory):
    """An uninterrupted job beside one whose rank 1 alone gets SIGTERM, which is then rerun."""
    base = tmp_path_factory.mktemp("agree")
    reference = start_pair(base / "reference", "run")
    interrupted = start_pair(base / "interrupted", "first")
    interrupted[0].wait_for(lambda: len(interrupted[0].losses()) >= 4, "step 4 in metrics.jsonl")
    interrupted[1].send(signal.SIGTERM)
    first_codes = finish_pair(interrupted)
    first_outputs = [process.output for process in interrupted]
    checkpoints = base / "interrupted" / "checkpoints"
    first_checkpoints = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    reference_codes = finish_pair(reference)
    resumed = start_pair(base / "interrupted", "resumed")
    resumed_codes = finish_pair(resumed)
    return {
        "base": base,
        "first_codes": first_codes,
        "first_outputs": first_outputs,
        "first_checkpoints": first_checkpoints,
        "reference_codes": reference_codes,
        "resumed_codes": resumed_codes,
        "resumed_outputs": [process.output for process in resumed],
    }


def stopped_at(output: str) -> int:
    match = re.search(r"stopped by SIGTERM after step (\d+)", output)
    assert match, output[-3000:]
    return int(match.group(1))


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_step_with_one_checkpoint(jobs):
    assert jobs["first_codes"] == [0, 0], "\n".join(jobs["first_outputs"])[-5000:]
    steps = [stopped_at(output) for output in jobs["first_outputs"]]
    assert steps[0] == steps[1] and 4 <= steps[0] < STEPS
    assert jobs["first_checkpoints"] == [steps[0]]


@pytest.mark.slow
def test_rerun_after_sigterm_to_one_process_matches_an_uninterrupted_run_bitwise(jobs):
    assert jobs["reference_codes"] == [0, 0]
    assert jobs["resumed_codes"] == [0, 0], "\n".join(jobs["resumed_outputs"])[-5000:]
    resumed = step_losses(jobs["base"] / "interrupted")
    reference = step_losses(jobs["base"] / "reference")
    assert sorted(resumed) == sorted(reference) == list(range(STEPS))
    assert resumed == reference  # the JSON floats, bit for bit


@pytest.mark.slow
def test_an_error_in_one_process_ends_both_at_once_with_its_exit_code(tmp_path):
    # rank 1 alone reads a NaN loss
    job = start_pair(tmp_path / "run", "nan", MSJAX_FAULT="nan@step=3,rank=1")
    wait_until(lambda: not job[1].running(), "rank 1 ended")
    rank1_left = time.monotonic()
    codes = finish_pair(job, timeout_s=60)
    both_left_s = time.monotonic() - rank1_left
    outputs = job[0].output + job[1].output
    assert codes == [exit_codes.NONFINITE_LOSS] * 2, outputs[-5000:]
    assert both_left_s < 15, outputs[-3000:]
    assert "process 1 ended the job with exit code 3" in job[0].output
