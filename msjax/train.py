"""`python -m msjax.train`: prepare a run (msjax.training.prepare), then the loop below.

The loop is the only place with state that is not an array. What happens around a step
(metrics, progress, heartbeats, rank timing, flight recorder, checkpoints, evaluation) reaches
its listeners through one events interface (msjax.loop_events); what follows each step is
decided in one place (msjax.training.decisions).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from msjax.allocator import reexec_with_allocator
from msjax.cli import ArgumentParser, user_error
from msjax.config import Config, load_config
from msjax.data.sources import check_sources
from msjax.errors import MsjaxError
from msjax.resilience import exit_codes
from msjax.resilience.crash_records import record_crash
from msjax.resilience.fault_kinds import kind_of_error
from msjax.resilience.heartbeat import mark_startup
from msjax.resilience.job_end import in_job, leave_job_now, peer_exit_code
from msjax.resilience.worker import dump_stacks_from_start
from msjax.training.decisions import (
    forget_stop_signals_from_start,
    remember_stop_signals_from_start,
)

if TYPE_CHECKING:
    from msjax.loop_events import LoopEvents
    from msjax.resilience.replica_guard import Replay
    from msjax.training.decisions import Decider
    from msjax.training.prepare import PreparedRun
    from msjax.training.replica_checks import ReplicaChecks


@dataclass(frozen=True)
class TrainResult:
    """Where a finished run put its outputs, and its last losses."""

    run_dir: Path
    steps: int
    final_loss: float
    final_eval_loss: float | None
    wall_s: float


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="python -m msjax.train",
        description="Train a decoder-only language model on a device mesh.",
        epilog="example: python -m msjax.train --config configs/small.yaml train.steps=100",
    )
    parser.add_argument("--config", type=Path, help="YAML config (default: the built-in tiny)")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the config as loaded (before it is resolved for the devices) and exit",
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    mark_startup("main")
    config: Config | None = None
    try:
        args = parse_args(argv)
        config = load_config(args.config, args.overrides)
        if args.print_config:
            print(config.to_yaml(), end="")
            return 0
        # SIGUSR1 dumps stacks from here on: joining the job and preparing data may hang; a
        # SIGTERM while starting up is kept for the loop (a save after its first step)
        dump_stacks_from_start(config.run.dir)
        remember_stop_signals_from_start()
        # data that is not there fails before JAX starts; so does a run dir it cannot use, in
        # its one planner (msjax.training.prepare.plan_run)
        check_sources(config.data)
        train(config)
    except (Exception, KeyboardInterrupt) as error:
        kind = kind_of_error(error)
        if kind is not None:  # one line, and the kind's exit code (msjax.resilience.fault_kinds)
            assert kind.exit_code is not None
            print(f"msjax.train: {kind.line(error)}", file=sys.stderr)
            leave_job_now(kind.exit_code, kind.reason(error))  # peers may still be mid-step
            return kind.exit_code
        if not in_job():
            _record_crash(config, error)
            raise
        # a peer that left first explains a failed collective here: its exit code is the job's
        code = peer_exit_code(wait_s=2.0)
        if code is None:
            _record_crash(config, error)
            traceback.print_exc()
            leave_job_now(exit_codes.CRASHED, "crashed (its log has the traceback)")
        print(f"msjax.train: stopping: a peer ended the job with exit code {code}", file=sys.stderr)
        leave_job_now(code)
        raise
    finally:
        forget_stop_signals_from_start()  # main called by a process that goes on (a test)
    return 0


def _record_crash(config: Config | None, error: BaseException) -> None:
    """This process's own unexpected error, for the supervisor to tell the program's fault from
    a machine's (msjax.resilience.crash_records); nothing before the run dir is known."""
    if config is not None and config.run.dir:
        record_crash(Path(config.run.dir), error)


