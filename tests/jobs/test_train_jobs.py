"""The training loop end to end: what it writes, what it measures, and that it learns."""

from __future__ import annotations

from harness import run_to_end, train_command
from test_train import SHORT_RUN, step_records

from msjax.observe.metrics import read_metrics


def test_command_line_run_ends_by_saying_where_its_outputs_are(tmp_path):
    run_dir = tmp_path / "cli"
    completed = run_to_end(train_command(run_dir, [*SHORT_RUN, "train.steps=3"]), 300, tmp_path)
    assert completed.returncode == 0, completed.stderr
    last_line = completed.stdout.strip().splitlines()[-1]
    assert last_line == f"outputs in {run_dir}: config.yaml, data.json, metrics.jsonl, checkpoints/"
    assert len(step_records(read_metrics(run_dir / "metrics.jsonl"))) == 3
