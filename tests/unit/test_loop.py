"""The loop's shape: the events its listeners hear, in order, and the decisions after each step."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from small_runs import QUICK_RUN

from msjax.checkpoint.manager import Checkpointer
from msjax.config import load_config
from msjax.loop_events import HOOKS, EventFanOut, LoopEvents
from msjax.observe.metrics import read_metrics
from msjax.train import train
from msjax.training.checkpoints import CheckpointSaves, StartingPoint
from msjax.training.decisions import Decider, Decision, StopSignal

TINY_RUN = [
    *QUICK_RUN,
    "train.eval_batches=1",
]


class Recorder(LoopEvents):
    """Every hook it hears, as (hook, first argument)."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, object]] = []

    def __getattribute__(self, name: str):
        if name in HOOKS:
            return lambda *args: self.heard.append((name, _first(name, args)))
        return super().__getattribute__(name)


def _first(name: str, args: tuple) -> object:
    if name == "step_end":
        return args[0]["step"]
    if name == "compiled":
        return None
    return args[0] if args else None


def test_a_listener_hears_every_step_eval_and_save_in_loop_order(tmp_path: Path):
    recorder = Recorder()
    overrides = [
        *TINY_RUN,
        "train.steps=4",
        "train.eval_every=2",
        "checkpoint.every_steps=2",
        f"run.dir={tmp_path / 'run'}",
    ]
    train(load_config(None, overrides), io.StringIO(), listeners=[recorder])
    heard = [(hook, arg) for hook, arg in recorder.heard if hook != "result_fetched"]
    step = [("step_begin", 0), ("batch_ready", 0), ("step_dispatched", 0)]
    expected = [
        ("run_start", 0),
        ("compiled", None),
        *step,
        *[(hook, 1) for hook, _ in step],
        ("step_end", 0),  # step 0 is read back once step 1 is dispatched
        ("step_end", 1),  # step 2 needs both: eval and save follow it
        ("eval_begin", 1),
        ("eval_end", 1),
        ("save_begin", 2),
        ("save_end", 2),
        *[(hook, 2) for hook, _ in step],
        *[(hook, 3) for hook, _ in step],
        ("step_end", 2),
        ("step_end", 3),  # the last step is saved and evaluated by the end of the run
        ("save_begin", 4),
        ("save_end", 4),
        ("saves_draining", None),
        ("eval_begin", 3),
        ("eval_end", 3),
        ("run_end", 4),
    ]
    assert heard == expected
    fetched = [arg for hook, arg in recorder.heard if hook == "result_fetched"]
    assert fetched == [0, 1, 2, 3]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if "eval_loss" in r] == [1, 3]
    assert [r["step"] for r in records if "checkpoint_save_blocked_s" in r] == [2, 4]


class Failing(LoopEvents):
    def __init__(self, log: list[str], name: str, fail_on: str | None = None):
        self.log, self.name, self.fail_on = log, name, fail_on

    def step_begin(self, step: int) -> None:
        self.log.append(f"{self.name}.step_begin({step})")
        if self.fail_on == "step_begin":
            raise RuntimeError("boom")

    def run_failed(self) -> None:
        self.log.append(f"{self.name}.run_failed")


def test_fan_out_calls_listeners_in_order_and_tells_all_of_a_failure():
    log: list[str] = []
    events = EventFanOut([Failing(log, "a"), Failing(log, "b", "step_begin"), Failing(log, "c")])
    with pytest.raises(RuntimeError, match="boom"), events:
        events.step_begin(7)
    # c never hears the step that b failed on, but every listener hears the failure
    assert log == [
        "a.step_begin(7)",
        "b.step_begin(7)",
        "a.run_failed",
        "b.run_failed",
        "c.run_failed",
    ]


def decider(tmp_path: Path, stop: StopSignal, **overrides) -> Decider:
    overrides = [f"train.{k}={v}" for k, v in overrides.items()]
    config = load_config(None, [*overrides, "checkpoint.every_steps=3"])
    checkpointer = Checkpointer(tmp_path / "checkpoints", config.checkpoint)
    start = StartingPoint(state=None, step=0, first_sample=0, restored=None)
    saves = CheckpointSaves(config, checkpointer, start, LoopEvents(), print)
    return Decider(config, stop, can_evaluate=True, saves=saves)


def test_decisions_follow_the_cadences_and_leave_the_last_step_to_the_end(tmp_path: Path):
    decide = decider(tmp_path, StopSignal(), steps=9, eval_every=2)
    decisions = [decide.after_step(step) for step in range(1, 10)]
    assert [d.step for d in decisions if d.evaluate] == [2, 4, 6, 8]
    assert [d.step for d in decisions if d.save] == [3, 6]
    assert [d.step for d in decisions if d.needs_result] == [2, 3, 4, 6, 8]
    assert not any(d.stop_by for d in decisions)


def test_a_stop_signal_is_part_of_the_next_decision(tmp_path: Path):
    stop = StopSignal()
    decide = decider(tmp_path, stop, steps=9, eval_every=0)
    assert decide.after_step(1) == Decision(step=1)
    stop.received = "SIGTERM"
    assert decide.after_step(2) == Decision(step=2, stop_by="SIGTERM")
    assert decide.after_step(2).needs_result


class FailsOnceCompiled(LoopEvents):
    """A listener whose work after the compile raises, as a user's own listener may."""

    def compiled(self, train_step: object) -> None:
        raise RuntimeError("this listener failed")


def test_a_failure_after_run_start_and_before_the_first_step_reaches_every_listener(
    tmp_path: Path,
):
    recorder = Recorder()
    overrides = [*TINY_RUN, "train.steps=2", f"run.dir={tmp_path / 'run'}"]
    with pytest.raises(RuntimeError, match="this listener failed"):
        train(load_config(None, overrides), io.StringIO(), [recorder, FailsOnceCompiled()])
    assert [hook for hook, _ in recorder.heard] == ["run_start", "compiled", "run_failed"]
