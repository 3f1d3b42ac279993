"""msjax.train's own step time for a benchmark: one quiet run of a config in a scratch run dir,
read back from its metrics.jsonl (imported by the benchmark scripts, not run)."""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from msjax.config import load_config
from msjax.observe.metrics import read_metrics
from msjax.train import train


def quiet_run_records(config_path: Path, overrides: list[str]) -> list[dict[str, Any]]:
    """Every metrics.jsonl record of one run of config_path with overrides, trained in this
    process in a scratch run dir with its progress line silenced."""
    with tempfile.TemporaryDirectory() as run_root:
        run_dir = Path(run_root) / "run"
        config = load_config(config_path, [*overrides, f"run.dir={run_dir}"])
        with open(os.devnull, "w") as quiet:
            train(config, progress_stream=quiet)
        return read_metrics(run_dir / "metrics.jsonl")


def mean_step_s(config_path: Path, overrides: list[str], warmup_steps: int) -> float:
    """The mean step_time_s of a run of config_path with overrides, past its first
    warmup_steps steps (first dispatches, caches)."""
    records = [r for r in quiet_run_records(config_path, overrides) if "loss" in r]
    return statistics.mean(record["step_time_s"] for record in records[warmup_steps:])
