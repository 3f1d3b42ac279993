"""`python -m msjax.train`: wires config, mesh, data, model and the compiled step; owns the loop.

The loop is the only place with state that is not an array: the data iterator, the metrics file
and the progress line. Metrics of step s are read after step s+1 is dispatched, so the host
never stalls the devices to log.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msjax import __version__
from msjax.cli import user_error
from msjax.config import Config, config_from_dict, load_config
from msjax.errors import MsjaxError
from msjax.resilience import exit_codes
from msjax.resilience.worker import NonFiniteLoss, leave_job_now
from msjax.resolve import check_device_count, resolve_run_dir


@dataclass(frozen=True)
class TrainResult:
    """Where a finished run put its outputs, and its last losses."""

    run_dir: Path
    steps: int
    final_loss: float
    final_eval_loss: float | None
    wall_s: float


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m msjax.train",
        description="Train a decoder-only language model on a device mesh.",
        epilog="example: python -m msjax.train --config configs/small.yaml train.steps=100",
    )
    parser.add_argument("--config", type=Path, help="YAML config (default: the built-in tiny)")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        if args.print_config:
            print(config.to_yaml(), end="")
            return 0
        train(config)
    except MsjaxError as error:
        return user_error("msjax.train", error)
    except NonFiniteLoss as error:
        print(f"msjax.train: {error}", file=sys.stderr)
        leave_job_now(exit_codes.NONFINITE_LOSS)  # peers may still be mid-step
        return exit_codes.NONFINITE_LOSS
    except KeyboardInterrupt:
        print("msjax.train: interrupted", file=sys.stderr)
        return 130
    return 0


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


def train(config: Config, progress_stream: Any = None) -> TrainResult:
    """Train as configured, resuming the run in run.dir if there is one.

    Every check that can fail on user input runs before anything is written.
    """
    import jax
    import jax.numpy as jnp

    from msjax.batch import BATCH_FIELDS
    from msjax.checkpoint.manager import Checkpointer, checkpoint_dir, parse_resume_source
    from msjax.data.dataset import build_training_data
    from msjax.data.pipeline import sharded_batches
    from msjax.launch.distributed import JobEnv, initialize_distributed
    from msjax.observe.flops import flops_per_step, mfu, peak_tflops_per_device
    from msjax.observe.loop_observer import LoopObserver
    from msjax.observe.metrics import MetricsWriter, ProgressLine
    from msjax.ops.dispatch import ATTENTION_IMPLS, LOSS_IMPLS, NORM_IMPLS, resolve_impl
    from msjax.parallel.mesh import build_mesh, configure_cpu_devices, mesh_device_count
    from msjax.resilience.compile_cache import compile_cached, enable_compile_cache
    from msjax.resilience.worker import WorkerResilience, skip_update
    from msjax.run_dir import RunDir, create_run_dir, differences, plan_run_dir, save_config
    from msjax.step import build_program

    started = time.perf_counter()
    config = resolve_run_dir(config)
    plan = plan_run_dir(config)
    run_dir = plan.path
    resume_source = None
    if config.checkpoint.resume_from:
        resume_source = parse_resume_source(config.checkpoint.resume_from)
    configure_cpu_devices(mesh_device_count(config.mesh))
    job = JobEnv.read()
    initialize_distributed(job)  # a multi-process job: before anything asks JAX for devices
    compile_cache = enable_compile_cache(config.resilience, run_dir, job.launched)
    config = check_device_count(config, jax.device_count())
    resolve_impl(config.model.attention_impl, "model.attention_impl", ATTENTION_IMPLS)
    resolve_impl(config.model.norm_impl, "model.norm_impl", NORM_IMPLS)
    resolve_impl(config.model.loss_impl, "model.loss_impl", LOSS_IMPLS)
    mesh = build_mesh(config.mesh)
    progress = ProgressLine(config.train.steps, stream=progress_stream)
    data = build_training_data(config, progress.message)
    train_batches, validation = data.train, data.validation
    peak_tflops = peak_tflops_per_device(jax.devices()[0], config.train.peak_tflops)
    step_flops = flops_per_step(config)
    tokens_per_step = config.train.global_batch * config.data.seq_len

    is_writer = jax.process_index() == 0
    if is_writer:
        aside = create_run_dir(plan)
        if aside is not None:
            progress.message(f"run.overwrite=true: the earlier run in {run_dir} moved to {aside}")
        save_config(config, RunDir(run_dir))
        (run_dir / "data.json").write_text(json.dumps(data.facts(), indent=2) + "\n")
    resilience = WorkerResilience(config, run_dir, jax.process_index(), job.attempt)
    shape = " x ".join(f"{axis} {size}" for axis, size in mesh.shape.items())
    progress.message(
        f"msjax: {config.run.name} on {jax.device_count()} {jax.devices()[0].platform} devices "
        f"({shape}); run dir {run_dir}"
    )

    program = build_program(config, mesh)
    abstract_state = program.abstract_state()
    checkpointer = Checkpointer(checkpoint_dir(run_dir), config.checkpoint)
    state = None
    if resume_source is not None:
        source_dir, source_step = resume_source
        source = Checkpointer(source_dir, config.checkpoint, read_only=True)
        restored = source.restore_newest_valid(abstract_state, progress.message, source_step)
        if restored is None:
            raise MsjaxError(f"checkpoint.resume_from: no valid checkpoint in {source_dir}")
    else:
        restored = checkpointer.restore_newest_valid(abstract_state, progress.message)
    if restored is not None:
        saved = config_from_dict(restored.meta["config"])
        if saved.model != config.model:
            changed = [line for line in differences(saved, config) if line.startswith("model.")]
            raise MsjaxError(
                f"checkpoint {restored.path} holds another model ({'; '.join(changed)}); "
                "resume with the model config it was saved with"
            )
        state = restored.state
        progress.message(f"resumed from {restored.path} (step {restored.step})")
    else:
        state = program.init_state()
    start_step = int(jax.device_get(state.step))
    # The data position is a global sample position, independent of processes and workers.
    first_sample = start_step * config.train.global_batch
    if restored is not None:
        first_sample = int(restored.meta.get("data", {}).get("samples_seen", first_sample))
    remaining_steps = max(config.train.steps - start_step, 0)
    samples_at_end = first_sample + remaining_steps * config.train.global_batch
    describe_data(data, config, samples_at_end, progress.message)
    progress.start_step = start_step
    progress.started = time.perf_counter()

    resilience.starting(start_step)
    if config.checkpoint.enabled:
        checkpointer.prepare(abstract_state)
    compile_started = time.perf_counter()
    batch_shape = (config.train.global_batch, config.data.seq_len)  # no process reads it all
    abstract_batch = {
        key: jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=program.batch_sharding)
        for key in BATCH_FIELDS
    }
    train_step = compile_cached(
        program.train_step.lower(abstract_state, abstract_batch), compile_cache, "train_step"
    )
    progress.message(f"compiled the train step in {time.perf_counter() - compile_started:.1f} s")
    observer = LoopObserver(config, run_dir, mesh, job.attempt, progress.message)
    observer.compiled(train_step)
    validation = [jax.device_put(batch, program.batch_sharding) for batch in validation]
    metrics = MetricsWriter(run_dir / "metrics.jsonl") if is_writer else None
    if restored is not None and metrics is not None:
        metrics.write({"step": start_step, "event": "resume", "checkpoint": str(restored.path)})

    last_record: dict[str, Any] = {}
    eval_loss = None
    last_done = time.perf_counter()

    def evaluate(step: int) -> float:
        nonlocal last_done
        observer.record("eval_begin", step)
        resilience.beat("eval")
        losses = [program.eval_step(state.params, batch) for batch in validation]
        loss = float(sum(jax.device_get(losses)) / len(losses))
        if metrics is not None:
            metrics.write({"step": step, "eval_loss": loss})
        progress.message(f"step {step + 1}: eval loss {loss:.4f}")
        observer.record("eval_end", step)
        last_done = time.perf_counter()  # evaluation time is not the next step's time
        return loss

    def finish(step: int, device_metrics: Any, data_wait_s: float) -> None:
        nonlocal last_done, last_record
        fetch_started = time.perf_counter()
        values = jax.device_get(device_metrics)
        done = time.perf_counter()
        observer.result_fetched(step, done - fetch_started)
        step_time_s = done - last_done
        last_done = done
        record = {
            "step": step,
            "loss": resilience.loss(step, float(values["loss"])),
            "grad_norm": float(values["grad_norm"]),
            "lr": float(values["lr"]),
            "step_time_s": step_time_s,
            "tokens_per_s": tokens_per_step / step_time_s,
            "mfu": mfu(step_flops, step_time_s, jax.device_count(), peak_tflops),
            "data_wait_s": data_wait_s,
        }
        if metrics is not None:
            metrics.write(record)
        progress.update(record)
        last_record = record
        resilience.step_done(step, record["loss"])  # NonFiniteLoss before any save of it

    def save(step: int) -> None:
        """Start a checkpoint of `state` after `step` updates; failures per on_save_error."""
        nonlocal last_done
        meta = {
            "config": config.to_dict(),
            "data": {
                "next_step": step,
                "samples_seen": first_sample + (step - start_step) * config.train.global_batch,
            },
            "seed": config.run.seed,
            "msjax_version": __version__,
        }
        resilience.saving(step)
        observer.record("checkpoint_begin", step)
        try:
            checkpointer.save(step, state, meta)
            resilience.save_started(step)
        except Exception as error:
            report_save_error(step, error)
        else:
            if metrics is not None:
                blocked_s = checkpointer.save_blocked_s[-1]
                metrics.write({"step": step, "checkpoint_save_blocked_s": blocked_s})
        observer.record("checkpoint_end", step)
        last_done = time.perf_counter()  # the save's pause is reported on its own

    def report_save_error(step: int, error: Exception) -> None:
        message = (
            f"checkpoint save at step {step} failed ({type(error).__name__}: {error}); "
            "earlier checkpoints are untouched"
        )
        if config.checkpoint.on_save_error == "stop":
            raise MsjaxError(message + "; stopping (checkpoint.on_save_error=stop)") from None
        progress.message("warning: " + message + "; training continues")

    pending = None  # (step, device metrics, data_wait_s) of the step in flight
    stopped_by = None
    with (
        StopSignal() as stop,
        sharded_batches(
            train_batches,
            program.batch_sharding,
            start_step,
            config.data.prefetch_batches,
            config.data.num_workers,
            first_sample,
        ) as batches,
        observer,
    ):
        for step in range(start_step, config.train.steps):
            observer.step_begin(step)
            resilience.before_step(step, checkpointer.wait)
            if resilience.skips(step):
                next(batches)  # drawn and dropped, so later steps keep their own batches
                state = skip_update(state)
                if pending is not None:
                    finish(*pending)
                    pending = None
                if metrics is not None:
                    metrics.write({"step": step, "event": "skipped", "reason": "non-finite loss"})
                if checkpointer.due(step + 1) and step + 1 < config.train.steps:
                    save(step + 1)
                continue
            batch, data_wait_s = next(batches)
            observer.data_ready(data_wait_s)
            state, device_metrics = train_step(state, batch)
            observer.record("step_dispatched", step)
            if pending is not None:
                finish(*pending)
            pending = (step, device_metrics, data_wait_s)
            every = config.train.eval_every
            wants_eval = every and (step + 1) % every == 0 and step + 1 < config.train.steps
            if wants_eval or checkpointer.due(step + 1) or stop.received:
                finish(*pending)
                pending = None
            if wants_eval:
                eval_loss = evaluate(step)
            if stop.received:
                stopped_by = stop.received
                break
            if checkpointer.due(step + 1) and step + 1 < config.train.steps:
                save(step + 1)
        if pending is not None:
            finish(*pending)
    final_step = int(jax.device_get(state.step))
    saved_already = checkpointer.last_saved_step == final_step
    if config.checkpoint.enabled and final_step > start_step and not saved_already:
        save(final_step)
    resilience.beat("checkpoint")
    try:
        checkpointer.wait()
    except Exception as error:
        report_save_error(final_step, error)
    checkpointer.close()
    if stopped_by is not None:
        progress.message(
            f"stopped by {stopped_by} after step {final_step}; checkpoint in "
            f"{checkpoint_dir(run_dir) / str(final_step)}; rerun the same command to resume"
        )
    elif config.train.eval_every and final_step > start_step:
        eval_loss = evaluate(final_step - 1)
    wall_s = time.perf_counter() - started
    if metrics is not None:
        metrics.close()
    if last_record:
        progress.message(
            f"done: steps {start_step}-{final_step} in {wall_s:.0f} s; "
            f"loss {last_record['loss']:.4f}"
            + (f", eval loss {eval_loss:.4f}" if eval_loss is not None else "")
        )
    else:
        progress.message(f"nothing to do: the run is already at step {final_step}")
    outputs = "config.yaml, data.json, metrics.jsonl" + (
        ", checkpoints/" if config.checkpoint.enabled else ""
    )
    progress.message(f"outputs in {run_dir}: {outputs}")
    progress.close()
    resilience.close(final_step)
    observer.close(final_step)
    return TrainResult(
        run_dir, final_step, last_record.get("loss", float("nan")), eval_loss, wall_s
    )


def describe_data(data: Any, config: Config, samples_at_end: int, message: Any) -> None:
    """One line per source: what it holds and how much of it the run will have seen."""
    epochs = data.train.epochs_at(samples_at_end)
    for streams, packed, seen in zip(data.sources, data.train.sources, epochs, strict=True):
        message(
            f"data: {streams.label}: {packed.num_tokens:,} train tokens in "
            f"{packed.num_sequences:,} sequences; {seen:.2f} epochs by step {config.train.steps}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
