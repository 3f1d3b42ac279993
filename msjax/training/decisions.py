"""What the loop does after a step: evaluate, save, stop. Decided in one place per step.

Every choice here changes what a process does next, so in a multi-process job all processes
must make it for the same step. Step-count choices (eval every N, save every N) are the same on
every process by construction; `agree` is where choices that one process can see alone (a stop
signal, a wall-clock save, a save to retry, saves overdue, a save finished or failed in the
background) are made the same for all, by one vote per step, decided one round behind: cast
after step s, acted on by every process at the next round. Where steps are very short the rounds
are a few steps apart (`VoteSpacing`), so the vote costs under 1% of the steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from msjax.config import Config
from msjax.parallel.agreement import (
    MAX_STEPS_BETWEEN_ROUNDS,
    ProcessVote,
    VoteSpacing,
    process_vote,
)
from msjax.training.save_schedule import NOT_FINISHED, SaveProposal
from msjax.training.stop_signal import StopSignal

if TYPE_CHECKING:
    from msjax.training.checkpoints import CheckpointSaves

STOP_SIGNALS = (None, "SIGTERM", "SIGINT")  # a vote's stop value indexes this


@dataclass(frozen=True)
class Decision:
    """What follows a step that leaves the state at `step` updates."""

    step: int
    evaluate: bool = False
    save: bool = False
    stop_by: str | None = None  # the signal that asked the run to stop
    saves_failing: bool = False  # saves kept failing past checkpoint.max_unsaved_minutes
    # the step of the save in flight once it has finished on every process, else NOT_FINISHED
    save_finished: int = NOT_FINISHED
    save_failed: bool = False  # that save failed (on some process)

    @property
    def needs_result(self) -> bool:
        """Whether the step's metrics must be read now (they are reported before what follows)."""
        return self.evaluate or self.save or self.stop_by is not None or self.saves_failing


class Decider:
    """Makes the decision after each step from the config, signals and what the save owner
    proposes (`CheckpointSaves`, the one answer to "save now?"), and tells the save owner what
    every process agreed on."""

    def __init__(
        self,
        config: Config,
        stop: StopSignal,
        can_evaluate: bool,
        saves: CheckpointSaves | None = None,
    ):
        self.total_steps = config.train.steps
        self.eval_every = config.train.eval_every if can_evaluate else 0
        self.stop = stop
        self.saves = saves  # None: a run that saves nothing
        # between two rounds a peer may take their steps, a save and an evaluation (which
        # compiles)
        r = config.resilience
        steps_s = MAX_STEPS_BETWEEN_ROUNDS * r.step_deadline_s
        timeout_s = steps_s + r.checkpoint_deadline_s + r.compile_deadline_s
        self.vote = process_vote("decide", timeout_s)
        self.spacing = VoteSpacing()
        self.save_voted = False  # this process's vote for a save is being decided

    def after_step(self, step: int) -> Decision:
        """The decision once the state has `step` updates; the run's last step is never saved
        or evaluated here (the end of the run does both)."""
        before_end = step < self.total_steps
        saving = SaveProposal() if self.saves is None else self.saves.proposal(step, before_end)
        local = Decision(
            step=step,
            evaluate=bool(self.eval_every) and step % self.eval_every == 0 and before_end,
            save=saving.by_steps,
            stop_by=self.stop.received,
            saves_failing=saving.overdue,
            save_finished=saving.finished,
            save_failed=saving.failed,
        )
        decision, self.save_voted = agree(
            local, saving.by_clock, self.vote, saving.retry, self.save_voted, self.spacing
        )
        if self.saves is not None:
            self.saves.agreed(decision)  # a save finished everywhere is counted by all now
        return decision


def agree(
    local: Decision,
    clock_save: bool,
    vote: ProcessVote | None,
    retry: bool = False,
    save_voted: bool = False,
    spacing: VoteSpacing | None = None,
) -> tuple[Decision, bool]:
    """The decision every process acts on for this step, and whether this process has voted
    for a save that is still being decided (it does not vote for it again meanwhile).

    One process: its own, at once. Several: the step-count parts (evaluate, a save every N
    steps) are identical everywhere and act at once; a stop signal, a save to retry, saves
    failing for too long, a save still being written or failed, seen by any process, count for
    all; a save that is due by the clock is process 0's call (each clock would decide at
    another step). Those are voted one round behind (`ProcessVote.agree_behind`): cast now,
    acted on by every process at its next round, which is the next step or, with `spacing`,
    the step the previous round agreed on (no process acts on them in between). A save in
    flight counts as finished only when every process reported the same save finished (the
    least reported step is its step).
    """
    if vote is None:
        return dataclasses.replace(local, save=local.save or clock_save or retry), False
    if spacing is not None and not spacing.due(local.step):
        return voted(local, None), save_voted
    import jax

    mine = (retry or (clock_save and jax.process_index() == 0)) and not save_voted
    agreed = vote.agree_behind(
        [
            STOP_SIGNALS.index(local.stop_by),
            int(mine),
            int(local.saves_failing),
            -local.save_finished,  # the maximum of these is minus the least finished step
            int(local.save_failed),
            spacing.proposal(local.step) if spacing is not None else 1,
        ]
    )
    if spacing is not None:
        spacing.agreed(local.step, None if agreed is None else agreed[-1])
    return voted(local, agreed), mine


def voted(local: Decision, agreed: tuple[int, ...] | None) -> Decision:
    """local with its voted parts replaced by a round's answer (None: none this step)."""
    stop, save, failing, least_finished, failed = (
        agreed[:5] if agreed is not None else (0, 0, 0, -NOT_FINISHED, 0)
    )
    return dataclasses.replace(
        local,
        save=local.save or bool(save),
        stop_by=STOP_SIGNALS[stop],
        saves_failing=bool(failing),
        save_finished=-least_finished,
        save_failed=bool(failed),
    )
