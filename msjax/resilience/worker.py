"""The train loop's side of resilience: this rank's heartbeat, injected faults and skip list as
one listener of the loop's events; plus the non-finite-loss stop."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from msjax.distributed import ATTEMPT, PROCESS_ID
from msjax.loop_events import LoopEvents, StepRecord
from msjax.resilience.faults import FaultInjector
from msjax.resilience.heartbeat import Heartbeat, Phase, mark_startup
from msjax.resilience.job_end import leave_job_now

__all__ = [
    "NonFiniteLoss",
    "SavesFailing",
    "StepHooks",
    "WorkerResilience",
    "dump_stacks_from_start",
    "leave_job_now",
]
from msjax.resilience.skips import read_skipped_steps


class NonFiniteLoss(Exception):
    """A step's loss, gradients or new parameters were NaN or infinite; the run stops (the
    step itself kept the state as it was, so no checkpoint holds a non-finite value)."""

    def __init__(self, step: int, loss: float, update_finite: bool = True):
        what = f"the loss of step {step} is {loss}"
        if math.isfinite(loss) and not update_finite:
            what = f"the update of step {step} (gradients or new parameters) is not finite"
        super().__init__(
            f"{what}; stopping before any checkpoint of that state "
            "(under msjax.launch with resilience.on_nonfinite_loss=rollback the run resumes "
            "from the last checkpoint and skips that step's batch)"
        )
        self.step = step
        self.loss = loss


class SavesFailing(Exception):
    """Checkpoint saves kept failing (an infrastructure fault, not a user error): the attempt
    ends with exit code 6, which the supervisor restarts from the last good checkpoint."""


def dump_stacks_from_start(run_dir: str | None) -> None:
    """A worker under msjax.launch answers SIGUSR1 with its stacks from its first moment on, so
    one hung joining the job or preparing data is diagnosed, not killed (SIGUSR1's default);
    WorkerResilience takes the handler over later."""
    global _stacks_from_start
    if not run_dir or ATTEMPT not in os.environ:
        return
    try:
        rank, attempt = int(os.environ.get(PROCESS_ID, "0")), int(os.environ[ATTEMPT])
    except ValueError:
        return  # joining the job names the bad variable (JobEnv.read)
    heartbeat = Heartbeat(Path(run_dir), rank, every_s=float("inf"), attempt=attempt)
    heartbeat.dump_stacks_on_sigusr1(Path(run_dir))
    _stacks_from_start = heartbeat  # its stacks file stays open as long as the process


_stacks_from_start: Heartbeat | None = None


class StepHooks:
    """What resilience may change in a step as the loop runs it: a skipped step (a rollback after
    a non-finite loss), and an injected fault's batch, state or loss as read back (drills)."""

    def __init__(self, faults: FaultInjector, skipped_steps: frozenset[int], vocab_size: int = 0):
        self.faults = faults
        self.skipped_steps = skipped_steps
        self.vocab_size = vocab_size  # an injected bad token is this id, just past the table

    def skips(self, step: int) -> bool:
        """Whether step's batch is to be dropped (a rollback after a non-finite loss)."""
        return step in self.skipped_steps

    def batch(self, step: int, batch: dict) -> dict:
        """The batch of step `step` as the step sees it (an injected `bad_token` alters it)."""
        return self.faults.batch(step, batch, self.vocab_size) if self.faults.active else batch

    def after_update(self, step: int, state: Any) -> Any:
        """The state after step `step`'s update as this rank holds it (an injected `bitflip`
        changes one bit of it on the device)."""
        return self.faults.after_update(step, state) if self.faults.active else state

    def loss(self, step: int, loss: float) -> float:
        """The loss as this rank reads it back (an injected `nan` fault replaces it)."""
        return self.faults.loss(step, loss)


class WorkerResilience(LoopEvents):
    """Heartbeat, fault injection and skipped steps of one rank, listening to the train loop.

    Heartbeat phases: `init` until the state is ready, `compile` through the first step, then
    `step`, `eval` and `checkpoint` as the loop moves, `drain` while the last saves finish,
    `done` at the end. A step that begins
    after an evaluation or a save is back in phase `step` (its hang is judged by the step
    deadline, not by the save's).
    """

    def __init__(
        self,
        run_dir: Path,
        heartbeat: Heartbeat,
        attempt: int,
        wait_for_saves: Callable[[], None],
        hold_save_write: Callable[[int], None],
        vocab_size: int = 0,
    ):
        # the one handle through which drills and the skip list reach the train loop
        self.step_hooks = StepHooks(
            FaultInjector.from_env(run_dir, heartbeat.rank, attempt),
            read_skipped_steps(run_dir),
            vocab_size,
        )
        self.faults = self.step_hooks.faults  # the drills the hooks apply, built once for both
        self.wait_for_saves = wait_for_saves
        self.hold_save_write = hold_save_write  # an injected crash_in_save holds its save
        self.heartbeat = heartbeat  # the rank's one heartbeat, made when its run dir was known
        self.heartbeat.dump_stacks_on_sigusr1(run_dir)
        self.heartbeat.beat("init")

    def beat(self, phase: Phase, step: int | None = None) -> None:
        self.heartbeat.beat(phase, step)

    def run_start(self, start_step: int, restored_from: Path | None) -> None:
        self.heartbeat.start_step = start_step
        self.heartbeat.beat("compile", start_step)

    def step_begin(self, step: int) -> None:
        if self.heartbeat.phase in ("checkpoint", "eval"):
            self.heartbeat.beat("step")  # the save (or evaluation) is behind: a step again
        self.faults.before_step(step, self.wait_for_saves)

    def batch_ready(self, step: int, data_wait_s: float) -> None:
        mark_startup("first_batch")

    def step_dispatched(self, step: int) -> None:
        mark_startup("first_step_dispatched")

    def step_end(self, record: StepRecord) -> None:
        """A heartbeat, or NonFiniteLoss before any save of that state."""
        step, loss = record["step"], record["loss"]
        update_finite = record.get("update_finite", True)
        if not math.isfinite(loss) or not update_finite:
            # the saves in flight hold states before this step, whose losses were finite: they
            # commit before the rank says it is leaving, so the restart resumes from the newest
            # (the drain deadline bounds the wait under msjax.launch)
            self.heartbeat.beat("drain", step)
            with contextlib.suppress(Exception):  # a failed save: the loss is what is reported
                self.wait_for_saves()
            self.heartbeat.beat("nonfinite", step)  # step: the index whose loss was bad
            raise NonFiniteLoss(step, loss, update_finite)
        mark_startup("first_step_done")
        self.heartbeat.beat("step", step + 1)

    def eval_begin(self, step: int) -> None:
        self.heartbeat.beat("eval")

    def save_begin(self, step: int) -> None:
        self.heartbeat.beat("checkpoint", step)
        self.faults.before_save(step, self.hold_save_write)

    def save_end(self, step: int, blocked_s: float | None) -> None:
        if blocked_s is not None:
            self.faults.after_save_started(step)

    def saves_draining(self) -> None:
        self.heartbeat.beat("drain")

    def run_end(self, final_step: int) -> None:
        self.heartbeat.beat("done", final_step)
        self.heartbeat.close()
