"""What a worker that dies of an unexpected exception leaves for the supervisor:
RUN_DIR/crashes/attempt<a>-rank<r>.json, the exception's signature (type, message, the frame that
raised it) and the step and phase it reached. The supervisor compares them across attempts to tell
a fault of the program or its inputs (the same failure again) from a machine's
(msjax.launch.software_faults)."""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from msjax.distributed import ATTEMPT, PROCESS_ID
from msjax.resilience.heartbeat import latest_beat
from msjax.run_dir import RunDir
from msjax.writable import read_no_follow, write_text_atomically

MESSAGE_CHARS = 200  # a signature keeps the message's first line, at most this long


@dataclass(frozen=True)
class CrashRecord:
    """One worker's unexpected exception, as written and read back."""

    rank: int
    attempt: int
    signature: str  # "ValueError: bad shape (msjax/step.py:120 in train_step)"
    step: int | None  # updates completed, as its heartbeat held them; None: before any
    phase: str | None  # its heartbeat's phase (msjax.resilience.heartbeat.Phase)
    unix_s: float

    @classmethod
    def read(cls, path: Path) -> CrashRecord | None:
        """The record in path, or None if there is none or it is not one (no link followed)."""
        try:
            values = json.loads(read_no_follow(path))
            return cls(**{key: values[key] for key in cls.__dataclass_fields__})
        except (OSError, ValueError, KeyError, TypeError):
            return None


def signature_of(error: BaseException) -> str:
    """The exception's type, its message's first line and the frame that raised it: alike when
    the same code fails the same way, whatever the process, slot or attempt."""
    kind = type(error).__qualname__
    lines = str(error).strip().splitlines()
    message = lines[0][:MESSAGE_CHARS] if lines else ""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{kind}: {message}{where}" if message else f"{kind}{where}"


def record_crash(run_dir: Path, error: BaseException) -> None:
    """Write this worker's crash record (best effort: a full disk leaves the traceback alone)."""
    rank = int(os.environ.get(PROCESS_ID, "0") or 0)
    attempt = int(os.environ.get(ATTEMPT, "0") or 0)
    beat = latest_beat()
    record = {
        "rank": rank,
        "attempt": attempt,
        "signature": signature_of(error),
        "step": beat[0] if beat is not None else None,
        "phase": beat[1] if beat is not None else None,
        "unix_s": time.time(),
    }
    path = RunDir(run_dir).crash_record(attempt, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(record))
    except OSError:
        pass  # the traceback in the log still tells it


def read_crashes(run_dir: Path, attempt: int, since_unix_s: float) -> list[CrashRecord]:
    """The crash records of `attempt` written since since_unix_s (an earlier launch of the run
    numbered its attempts from 0 too), by rank."""
    run = RunDir(run_dir)
    records = []
    for path in sorted(run.crashes.glob(f"attempt{attempt}-rank*.json")):
        record = CrashRecord.read(path)
        if record is not None and record.attempt == attempt and record.unix_s >= since_unix_s:
            records.append(record)
    return sorted(records, key=lambda record: record.rank)
