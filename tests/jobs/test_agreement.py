"""Processes of a real two-process `jax.distributed` job (plain `python -m msjax.train` workers on
127.0.0.1, no supervisor) decide together: a SIGTERM to one of them stops both at the same step
with one checkpoint, and an error in one ends both at once with its exit code."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from small_runs import QUICK_RUN

from msjax.resilience import exit_codes

REPO = Path(__file__).resolve().parents[2]
STEPS = 100  # a signal after step 4 lands mid-run, though the vote it waits for may be 32 steps off
TIMEOUT_S = 420
TRAIN_ARGS = [
    *QUICK_RUN,
    f"train.steps={STEPS}",
    "train.eval_every=0",
    "checkpoint.every_steps=1000",
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=1",
]


class TwoProcessJob:
    """Two `python -m msjax.train` processes of one job, each logging to its own file."""

    def __init__(self, run_dir: Path, tag: str, env_extra: dict[str, str] | None = None):
        import portpicker

        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        port = portpicker.pick_unused_port()
        self.logs = [run_dir.parent / f"{run_dir.name}-{tag}-rank{r}.log" for r in range(2)]
        self.processes = []
        for rank, log_path in enumerate(self.logs):
            env = {
                **os.environ,
                "PYTHONPATH": str(REPO),
                "PYTHONUNBUFFERED": "1",
                "JAX_NUM_CPU_DEVICES": "2",
                "MSJAX_COORDINATOR": f"127.0.0.1:{port}",
                "MSJAX_NUM_PROCESSES": "2",
                "MSJAX_PROCESS_ID": str(rank),
                **(env_extra or {}),
            }
            with log_path.open("w") as log:
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "msjax.train", *TRAIN_ARGS, f"run.dir={run_dir}"],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=run_dir.parent,
                    )
                )

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def wait_for_step(self, step: int) -> None:
        """Until metrics.jsonl (rank 0's) holds `step` step records."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.processes):
                pytest.fail("a process ended early:\n" + self.output(0) + self.output(1))
            if len(step_losses(self.run_dir)) >= step:
                return
            time.sleep(0.01)
        self.kill()
        pytest.fail(f"no step {step} within {TIMEOUT_S} s:\n{self.output(0)}")

    def finish(self, timeout_s: float = TIMEOUT_S) -> list[int]:
        codes = []
        for process in self.processes:
            try:
                codes.append(process.wait(timeout=timeout_s))
            except subprocess.TimeoutExpired:
                self.kill()
                codes.append(process.wait())
        return codes

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()


def step_losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss in metrics.jsonl (the last record of a step wins, as on a resume)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []  # complete lines only
    records = [json.loads(line) for line in lines if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory):
    """An uninterrupted job beside one whose rank 1 alone gets SIGTERM, which is then rerun."""
    base = tmp_path_factory.mktemp("agree")
    reference = TwoProcessJob(base / "reference", "run")
    interrupted = TwoProcessJob(base / "interrupted", "first")
    interrupted.wait_for_step(4)
    interrupted.processes[1].send_signal(signal.SIGTERM)
    first_codes = interrupted.finish()
    first_outputs = [interrupted.output(r) for r in range(2)]
    checkpoints = base / "interrupted" / "checkpoints"
    first_checkpoints = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    reference_codes = reference.finish()
    resumed = TwoProcessJob(base / "interrupted", "resumed")
    resumed_codes = resumed.finish()
    return {
        "base": base,
        "first_codes": first_codes,
        "first_outputs": first_outputs,
        "first_checkpoints": first_checkpoints,
        "reference_codes": reference_codes,
        "resumed_codes": resumed_codes,
        "resumed_outputs": [resumed.output(r) for r in range(2)],
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
    job = TwoProcessJob(
        tmp_path / "run", "nan", {"MSJAX_FAULT": "nan@step=3,rank=1"}
    )  # rank 1 alone reads a NaN loss
    deadline = time.monotonic() + TIMEOUT_S
    while job.processes[1].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    rank1_left = time.monotonic()
    codes = job.finish(timeout_s=60)
    both_left_s = time.monotonic() - rank1_left
    outputs = job.output(0) + job.output(1)
    assert codes == [exit_codes.NONFINITE_LOSS] * 2, outputs[-5000:]
    assert both_left_s < 15, outputs[-3000:]
    assert "process 1 ended the job with exit code 3" in job.output(0)
