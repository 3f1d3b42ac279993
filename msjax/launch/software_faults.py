"""The program's faults told from a machine's: a crash that repeats the one before it, the same
exception (msjax.resilience.crash_records' signature) at the same step, on any rank or slot, is
the program's or its inputs' (fault_kinds.SOFTWARE_FAULT): no restart or slot can help.
A crash while starting up (joining the job, reading data, restoring) is left to the start-up rule
of msjax.launch.policy (the same failure before the first step: a mistake, exit 2)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from msjax.launch.attempt import Attempt
from msjax.launch.fault_detection import DetectedFault
from msjax.resilience import fault_kinds
from msjax.resilience.crash_records import CrashRecord, read_crashes
from msjax.resilience.heartbeat import STARTUP_PHASES
from msjax.run_dir import RunDir


def repeated_crash(
    fault: DetectedFault, attempts: list[Attempt], run_dir: Path
) -> DetectedFault | None:
    """fault as a SOFTWARE_FAULT when the attempt it ended (attempts[-1]) crashed the way the
    attempt before it did (one that ran workers); None otherwise (a machine's crash, a first
    failure, or one without an exception: a signal, os._exit)."""
    if fault.kind is not fault_kinds.CRASH or len(attempts) < 2:
        return None
    current = attempts[-1]
    earlier = [attempt for attempt in attempts[:-1] if attempt.workers]
    if not earlier:
        return None
    previous = earlier[-1]
    before = read_crashes(run_dir, previous.number, previous.spawned_unix_s)
    for record in read_crashes(run_dir, current.number, current.spawned_unix_s):
        same = [old for old in before if _same_failure(old, record)]
        if same:
            return _software_fault(fault, same[0], record, previous, current, run_dir)
    return None


def _same_failure(old: CrashRecord, new: CrashRecord) -> bool:
    started = new.phase is not None and new.phase not in STARTUP_PHASES
    return started and (old.signature, old.step) == (new.signature, new.step)


def _software_fault(
    fault: DetectedFault,
    old: CrashRecord,
    new: CrashRecord,
    previous: Attempt,
    current: Attempt,
    run_dir: Path,
) -> DetectedFault:
    log = RunDir(run_dir).log(new.rank)
    detail = (
        f"{new.signature} at step {new.step} in attempt {previous.number} (rank {old.rank}) "
        f"and again in attempt {current.number} (rank {new.rank}); its traceback is in {log}"
    )
    return dataclasses.replace(
        fault, kind=fault_kinds.SOFTWARE_FAULT, rank=new.rank, detail=detail, step=new.step
    )
