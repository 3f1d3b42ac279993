"""Gradient accumulation (`train.grad_accum_steps`): the global batch as K microbatches in one
compiled step gives the loss, gradients and update of one pass over it, on every mesh."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_grad_accum_steps_that_do_not_divide_the_replica_batch_exit_2(tmp_path: Path):
    # tiny's default mesh data 2 x fsdp 2 x tensor 2: 16 / 4 = 4 rows per replica
    run_dir = tmp_path / "run"
    cases = {
        "train.grad_accum_steps=3": "does not divide each data-parallel replica's batch",
        "train.grad_accum_steps=0": "train.grad_accum_steps=0 must be positive",
    }
    for override, message in cases.items():
        done = subprocess.run(
            [sys.executable, "-m", "msjax.train", override, f"run.dir={run_dir}"],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=300,
        )
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
        assert not run_dir.exists()
