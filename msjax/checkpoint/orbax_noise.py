"""Keep a failing background save to msjax's one-line warning.

When a write fails (a full disk), Orbax logs the error with its traceback from each of its
threads, and every TensorStore write still pending then reports "Event loop is closed" with a
traceback of its own, because Orbax closed the event loop it ran the save on: a thousand lines
per failed save, all saying what msjax's warning says in one. Orbax's error records keep their
first line; the closed-loop reports are counted, not printed. Anything else passes unchanged.
"""

from __future__ import annotations

import logging
import sys
import traceback
from types import TracebackType

MAX_LINE_CHARS = 300


class _OneLineOrbaxErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" in record.pathname and record.levelno >= logging.ERROR:
            first_line = record.getMessage().splitlines()[0] if record.getMessage() else ""
            if len(first_line) > MAX_LINE_CHARS:
                first_line = first_line[:MAX_LINE_CHARS] + " ..."
            record.msg, record.args = first_line, None
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def _is_closed_loop_report(error: BaseException, trace: TracebackType | None) -> bool:
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        return False
    frames = traceback.extract_tb(trace)
    return bool(frames) and frames[0].name == "call_soon_threadsafe"


class _ClosedLoopReports:
    """sys.unraisablehook for the reports TensorStore's callbacks write (PyErr_WriteUnraisable)."""

    def __init__(self, previous):
        self.previous = previous
        self.count = 0

    def __call__(self, unraisable) -> None:
        if _is_closed_loop_report(unraisable.exc_value, unraisable.exc_traceback):
            self.count += 1
            return
        self.previous(unraisable)


_installed: _ClosedLoopReports | None = None


def quiet_failed_saves() -> None:
    """Install both filters, once per process."""
    global _installed
    if _installed is not None:
        return
    logging.getLogger("absl").addFilter(_OneLineOrbaxErrors())
    _installed = _ClosedLoopReports(sys.unraisablehook)
    sys.unraisablehook = _installed
