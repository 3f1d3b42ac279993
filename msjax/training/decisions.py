"""What the loop does after a step: evaluate, save, stop. Decided in one place per step.

Every choice here changes what a process does next, so in a multi-process job all processes
must make it for the same step. Step-count choices (eval every N, save every N) are the same on
every process by construction; `agree` is where choices that one process can see alone (a stop
signal, a wall-clock save, a save to retry, saves overdue, a save finished or failed in the
background) are made the same for all, by one vote per step, decided one round behind: cast
after step s, acted on by every process at the next round. Where steps are very short the rounds
are a few steps apart (`VoteSpacing`), so the vote costs under 1% of the steps.

A stop comes from SIGTERM / SIGINT (`StopSignal`): a request to save after the current step and
leave. SIGTERM is idempotent (a scheduler and a launcher may both send one); only a second
SIGINT, or a signal more than `grace_s` after the first, makes the process leave at once.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from msjax.config import Config
from msjax.parallel.agreement import (
    MAX_STEPS_BETWEEN_ROUNDS,
    ProcessVote,
    VoteSpacing,
    process_vote,
)
from msjax.training.save_schedule import NOT_FINISHED, SaveProposal

if TYPE_CHECKING:
    from msjax.training.checkpoints import CheckpointSaves

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
