"""The supervisor's states and the transitions allowed between them: one table, read by
Supervisor.enter, which refuses any other move (after Megatron-LM's rerun state machine and the
NVIDIA Resiliency Extension's rank monitor, whose states are an `allowed_transitions` table).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from enum import Enum


class State(Enum):
    """Where a launch stands; what each state writes on entry is in Supervisor's records."""

    BUILT = "built"  # constructed; nothing on record yet
    STARTING = "starting"  # the launch on record (launches.jsonl), before any worker
    CHECKING = "checking"  # self-checks before an attempt (resilience.check_budget_s > 0)
    RUNNING = "running"  # an attempt's workers started and watched
    REGROWING = "regrowing"  # an attempt stopped so that a re-admitted slot rejoins the mesh
    FAULTED = "faulted"  # a fault found: its incident recorded, the policy's action taken
    BACKING_OFF = "backing_off"  # waiting before the next attempt
    STOPPING = "stopping"  # SIGTERM / SIGINT: the workers save and stop
    DONE = "done"  # train.steps reached
    GAVE_UP = "gave_up"  # the policy stopped the job (its exit code)
    STOPPED = "stopped"  # stopped by a signal

    @property
    def final(self) -> bool:
        return not ALLOWED_TRANSITIONS[self]


# state -> the states it may move to; the final ones move nowhere
ALLOWED_TRANSITIONS: dict[State, frozenset[State]] = {
    State.BUILT: frozenset({State.STARTING}),
    State.STARTING: frozenset({State.CHECKING, State.RUNNING}),
    State.CHECKING: frozenset({State.RUNNING, State.FAULTED, State.STOPPING}),
    State.RUNNING: frozenset({State.REGROWING, State.FAULTED, State.STOPPING, State.DONE}),
    State.REGROWING: frozenset({State.CHECKING, State.RUNNING}),
    State.FAULTED: frozenset({State.BACKING_OFF, State.GAVE_UP}),
    State.BACKING_OFF: frozenset({State.CHECKING, State.RUNNING, State.STOPPED}),
    State.STOPPING: frozenset({State.STOPPED}),
    State.DONE: frozenset(),
    State.GAVE_UP: frozenset(),
    State.STOPPED: frozenset(),
}


class TransitionRefused(RuntimeError):
    """A move the table does not allow: a bug in the supervisor, never the user's mistake."""


def check_transition(current: State, following: State) -> None:
    """Raise TransitionRefused unless the table allows current -> following."""
    if following not in ALLOWED_TRANSITIONS[current]:
        allowed = ", ".join(sorted(state.value for state in ALLOWED_TRANSITIONS[current]))
        raise TransitionRefused(
            f"the supervisor cannot go from {current.value} to {following.value} "
            f"(from {current.value}: {allowed or 'nowhere'})"
        )


@dataclass
class StopRequest:
    """SIGTERM or SIGINT to the supervisor (a preemption): which, and when it first came."""

    signal_name: str | None = None
    unix_s: float | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def take(self, signum: int) -> None:
        """Called from the signal handler: the latest signal names the request, the first its
        time."""
        self.signal_name = signal.Signals(signum).name
        if self.unix_s is None:
            self.unix_s = time.time()
