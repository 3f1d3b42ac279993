"""Damaged checkpoints never cost a good one: read errors are retried, damaged steps are moved
aside and not counted as kept, a garbled record is caught, format 1 still restores, and a run
whose checkpoints all fail stops (exit 2) instead of starting again from step 0."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from harness import launch_command, run_to_end, train_command
from test_checkpoint_integrity import garble, largest_array_file

from msjax.checkpoint.manager import committed_steps
from msjax.observe.metrics import read_metrics
from tests.small_runs import QUICK_RUN


def run_train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = train_command(run_dir, [
        *QUICK_RUN, "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", "train.eval_every=0",
        "checkpoint.every_steps=2", "checkpoint.max_to_keep=1", *overrides,
    ])  # fmt: skip
    return run_to_end(command, JAX_NUM_CPU_DEVICES="2")


def test_when_no_checkpoint_restores_the_run_stops_instead_of_starting_from_step_0(tmp_path):
    run_dir = tmp_path / "run"
    first = run_train(run_dir, "train.steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    assert committed_steps(checkpoints) == [4]
    garble(largest_array_file(checkpoints / "4"))
    records_before = len(read_metrics(run_dir / "metrics.jsonl"))

    refused = run_train(run_dir, "train.steps=6")
    assert refused.returncode == 2
    output = refused.stdout + refused.stderr
    skipped = [line for line in output.splitlines() if line.startswith("skipped checkpoint")]
    assert len(skipped) == 1 and f"{checkpoints}/4 is corrupted" in skipped[0]
    assert f"moved to {checkpoints}/damaged/4" in skipped[0]
    errors = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "checkpoint.if_none_valid=restart" in errors[0]
    assert "Traceback" not in refused.stderr
    assert committed_steps(checkpoints) == []  # nothing saved, nothing trained
    assert (checkpoints / "damaged" / "4" / "state").is_dir()
    assert len(read_metrics(run_dir / "metrics.jsonl")) == records_before

    again = run_train(run_dir, "train.steps=6")  # the damaged one, moved aside, still counts
    assert again.returncode == 2 and "found damaged earlier" in again.stderr

    restarted = run_train(run_dir, "train.steps=6", "checkpoint.if_none_valid=restart")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "starting from step 0 (checkpoint.if_none_valid=restart)" in restarted.stdout
    assert committed_steps(checkpoints) == [6]


def launch_job(run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    overrides = [
        *QUICK_RUN, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=1", f"train.steps={steps}",
        "train.eval_every=0", "checkpoint.every_steps=2", "resilience.max_restarts=0",
    ]  # fmt: skip
    return run_to_end(launch_command(run_dir, overrides, nprocs=2, devices_per_proc=2))


@pytest.mark.slow
def test_a_checkpoint_damaged_in_rank_1s_shards_makes_both_ranks_fall_back_to_the_same_step(
    tmp_path,
):
    run_dir = tmp_path / "run"
    first = launch_job(run_dir, 4)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    assert committed_steps(checkpoints) == [2, 4]
    rank_1_files = sorted((checkpoints / "4" / "state" / "ocdbt.process_1").rglob("*"))
    largest = max((path for path in rank_1_files if path.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])  # rank 1's shards

    second = launch_job(run_dir, 6)
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-5000:]
    assert f"skipped checkpoint {checkpoints}/4" in output
    assert f"resumed from {checkpoints}/2 (step 2)" in output
    resumes = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("event") == "resume"]
    assert [r["step"] for r in resumes] == [2]
    assert committed_steps(checkpoints) == [2, 4, 6]  # 4 saved again, from the restored 2
    assert (checkpoints / "damaged" / "4").is_dir()
