"""Steps whose batch a run skips: RUN_DIR/skipped_steps.json, written on a non-finite-loss rollback.

Skipping step s means its batch is drawn and dropped and no update is applied (parameters and
optimizer state carry over, the step counter advances), so every later step still sees the batch
it would have seen: where each batch falls depends only on seed and step (design principle 7).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from msjax.run_dir import RunDir, write_json


def read_skipped_steps(run_dir: Path) -> frozenset[int]:
    path = RunDir(run_dir).skipped_steps
    if not path.exists():
        return frozenset()
    return frozenset(int(entry["step"]) for entry in json.loads(path.read_text())["skipped"])


def record_skipped_step(run_dir: Path, step: int, reason: str) -> None:
    """Add step to the run's skip list (atomically; a step already there is kept once)."""
    path = RunDir(run_dir).skipped_steps
    entries = json.loads(path.read_text())["skipped"] if path.exists() else []
    if any(int(entry["step"]) == step for entry in entries):
        return
    entries.append({"step": step, "reason": reason, "recorded_unix_s": time.time()})
    entries.sort(key=lambda entry: entry["step"])
    write_json(path, {"skipped": entries}, indent=1)
