"""Gradient accumulation (`train.grad_accum_steps`): the global batch as K microbatches in one
compiled step gives the loss, gradients and update of one pass over it, on every mesh."""

from __future__ import annotations

from pathlib import Path

from harness import REPO, run_to_end, train_command


def test_grad_accum_steps_that_do_not_divide_the_replica_batch_exit_2(tmp_path: Path):
    # tiny's default mesh data 2 x fsdp 2 x tensor 2: 16 / 4 = 4 rows per replica
    run_dir = tmp_path / "run"
    cases = {
        "train.grad_accum_steps=3": "does not divide each data-parallel replica's batch",
        "train.grad_accum_steps=0": "train.grad_accum_steps=0 must be positive",
    }
    for override, message in cases.items():
        done = run_to_end(train_command(run_dir, [override]), 300, REPO)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
        assert not run_dir.exists()
