"""What the loop does after a step: evaluate, save, stop. Decided in one place per step.

Every choice here changes what a process does next, so in a multi-process job all processes
must make it for the same step. Step-count choices (eval every N, save every N) are the same on
every process by construction; `agree` is where choices that one process can see alone (a stop
signal, a wall-clock save, a save overdue, a save finished or failed in the background) are made
the same for all, by one vote per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from msjax.config import Config
from msjax.parallel.agreement import ProcessVote, process_vote
from msjax.training.checkpoints import CheckpointSaves
from msjax.training.save_schedule import SaveSchedule
from msjax.training.stop_signal import StopSignal

STOP_SIGNALS = (None, "SIGTERM", "SIGINT")  # a vote's stop value indexes this


@dataclass(frozen=True)
class Decision:
    """What follows a step that leaves the state at `step` updates."""

    step: int
    evaluate: bool = False
    save: bool = False
    stop_by: str | None = None  # the signal that asked the run to stop
    saves_failing: bool = False  # saves kept failing past checkpoint.max_unsaved_minutes
    save_writing: bool = False  # the save in flight is still being written (on some process)
    save_failed: bool = False  # the save in flight finished and failed (on some process)

    @property
    def needs_result(self) -> bool:
        """Whether the step's metrics must be read now (they are reported before what follows)."""
        return self.evaluate or self.save or self.stop_by is not None or self.saves_failing


class Decider:
    """Makes the decision after each step from the config, the save schedule (the one answer
    to "save now?"), the save in flight and signals; counts the save in flight once every
    process has seen it finish."""

    def __init__(
        self,
        config: Config,
        schedule: SaveSchedule,
        stop: StopSignal,
        can_evaluate: bool,
        saves: CheckpointSaves | None = None,
    ):
        self.total_steps = config.train.steps
        self.eval_every = config.train.eval_every if can_evaluate else 0
        self.schedule = schedule
        self.stop = stop
        self.saves = saves
        self.vote = process_vote("decide")

    def after_step(self, step: int) -> Decision:
        """The decision once the state has `step` updates; the run's last step is never saved
        or evaluated here (the end of the run does both)."""
        before_end = step < self.total_steps
        writing, failed = (
            (False, False) if self.saves is None else self.saves.view_of_save_in_flight()
        )
        local = Decision(
            step=step,
            evaluate=bool(self.eval_every) and step % self.eval_every == 0 and before_end,
            save=(self.schedule.due_by_steps(step) or self.schedule.retry_due()) and before_end,
            stop_by=self.stop.received,
            saves_failing=self.schedule.overdue(),
            save_writing=writing,
            save_failed=failed,
        )
        decision = agree(local, self.schedule.due_by_clock() and before_end, self.vote)
        if self.saves is not None and self.schedule.in_flight and not decision.save_writing:
            self.saves.settle(decision.save_failed)  # finished everywhere: counted by all now
        return decision


def agree(local: Decision, clock_save: bool, vote: ProcessVote | None) -> Decision:
    """The decision every process acts on for this step.

    One process: its own. Several: the step-count parts are identical everywhere already; a
    stop signal, a save to retry, saves failing for too long, a save still being written or
    failed, seen by any process, count for all; a save that is due by the clock is process 0's
    call (each clock would decide at another step).
    """
    if vote is None:
        return dataclasses.replace(local, save=local.save or clock_save)
    import jax

    clock_save = clock_save and jax.process_index() == 0
    stop, save, failing, writing, failed = vote.agree(
        [
            STOP_SIGNALS.index(local.stop_by),
            int(local.save or clock_save),
            int(local.saves_failing),
            int(local.save_writing),
            int(local.save_failed),
        ]
    )
    return dataclasses.replace(
        local,
        save=bool(save),
        stop_by=STOP_SIGNALS[stop],
        saves_failing=bool(failing),
        save_writing=bool(writing),
        save_failed=bool(failed),
    )