def train(
    config: Config,
    progress_stream: IO[str] | None = None,
    listeners: Sequence[LoopEvents] = (),
) -> TrainResult:
    """Train as configured, resuming the run in run.dir if there is one.

    listeners: more `LoopEvents` to tell what happens around each step, after msjax's own.
    """
    from msjax.training.decisions import Decider, StopSignal
    from msjax.training.prepare import prepare_run
    from msjax.training.replica_checks import ReplicaChecks

    run = prepare_run(config, progress_stream, listeners)
    # the stop signal's handler stays installed through end_run: a SIGTERM during the final
    # save only repeats the request to stop (msjax.training.decisions)
    grace_s = run.config.resilience.checkpoint_deadline_s
    with run.events, StopSignal(grace_s) as stop:
        decide = Decider(run.config, stop, bool(run.steps.validation), run.saves)
        checks = ReplicaChecks(run)
        run.events.listen(checks)  # its programs compile once the first step's results are in
        mark_startup("replica_checks_ready")
        segment = Segment(run.start.state, run.start.step, run.start.first_sample)
        eval_loss = None
        while True:
            ended = train_segment(run, decide, checks, segment)
            eval_loss = ended.eval_loss if ended.eval_loss is not None else eval_loss
            if ended.replay is None:
                break
            replay, ended = ended.replay, None  # the diverged state is dropped before restoring
            segment = replay_start(run, replay)  # a replica mismatch: replay its window
        return end_run(run, ended.state, ended.stopped_by, eval_loss)


@dataclass(frozen=True)
class Segment:
    """Where the loop (re)starts: the state, its step, and the data position of that step."""

    state: Any
    step: int
    first_sample: int


@dataclass
class SegmentEnd:
    """How a run of steps ended: at the last step, stopped by a signal, or for a replay."""

    state: Any
    stopped_by: str | None = None
    eval_loss: float | None = None
    replay: Replay | None = None


def train_segment(
    run: PreparedRun, decide: Decider, checks: ReplicaChecks, segment: Segment
) -> SegmentEnd:
    """The steps from segment.step on, until the last one, a stop, or a replica check that
    asks for a replay."""
    from msjax.training.reporting import InFlight

    events, results, steps, state = run.events, run.results, run.steps, segment.state
    in_flight = None  # the dispatched step whose metrics are not read yet
    ended = SegmentEnd(state)
    with training_batches(run, segment) as batches:
        mark_startup("batches_started")
        for step in range(segment.step, run.config.train.steps):
            events.step_begin(step)
            if steps.skips(step):
                next(batches)  # drawn and dropped, so later steps keep their own batches
                state = steps.skip(state)
                results.finish(in_flight)
                in_flight = None
                events.step_skipped(step)
            else:
                batch, data_wait_s = next(batches)
                events.batch_ready(step, data_wait_s)
                state, device_metrics = steps.train(step, state, batch)
                events.step_dispatched(step)
                results.finish(in_flight)
                in_flight = InFlight(step, device_metrics, data_wait_s)
            ended.state = state
            decision = decide.after_step(step + 1)
            if decision.needs_result or checks.due(step + 1, decision):
                results.finish(in_flight)
                in_flight = None
            if checks.due(step + 1, decision):
                # before the state is saved; its time counts in the next step's (an overhead)
                ended.replay = checks.check(step + 1, state)
                if ended.replay is not None:
                    return ended
            if decision.evaluate:
                ended.eval_loss = evaluate(run, state, step)
            if run.saves.after_step(decision, state):  # saves, or ends a run whose saves fail
                results.restart_clock()  # the save's pause is reported on its own
            if decision.stop_by:
                ended.stopped_by = decision.stop_by
                break
        results.finish(in_flight)
    return ended


def training_batches(run: PreparedRun, segment: Segment) -> AbstractContextManager[Any]:
    """The training batches from segment.step on, prefetched onto the devices, starting at that
    step's data position (segment.first_sample: a replay's checkpoint records it)."""
    from msjax.data.pipeline import sharded_batches

    return sharded_batches(
        run.data.train,
        run.program.batch_sharding,
        segment.step,
        run.config.data.prefetch_batches,
        run.config.data.num_workers,
        segment.first_sample,
    )


