"""What the train loop tells everything around it: one hook per moment of a step.

Metrics, the progress line, heartbeats and faults, rank timing, the flight recorder, checkpoint
and evaluation records plug into the loop as `LoopEvents` listeners, so the loop never grows a
branch for them (Levanter's hooks, nanodo's small named pieces). Every hook does nothing unless a
listener overrides it; `EventFanOut` calls the listeners in the order given.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

StepRecord = dict[str, Any]  # step, loss, grad_norm, lr, step_time_s, tokens_per_s, mfu, ...


class LoopEvents:
    """The hooks of one process's train loop, in the order they happen."""

    def run_start(self, start_step: int, restored_from: Path | None) -> None:
        """The state is restored (or initialized) at start_step; compiling comes next."""

    def compiled(self, compiled_step: Any) -> None:
        """The train step is compiled (an XLA executable); the loop starts."""

    def step_begin(self, step: int) -> None:
        """Step `step` (0-based: the update that makes `step + 1`) is about to run."""

    def batch_ready(self, step: int, data_wait_s: float) -> None:
        """The step's batch is on the devices, after waiting data_wait_s for it."""

    def step_dispatched(self, step: int) -> None:
        """The step is queued on the devices; its result is read after the next is dispatched."""

    def result_fetched(self, step: int, waited_s: float) -> None:
        """The step's metrics reached the host after blocking waited_s (every rank's share)."""

    def step_end(self, record: StepRecord) -> None:
        """The step's metrics, timed; raising here (a non-finite loss) stops the run."""

    def step_skipped(self, step: int) -> None:
        """The step's batch was drawn and dropped (a rollback past a non-finite loss)."""

    def eval_begin(self, step: int) -> None: ...

    def eval_end(self, step: int, loss: float) -> None: ...

    def save_begin(self, step: int) -> None:
        """A checkpoint of the state after `step` updates is about to start."""

    def save_end(self, step: int, blocked_s: float | None) -> None:
        """The save started (the loop was held blocked_s), or failed (None) and was reported."""

    def memory_snapshot(
        self, step: int, stall_s: float, snapshot_bytes: int, skipped_total: int
    ) -> None:
        """An in-memory snapshot of the state after `step` updates was started (the loop waited
        stall_s; this process's shards hold snapshot_bytes), or skipped (0 bytes) because the one
        before was still being written; skipped_total counts those so far."""

    def saves_draining(self) -> None:
        """The loop is over; every started save is being waited for."""

    def run_end(self, final_step: int) -> None:
        """The loop is over and every save is on disk; the state has final_step updates."""

    def run_failed(self) -> None:
        """The loop is leaving by an exception."""


HOOKS = tuple(name for name in vars(LoopEvents) if not name.startswith("_"))


class EventFanOut(LoopEvents):
    """Calls each hook on every listener, in order. Use as a context manager around the loop:
    leaving it by an exception tells every listener `run_failed`."""

    def __init__(self, listeners: Sequence[LoopEvents]):
        self.listeners = tuple(listeners)

    def listen(self, listener: LoopEvents) -> None:
        """`listener` hears every hook from now on, after the others."""
        self.listeners = (*self.listeners, listener)

    def __enter__(self) -> EventFanOut:
        return self

    def __exit__(self, error_type: type | None, *rest: object) -> None:
        if error_type is not None:
            self.run_failed()


def _fan_out(name: str) -> Any:
    def call(self: EventFanOut, *args: Any) -> None:
        for listener in self.listeners:
            getattr(listener, name)(*args)

    call.__name__ = name
    call.__doc__ = getattr(LoopEvents, name).__doc__
    return call


for _hook in HOOKS:
    setattr(EventFanOut, _hook, _fan_out(_hook))
