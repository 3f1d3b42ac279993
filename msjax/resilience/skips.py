"""Steps whose batch a run skips: RUN_DIR/skipped_steps.json, written on a non-finite-loss rollback.

Skipping step s means its batch is drawn and dropped and no update is applied (parameters and
optimizer state carry over, the step counter advances), so every later step still sees the batch
it would have seen: where each batch falls depends only on seed and step (design principle 7).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from msjax.errors import MsjaxError
from msjax.parallel.agreement import process_vote
from msjax.run_dir import RunDir
from msjax.writable import write_json

_ACCEPTED = 'a JSON object {"skipped": [{"step": N, ...}, ...]} with whole-number steps >= 0'


def _entries(path: Path) -> list[dict[str, Any]]:
    """The file's entries; [] when there is none. MsjaxError naming the file when it is not a
    skip list msjax wrote (an I/O error is raised as it is: it is not the file's fault)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except IsADirectoryError:
        raise MsjaxError(f"{path} is a directory, not a skip list ({_ACCEPTED})") from None
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise MsjaxError(f"{path} is garbled: not JSON ({_ACCEPTED})") from None
    entries = record.get("skipped") if isinstance(record, dict) else None
    if not isinstance(entries, list) or not all(
        isinstance(entry, dict)
        and type(entry.get("step")) is int  # a bool is not a step
        and entry["step"] >= 0
        for entry in entries
    ):
        raise MsjaxError(f"{path} is garbled: it must be {_ACCEPTED}")
    return entries


def _read_own_copy(run_dir: Path) -> tuple[frozenset[int], str | None]:
    """(the steps, None) or (empty, why this process's copy of the file is not a skip list)."""
    try:
        return frozenset(entry["step"] for entry in _entries(RunDir(run_dir).skipped_steps)), None
    except MsjaxError as error:
        return frozenset(), str(error)


def read_skipped_steps_here(run_dir: Path) -> frozenset[int]:
    """This host's copy of the run's skip list, without a vote and without JAX (the supervisor's
    view); empty where it is garbled (the workers refuse it themselves)."""
    return _read_own_copy(run_dir)[0]


def read_skipped_steps(run_dir: Path) -> frozenset[int]:
    """The run's skip list, the same on every process of the job: process 0's copy of the file.

    Every process reads its own copy, then they vote (one bounded round): a garbled file at
    process 0 stops every process with the same one-line error; another process whose copy
    differs (a stale mount) says so and uses process 0's.
    """
    steps, problem = _read_own_copy(run_dir)
    vote = process_vote("skipped_steps")
    if vote is None:
        if problem is not None:
            raise MsjaxError(problem)
        return steps
    # [ok, *steps] from each process; process 0's decides
    ok, *first_steps = vote.gather([int(problem is None), *sorted(steps)])[0]
    if not ok:
        raise MsjaxError(
            problem
            if vote.rank == 0
            else f"process 0 found {RunDir(run_dir).skipped_steps} garbled (its log says why)"
        )
    agreed = frozenset(first_steps)
    if vote.rank != 0 and (problem is not None or steps != agreed):
        what = problem if problem is not None else f"steps {sorted(steps)}"
        print(
            f"msjax.train: warning: process {vote.rank}'s skip list ({what}) differs from "
            f"process 0's (steps {sorted(agreed)}); every process uses process 0's",
            file=sys.stderr,
        )
    return agreed


def record_skipped_step(run_dir: Path, step: int, reason: str) -> None:
    """Add step to the run's skip list (atomically; a step already there is kept once)."""
    path = RunDir(run_dir).skipped_steps
    entries = _entries(path)
    if any(int(entry["step"]) == step for entry in entries):
        return
    entries.append({"step": step, "reason": reason, "recorded_unix_s": time.time()})
    entries.sort(key=lambda entry: entry["step"])
    write_json(path, {"skipped": entries}, indent=1)
