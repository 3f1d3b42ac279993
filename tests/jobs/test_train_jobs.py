"""The training loop end to end: what it writes, what it measures, and that it learns."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_train import SHORT_RUN, step_records

from msjax.observe.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]


def test_command_line_run_ends_by_saying_where_its_outputs_are(tmp_path):
    run_dir = tmp_path / "cli"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    completed = subprocess.run(
        [sys.executable, "-m", "msjax.train", *SHORT_RUN, "train.steps=3", f"run.dir={run_dir}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    last_line = completed.stdout.strip().splitlines()[-1]
    assert last_line == f"outputs in {run_dir}: config.yaml, data.json, metrics.jsonl, checkpoints/"
    assert len(step_records(read_metrics(run_dir / "metrics.jsonl"))) == 3