def evaluate(run: PreparedRun, state: Any, step: int) -> float:
    """The mean loss over the validation batches, after `step`."""
    run.events.eval_begin(step)
    loss = run.steps.eval_loss(state.params)
    run.events.eval_end(step, loss)
    run.results.restart_clock()  # evaluation time is not the next step's time
    return loss


def replay_start(run: PreparedRun, replay: Replay) -> Segment:
    """The state to replay from: the newest checkpoint at or before replay.at_most whose
    replicas agreed (a fresh state where the run began from step 0 and saved none before)."""
    import jax

    from msjax.resilience.replica_guard import SilentCorruption
    from msjax.training.checkpoints import init_from_hf

    message = run.progress.message
    run.resilience.beat("restore")
    checkpointer = run.saves.checkpointer
    checkpointer.wait()  # the saves in flight are on disk: the newest one may be the one
    restored = checkpointer.restore_newest_valid(
        run.abstract_state, message, at_most=replay.at_most
    )
    if restored is not None:
        state = run.program.from_canonical(restored.state)
        step = int(jax.device_get(state.step))
        samples_seen = restored.meta.get("data", {}).get("samples_seen")
        first_sample = (
            step * run.config.train.global_batch if samples_seen is None else samples_seen
        )
        where = f"checkpoint {restored.path}"
    elif run.start.restored is None and run.start.step == 0:
        state = (
            init_from_hf(run.config, run.program, message)
            if run.config.model.init_from
            else (run.program.init_state())
        )
        step, first_sample, where = 0, 0, "the initial state"
    else:
        raise SilentCorruption(
            f"the replicas differ after step {replay.until}, and no checkpoint at or before "
            f"step {replay.at_most} is left to replay from",
            (),
        )
    message(
        f"replica mismatch: replaying steps {step}..{replay.until} from {where}, checking the "
        "replicas after every step"
    )
    return Segment(state, step, int(first_sample))


def end_run(
    run: PreparedRun, state: Any, stopped_by: str | None, eval_loss: float | None
) -> TrainResult:
    """The last save and evaluation, the closing lines, and what the run left behind."""
    import jax

    final_step = int(jax.device_get(state.step))
    run.saves.finish(state, final_step)
    message = run.progress.message
    if stopped_by is not None:
        message(
            f"stopped by {stopped_by} after step {final_step}; checkpoint in "
            f"{run.saves.directory / str(final_step)}; rerun the same command to resume"
        )
    elif run.config.train.eval_every and final_step > run.start.step and run.steps.validation:
        eval_loss = evaluate(run, state, final_step - 1)
    wall_s = time.perf_counter() - run.started
    last = run.results.last
    if last:
        message(
            f"done: steps {run.start.step}-{final_step} in {wall_s:.0f} s; loss {last['loss']:.4f}"
            + (f", eval loss {eval_loss:.4f}" if eval_loss is not None else "")
        )
    else:
        message(f"nothing to do: the run is already at step {final_step}")
    run_dir = run.run_dir
    outputs = [run_dir.config_yaml.name, run_dir.data_facts.name, run_dir.metrics.name]
    if run.config.checkpoint.enabled:
        outputs.append(run_dir.checkpoints.name + "/")
    message(f"outputs in {run_dir.path}: {', '.join(outputs)}")
    run.progress.close()
    run.events.run_end(final_step)
    return TrainResult(
        run.run_dir.path, final_step, last.get("loss", float("nan")), eval_loss, wall_s
    )


if __name__ == "__main__":
    try:
        reexec_with_allocator()  # malloc reads its settings at start (msjax.allocator)
    except MsjaxError as error:
        raise SystemExit(user_error("msjax.train", error)) from None
    raise SystemExit(main())
