"""`python -m msjax.train`: wires config, mesh, data, model and the compiled step; owns the loop.

The loop is the only place with state that is not an array: the data iterator, the metrics file
and the progress line. Metrics of step s are read after step s+1 is dispatched, so the host
never stalls the devices to log.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from msjax.config import Config, check_device_count, load_config, save_config
from msjax.errors import MsjaxError


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
        print(f"msjax.train: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("msjax.train: interrupted", file=sys.stderr)
        return 130
    return 0


def default_run_dir(config: Config) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{config.run.name}-{stamp}"


def choose_run_dir(config: Config) -> Path:
    """The run directory to use; refuses one that already holds a run. Creates nothing."""
    run_dir = Path(config.run.dir) if config.run.dir else default_run_dir(config)
    if (run_dir / "metrics.jsonl").exists():
        raise MsjaxError(
            f"run.dir={run_dir} already holds a run (metrics.jsonl); choose another run.dir"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise MsjaxError(f"run.dir={run_dir} exists and is not a directory")
    return run_dir


def train(config: Config, progress_stream: Any = None) -> TrainResult:
    """Train as configured; every check that can fail runs before anything is written."""
    import jax

    from msjax.data.pipeline import TokenBatches, eval_batches, sharded_batches
    from msjax.data.stdlib_corpus import load_corpus
    from msjax.data.tokenizer import ByteTokenizer
    from msjax.observe.flops import flops_per_step, mfu, peak_tflops_per_device
    from msjax.observe.metrics import MetricsWriter, ProgressLine
    from msjax.parallel.mesh import build_mesh, configure_cpu_devices
    from msjax.step import build_program

    started = time.perf_counter()
    run_dir = choose_run_dir(config)
    configure_cpu_devices(config)
    config = check_device_count(config, jax.device_count())
    mesh = build_mesh(config.mesh)
    corpus = load_corpus(config.data)
    train_batches = TokenBatches(
        corpus.train_tokens, config.data.seq_len, config.train.global_batch, config.run.seed
    )
    validation = (
        eval_batches(
            corpus.eval_tokens,
            config.data.seq_len,
            config.train.global_batch,
            config.train.eval_batches,
        )
        if config.train.eval_every
        else []
    )
    tokenizer_vocab = ByteTokenizer.vocab_size
    if config.model.vocab_size < tokenizer_vocab:
        raise MsjaxError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the byte tokenizer's "
            f"{tokenizer_vocab} tokens"
        )
    peak_tflops = peak_tflops_per_device(jax.devices()[0], config.train.peak_tflops)
    step_flops = flops_per_step(config)
    tokens_per_step = config.train.global_batch * config.data.seq_len

    is_writer = jax.process_index() == 0
    if is_writer:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, run_dir)
    progress = ProgressLine(config.train.steps, stream=progress_stream)
    shape = " x ".join(f"{axis} {size}" for axis, size in mesh.shape.items())
    progress.message(
        f"msjax: {config.run.name} on {jax.device_count()} {jax.devices()[0].platform} devices "
        f"({shape}); run dir {run_dir}"
    )

    program = build_program(config, mesh)
    state = program.init_state()
    compile_started = time.perf_counter()
    abstract_batch = {
        key: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=program.batch_sharding)
        for key, value in train_batches.global_batch_at(0).items()
    }
    train_step = program.train_step.lower(program.abstract_state(), abstract_batch).compile()
    progress.message(f"compiled the train step in {time.perf_counter() - compile_started:.1f} s")
    validation = [jax.device_put(batch, program.batch_sharding) for batch in validation]

    def evaluate(step: int) -> float:
        nonlocal last_done
        losses = [program.eval_step(state.params, batch) for batch in validation]
        eval_loss = float(sum(jax.device_get(losses)) / len(losses))
        if is_writer:
            metrics.write({"step": step, "eval_loss": eval_loss})
        progress.message(f"step {step + 1}: eval loss {eval_loss:.4f}")
        last_done = time.perf_counter()  # evaluation time is not the next step's time
        return eval_loss

    metrics = MetricsWriter(run_dir / "metrics.jsonl") if is_writer else None
    last_record: dict[str, Any] = {}
    eval_loss = None
    pending = None  # (step, device metrics, data_wait_s) of the step in flight
    last_done = time.perf_counter()

    def finish(step: int, device_metrics: Any, data_wait_s: float) -> None:
        nonlocal last_done, last_record
        values = jax.device_get(device_metrics)
        done = time.perf_counter()
        step_time_s = done - last_done
        last_done = done
        record = {
            "step": step,
            "loss": float(values["loss"]),
            "grad_norm": float(values["grad_norm"]),
            "lr": float(values["lr"]),
            "step_time_s": step_time_s,
            "tokens_per_s": tokens_per_step / step_time_s,
            "mfu": mfu(step_flops, step_time_s, jax.device_count(), peak_tflops),
            "data_wait_s": data_wait_s,
        }
        if is_writer:
            metrics.write(record)
        progress.update(record)
        last_record = record

    with sharded_batches(
        train_batches, program.batch_sharding, 0, config.data.prefetch_batches
    ) as batches:
        for step in range(config.train.steps):
            batch, data_wait_s = next(batches)
            state, device_metrics = train_step(state, batch)
            if pending is not None:
                finish(*pending)
            pending = (step, device_metrics, data_wait_s)
            every = config.train.eval_every
            if every and (step + 1) % every == 0 and step + 1 < config.train.steps:
                finish(*pending)
                pending = None
                eval_loss = evaluate(step)
        if pending is not None:
            finish(*pending)
    if config.train.eval_every:
        eval_loss = evaluate(config.train.steps - 1)
    wall_s = time.perf_counter() - started
    if metrics is not None:
        metrics.close()
    progress.message(
        f"done: {config.train.steps} steps in {wall_s:.0f} s; loss {last_record['loss']:.4f}"
        + (f", eval loss {eval_loss:.4f}" if eval_loss is not None else "")
    )
    progress.message(f"outputs in {run_dir}: config.yaml, metrics.jsonl")
    progress.close()
    return TrainResult(run_dir, config.train.steps, last_record["loss"], eval_loss, wall_s)


if __name__ == "__main__":
    raise SystemExit(main())
