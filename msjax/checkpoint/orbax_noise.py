"""Keep a failing background save to msjax's one-line warning.

When a write fails (a full disk), Orbax logs the error with its traceback from each of its
threads, and every TensorStore write still pending then reports "Event loop is closed" with a
traceback of its own, because Orbax closed the event loop it ran the save on, and write
coroutines that nothing awaits any more report their error as they are collected: a thousand
lines per failed save, all saying what msjax's warning says in one. Orbax's error records keep
their first line; those reports are dropped. Anything else passes unchanged.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from types import TracebackType

MAX_LINE_CHARS = 300


class _OneLineOrbaxErrors(logging.Filter):
    """Orbax's own error records (logger absl): their first line, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" in record.pathname and record.levelno >= logging.ERROR:
            first_line = record.getMessage().splitlines()[0] if record.getMessage() else ""
            if len(first_line) > MAX_LINE_CHARS:
                first_line = first_line[:MAX_LINE_CHARS] + " ..."
            record.msg, record.args = first_line, None
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


class _UnretrievedSaveErrors(logging.Filter):
    """asyncio's "Task exception was never retrieved" for a failed save's write tasks (logger
    asyncio): dropped, as the save's failure is msjax's warning already."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc_info = record.exc_info
        return not (exc_info and exc_info[1] is not None and _is_save_report(*exc_info[1:]))


def _is_save_report(error: BaseException, trace: TracebackType | None) -> bool:
    """A closed-loop report of a pending write, or the error of a save's write coroutine that
    nothing awaited any more (ignored by Python, its traceback in Orbax's code)."""
    frames = traceback.extract_tb(trace)
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return bool(frames) and frames[0].name == "call_soon_threadsafe"
    return any(f"{os.sep}orbax{os.sep}" in frame.filename for frame in frames)


class _SaveReports:
    """sys.unraisablehook for the reports of a failed save's writes (PyErr_WriteUnraisable)."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        if not _is_save_report(unraisable.exc_value, unraisable.exc_traceback):
            self.previous(unraisable)


_installed: _SaveReports | None = None


def quiet_failed_saves() -> None:
    """Install the filters and the hook, once per process."""
    global _installed
    if _installed is not None:
        return
    logging.getLogger("absl").addFilter(_OneLineOrbaxErrors())
    logging.getLogger("asyncio").addFilter(_UnretrievedSaveErrors())
    _installed = _SaveReports(sys.unraisablehook)
    sys.unraisablehook = _installed
