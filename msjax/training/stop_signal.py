"""SIGTERM / SIGINT in the train loop: a request to save after the current step and leave.

SIGTERM is idempotent (a scheduler and a launcher may both send one); only a second SIGINT, or a
signal more than `grace_s` after the first, makes the process leave at once.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

DEFAULT_GRACE_S = 600.0  # resilience.checkpoint_deadline_s's default
STOP_SIGNUMS = (signal.SIGTERM, signal.SIGINT)
_early: tuple[str, float] | None = None  # the first stop signal before the loop's StopSignal
_before_early: dict[int, Any] = {}  # the handlers remember_stop_signals_from_start replaced


def _remember_early(signum: int, frame: Any) -> None:
    global _early
    if _early is None:
        _early = (signal.Signals(signum).name, time.monotonic())
    elif signum == signal.SIGINT and _early[0] == "SIGINT":
        raise KeyboardInterrupt  # Ctrl-C twice while starting up: the user insists


def remember_stop_signals_from_start() -> None:
    """From a worker's first line on: a SIGTERM or SIGINT while it joins the job, reads data or
    compiles is kept, and the loop's StopSignal acts on it after the first step (a scheduler
    that preempts a job just started still gets its checkpoint and a clean exit)."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNUMS:
            previous = signal.signal(signum, _remember_early)
            if previous is not _remember_early:
                _before_early[signum] = previous


def forget_stop_signals_from_start() -> None:
    """Put back the handlers remember_stop_signals_from_start replaced (msjax.train's main
    called in a process that goes on, such as a test)."""
    global _early
    if threading.current_thread() is threading.main_thread():
        for signum, handler in _before_early.items():
            if signal.getsignal(signum) is _remember_early:
                signal.signal(signum, handler)
    _before_early.clear()
    _early = None


class StopSignal:
    """Installed for the whole run, final save included: the first SIGTERM or SIGINT asks the
    run to finish its step, save and leave; more SIGTERMs repeat that request. KeyboardInterrupt
    (leave now, even mid-save) comes only from a second SIGINT, the user pressing Ctrl-C again,
    or from any signal `grace_s` after the first, when the save should long have finished."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        self.grace_s = grace_s
        self.received: str | None = None
        self.count = 0  # stop signals received so far
        self._first_at: float | None = None
        self._signals_seen: set[str] = set()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        global _early
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNUMS:
                previous = signal.signal(signum, self._handle)
                if previous is _remember_early:  # put back what was there before it, at the end
                    previous = _before_early.get(signum, signal.SIG_DFL)
                self._previous[signum] = previous
        if _early is not None:  # received while starting up
            self.received, self._first_at = _early
            self._signals_seen.add(self.received)
            self.count = 1
            _early = None
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        self.count += 1
        if self._first_at is None:
            self._first_at = now
            self.received = name
        elif (name == "SIGINT" and name in self._signals_seen) or (
            now - self._first_at > self.grace_s
        ):
            raise KeyboardInterrupt
        self._signals_seen.add(name)

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
