"""The supervisor's state table: every state placed, every move the loop makes allowed, the rest
refused, and every state on a path from the start to an end."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from msjax.config import load_config
from msjax.launch.launches import RUNNING, read_launches
from msjax.launch.layout import JobLayout
from msjax.launch.supervisor import Supervisor
from msjax.launch.supervisor_states import (
    ALLOWED_TRANSITIONS,
    State,
    TransitionRefused,
    check_transition,
)
from msjax.run_dir import RunDir


def reachable(start: State) -> set[State]:
    seen, todo = {start}, [start]
    while todo:
        for following in ALLOWED_TRANSITIONS[todo.pop()]:
            if following not in seen:
                seen.add(following)
                todo.append(following)
    return seen


def test_every_state_has_one_row_of_the_table():
    assert set(ALLOWED_TRANSITIONS) == set(State)


def test_only_done_gave_up_and_stopped_are_final():
    assert {state for state in State if state.final} == {State.DONE, State.GAVE_UP, State.STOPPED}


def test_every_state_is_reached_from_the_start_and_reaches_an_end():
    assert reachable(State.BUILT) == set(State)
    for state in State:
        assert any(end.final for end in reachable(state)), state


@pytest.mark.parametrize(
    ("current", "following"),
    [
        (State.RUNNING, State.FAULTED),
        (State.FAULTED, State.BACKING_OFF),
        (State.BACKING_OFF, State.RUNNING),
        (State.CHECKING, State.STOPPING),
        (State.STOPPING, State.STOPPED),
    ],
)
def test_the_loops_moves_are_allowed(current, following):
    check_transition(current, following)


@pytest.mark.parametrize(
    ("current", "following", "message"),
    [
        (State.DONE, State.RUNNING, "from done to running (from done: nowhere)"),
        (State.BUILT, State.RUNNING, "from built to running (from built: starting)"),
        (State.RUNNING, State.BACKING_OFF, "from running to backing_off"),
        (State.FAULTED, State.RUNNING, "(from faulted: backing_off, gave_up)"),
    ],
)
def test_any_other_move_is_refused(current, following, message):
    with pytest.raises(TransitionRefused, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_transition(current, following)


def supervisor_in(run_dir: Path) -> Supervisor:
    config = load_config("configs/tiny.yaml", [f"run.dir={run_dir}", "mesh.data=1"])
    return Supervisor(config, run_dir, [], JobLayout(1, None), out=io.StringIO())


def test_a_supervisor_refuses_a_move_off_its_table_and_writes_nothing_for_it(tmp_path):
    supervisor = supervisor_in(tmp_path)
    with pytest.raises(TransitionRefused, match="from built to done"):
        supervisor.enter(State.DONE)
    assert supervisor.state is State.BUILT
    assert not RunDir(tmp_path).launches.exists()
    assert supervisor.out.getvalue() == ""


def test_entering_starting_puts_the_launch_on_record_as_running(tmp_path):
    supervisor = supervisor_in(tmp_path)
    supervisor.enter(State.STARTING)
    assert supervisor.state is State.STARTING
    assert [launch["outcome"] for launch in read_launches(RunDir(tmp_path))] == [RUNNING]
