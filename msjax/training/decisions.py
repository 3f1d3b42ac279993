"""What the loop does after a step: evaluate, save, stop. Decided in one place per step.

Every choice here changes what a process does next, so in a multi-process job all processes
must make it for the same step. Step-count choices (eval every N, save every N) are the same on
every process by construction; `agree` is where choices that one process can see alone (a stop
signal, a wall-clock save) are made the same for all.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from typing import Any

from msjax.checkpoint.manager import Checkpointer
from msjax.config import Config


class StopSignal:
    """SIGTERM / SIGINT (preemption): finish the current step, save, and leave cleanly."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # a second signal: the user insists
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


@dataclass(frozen=True)
class Decision:
    """What follows a step that leaves the state at `step` updates."""

    step: int
    evaluate: bool = False
    save: bool = False
    stop_by: str | None = None  # the signal that asked the run to stop

    @property
    def needs_result(self) -> bool:
        """Whether the step's metrics must be read now (they are reported before what follows)."""
        return self.evaluate or self.save or self.stop_by is not None


class Decider:
    """Makes the decision after each step from the config, the checkpoint clock and signals."""

    def __init__(
        self, config: Config, checkpointer: Checkpointer, stop: StopSignal, can_evaluate: bool
    ):
        self.total_steps = config.train.steps
        self.eval_every = config.train.eval_every if can_evaluate else 0
        self.checkpointer = checkpointer
        self.stop = stop

    def after_step(self, step: int) -> Decision:
        """The decision once the state has `step` updates; the run's last step is never saved
        or evaluated here (the end of the run does both)."""
        before_end = step < self.total_steps
        local = Decision(
            step=step,
            evaluate=bool(self.eval_every) and step % self.eval_every == 0 and before_end,
            save=self.checkpointer.due(step) and before_end,
            stop_by=self.stop.received,
        )
        return agree(local)


def agree(local: Decision) -> Decision:
    """The decision every process acts on for this step.

    One process: its own. Several: the step-count parts are identical everywhere already; the
    signal and the wall-clock save are still each process's own view here.
    """
    return local
