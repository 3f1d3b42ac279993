"""Whether to save after a step: the one place that answers it, from checkpoint.every_steps and
every_minutes, the retries of failed saves, and the time since the last committed save."""

from __future__ import annotations

import time
from dataclasses import dataclass

from msjax.config import CheckpointConfig

RETRY_PAUSE_MAX_S = 60.0  # a failed save is retried after 1 s, 2 s, 4 s, ... at most this
NOT_FINISHED = -1  # the save in flight, as a process reports it: none, or still being written


@dataclass(frozen=True)
class SaveProposal:
    """This process's view of saving after a step, before the processes agree on it."""

    by_steps: bool = False  # checkpoint.every_steps asks for a save (the same on every process)
    by_clock: bool = False  # checkpoint.every_minutes have passed on this process's clock
    retry: bool = False  # a failed save's pause is over
    overdue: bool = False  # saves kept failing past checkpoint.max_unsaved_minutes
    finished: int = NOT_FINISHED  # the save in flight once finished here, else NOT_FINISHED
    failed: bool = False  # that save failed here


class SaveSchedule:
    """The checkpoint clock, the failures in a row with their back-off, and the unsaved clock.

    Only committed saves count as good: a save that started is neither a success nor a failure
    until its outcome is known (`committed` or `failed`). While saves are failing, a save is
    due only when the retry pause is over, whatever the step count or the clock say.
    """

    def __init__(self, options: CheckpointConfig):
        now = time.monotonic()
        self.options = options
        self.failures = 0  # saves failed in a row (skipped by any process, or not committed)
        self.in_flight = False  # a save was started and its outcome is not known yet
        self._last_attempt_s = now  # the clock of every_minutes: the last save tried (or start)
        self._failed_at_s = 0.0
        self._committed_s = now  # when the state of the newest committed save was taken

    def due_by_steps(self, step: int) -> bool:
        """Whether checkpoint.every_steps asks for a save after `step` updates (the same on
        every process) and no save is failing."""
        every = self.options.every_steps
        return bool(self.options.enabled and every and step % every == 0 and not self.failures)

    def due_by_clock(self) -> bool:
        """Whether checkpoint.every_minutes have passed since the last save was tried (this
        process's clock) and no save is failing."""
        minutes = self.options.every_minutes
        if not self.options.enabled or minutes is None or self.failures:
            return False
        return time.monotonic() - self._last_attempt_s >= 60 * minutes

    def retry_due(self) -> bool:
        """Whether a failed save is to be tried again: its pause is over (1 s, 2 s, 4 s, ...)
        and no other save is in flight."""
        if not self.failures or self.in_flight:
            return False
        return time.monotonic() - self._failed_at_s >= self.retry_pause_s

    def overdue(self) -> bool:
        """Whether saves are failing and the newest committed one (or the start) is older than
        checkpoint.max_unsaved_minutes."""
        minutes = self.options.max_unsaved_minutes
        unsaved_s = time.monotonic() - self._committed_s
        return bool(self.failures) and minutes is not None and unsaved_s > 60 * minutes

    @property
    def retry_pause_s(self) -> float:
        """How long after the last failure the save is tried again."""
        return min(2.0 ** (self.failures - 1), RETRY_PAUSE_MAX_S) if self.failures else 0.0

    def tried(self) -> float:
        """A save is tried now (the clock of every_minutes restarts); returns when."""
        self._last_attempt_s = time.monotonic()
        return self._last_attempt_s

    def committed(self, started_s: float) -> None:
        """The save tried at `started_s` is committed with an intact record."""
        self.failures = 0
        self.in_flight = False
        self._committed_s = max(self._committed_s, started_s)

    def failed(self) -> None:
        """The save tried last was skipped, or did not commit."""
        self.failures += 1
        self.in_flight = False
        self._failed_at_s = time.monotonic()
