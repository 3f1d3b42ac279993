"""Can the data pipeline keep up? Tokens/s it delivers against tokens/s the train step consumes.

1. `configs/small.yaml` on one CPU device, in this process: the pipeline (Grain, packing,
   placement on the device) delivers batches as fast as it can, with 0 and with --workers Grain
   worker processes; the compiled train step then consumes batches already on the device. Prints
   both rates and their ratio (the pipeline's headroom; it must stay above 1).
2. A default training run (`python -m msjax.train`, the tiny config on 8 simulated devices, in a
   subprocess): the share of step time spent waiting for data, from its metrics.jsonl
   (target < 1%).

    python benchmarks/data_throughput.py [--global-batch 4] [--batches 40] [--train-steps 100]
    python benchmarks/data_throughput.py --smoke   # a tiny model, a few batches and steps
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["JAX_NUM_CPU_DEVICES"] = "1"
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402

from benchmarks.smoke import SMOKE_LABEL, TINY_CORPUS, TINY_MODEL, TINY_SEQ_LEN  # noqa: E402
from msjax.config import load_config  # noqa: E402
from msjax.data.dataset import build_training_data  # noqa: E402
from msjax.data.pipeline import sharded_batches  # noqa: E402
from msjax.observe.metrics import read_metrics  # noqa: E402
from msjax.parallel.mesh import build_mesh  # noqa: E402
from msjax.resolve import resolve  # noqa: E402
from msjax.step import build_program  # noqa: E402

WARMUP = 2  # batches or steps left out of each measurement (worker start-up, first dispatch)


def pipeline_tokens_per_s(data, program, batches: int, workers: int) -> float:
    """Batches pulled one after another, each placed on the device and waited for."""
    tokens_per_batch = data.train.global_batch * data.train.seq_len
    with sharded_batches(data.train, program.batch_sharding, 0, 0, workers) as iterator:
        for _ in range(WARMUP):
            jax.block_until_ready(next(iterator)[0])
        started = time.perf_counter()
        for _ in range(batches):
            jax.block_until_ready(next(iterator)[0])
        elapsed = time.perf_counter() - started
    return batches * tokens_per_batch / elapsed


def step_tokens_per_s(data, program, steps: int) -> float:
    """The compiled step alone, on batches already on the device."""
    staged = [
        jax.device_put(data.train.global_batch_at(step), program.batch_sharding)
        for step in range(steps + WARMUP)
    ]
    state = program.init_state()
    step_fn = program.train_step.lower(state, staged[0]).compile()
    for batch in staged[:WARMUP]:
        state, metrics = step_fn(state, batch)
    jax.block_until_ready(metrics)
    started = time.perf_counter()
    for batch in staged[WARMUP:]:
        state, metrics = step_fn(state, batch)
    jax.block_until_ready((state, metrics))
    return steps * data.train.global_batch * data.train.seq_len / (time.perf_counter() - started)


def default_run_wait_share(steps: int, overrides: list[str]) -> tuple[float, float, int]:
    """(data wait share, mean step time s, steps measured) of `python -m msjax.train`."""
    with tempfile.TemporaryDirectory() as run_root:
        run_dir = Path(run_root) / "run"
        env = {key: value for key, value in os.environ.items() if key != "JAX_NUM_CPU_DEVICES"}
        subprocess.run(
            [
                sys.executable,
                "-m",
                "msjax.train",
                f"train.steps={steps}",
                f"run.dir={run_dir}",
                *overrides,
            ],
            cwd=REPO,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r][WARMUP:]
    wait_s = sum(record["data_wait_s"] for record in records)
    step_s = sum(record["step_time_s"] for record in records)
    return wait_s / step_s, step_s / len(records), len(records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--batches", type=int, default=40, help="batches timed per pipeline")
    parser.add_argument("--steps", type=int, default=4, help="train steps timed")
    parser.add_argument("--workers", type=int, default=2, help="Grain workers of the 2nd pipeline")
    parser.add_argument("--train-steps", type=int, default=100, help="default run length")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, a few batches")
    args = parser.parse_args()
    overrides = [f"train.global_batch={args.global_batch}", "train.eval_every=0"]
    default_run = []
    if args.smoke:
        args.batches, args.steps, args.train_steps = 4, 2, 2 + WARMUP
        overrides += [*TINY_MODEL, *TINY_CORPUS, f"data.seq_len={TINY_SEQ_LEN}"]
        default_run = [*TINY_CORPUS, "checkpoint.enabled=false"]
    config = load_config(REPO / "configs" / "small.yaml", overrides)
    config = resolve(config, jax.device_count(), jax.default_backend())
    data = build_training_data(config, print)
    program = build_program(config, build_mesh(config.mesh))
    print(
        f"configs/small.yaml{SMOKE_LABEL if args.smoke else ''} on 1 "
        f"{jax.devices()[0].platform} device, "
        f"batch {config.train.global_batch} x seq {config.data.seq_len}"
    )
    delivered = {
        workers: pipeline_tokens_per_s(data, program, args.batches, workers)
        for workers in (0, args.workers)
    }
    consumed = step_tokens_per_s(data, program, args.steps)
    for workers, rate in delivered.items():
        print(f"{f'pipeline, {workers} Grain workers':<40} {rate:14,.0f} tokens/s")
    print(f"{'train step (batches on device)':<40} {consumed:14,.0f} tokens/s")
    best = max(delivered.values())
    print(f"{'headroom (pipeline / step)':<40} {best / consumed:14,.1f} x   (must stay > 1)")

    share, step_s, measured = default_run_wait_share(args.train_steps, default_run)
    print(
        f"default run (tiny, {measured} steps of {step_s * 1e3:.0f} ms): "
        f"{100 * share:.3f}% of step time waiting for data   (target < 1%)"
    )


if __name__ == "__main__":
    main()
