"""What the training loop costs on top of the compiled step: msjax.train vs a bare loop.

Both run `configs/small.yaml` (smaller batch) on one CPU device in this process. The baseline
calls the same compiled train step on batches already on the device and syncs once at the end;
msjax.train also fetches batches from Grain, logs every step's metrics and updates its progress
line. Prints tokens/s of both, their ratio (target >= 0.97) and CPU MFU against the measured
matmul peak.

    python benchmarks/step_overhead.py [--steps 12] [--global-batch 1] [--seq-len 256] [--rounds 2]
    python benchmarks/step_overhead.py --smoke   # a tiny model, 4 steps, 1 round: seconds

The two loops alternate for --rounds rounds and each keeps its best round, so a burst of load
from elsewhere on a shared machine does not decide the ratio.
"""

from __future__ import annotations

import argparse
import os
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
from msjax.observe.flops import flops_per_step, measure_cpu_peak_tflops  # noqa: E402
from msjax.observe.metrics import read_metrics  # noqa: E402
from msjax.parallel.mesh import build_mesh  # noqa: E402
from msjax.resolve import resolve  # noqa: E402
from msjax.step import build_program  # noqa: E402
from msjax.train import train  # noqa: E402

WARMUP_STEPS = 2  # steps left out of both measurements (first dispatches, caches)


def bare_loop_tokens_per_s(config, steps: int) -> float:
    """The compiled step alone: batches staged on the device beforehand, one sync at the end."""
    mesh = build_mesh(config.mesh)
    program = build_program(config, mesh)
    state = program.init_state()
    source = build_training_data(config, print).train
    batches = [
        jax.device_put(source.global_batch_at(step), program.batch_sharding)
        for step in range(steps)
    ]
    step_fn = program.train_step.lower(state, batches[0]).compile()
    for batch in batches[:WARMUP_STEPS]:
        state, metrics = step_fn(state, batch)
    jax.block_until_ready(metrics)
    started = time.perf_counter()
    for batch in batches[WARMUP_STEPS:]:
        state, metrics = step_fn(state, batch)
    jax.block_until_ready((state, metrics))
    elapsed = time.perf_counter() - started
    tokens = (steps - WARMUP_STEPS) * config.train.global_batch * config.data.seq_len
    return tokens / elapsed


def train_loop_tokens_per_s(config, steps: int) -> float:
    """msjax.train as a user runs it, measured from its own metrics.jsonl."""
    with tempfile.TemporaryDirectory() as run_root:
        run_dir = Path(run_root) / "run"
        overrides = [f"run.dir={run_dir}"]
        run_config = load_config(REPO / "configs" / "small.yaml", [*config_overrides, *overrides])
        with open(os.devnull, "w") as quiet:
            train(run_config, progress_stream=quiet)
        records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    measured = records[WARMUP_STEPS:]
    elapsed = sum(record["step_time_s"] for record in measured)
    return len(measured) * config.train.global_batch * config.data.seq_len / elapsed


def main() -> None:
    global config_overrides
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--global-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 4 steps, 1 round")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.seq_len, args.rounds = 4, TINY_SEQ_LEN, 1
    config_overrides = [
        f"train.steps={args.steps}",
        f"train.global_batch={args.global_batch}",
        f"data.seq_len={args.seq_len}",
        "train.eval_every=0",
        "mesh.data=-1",
        *(TINY_MODEL + TINY_CORPUS if args.smoke else []),
    ]
    config = load_config(REPO / "configs" / "small.yaml", config_overrides)
    config = resolve(config, jax.device_count(), jax.default_backend())
    print(
        f"configs/small.yaml{SMOKE_LABEL if args.smoke else ''} on 1 "
        f"{jax.devices()[0].platform} device, "
        f"batch {args.global_batch} x seq {args.seq_len}, {args.steps} steps "
        f"({WARMUP_STEPS} left out)"
    )
    bare_rounds, full_rounds = [], []
    for round_index in range(args.rounds):
        bare_rounds.append(bare_loop_tokens_per_s(config, args.steps))
        full_rounds.append(train_loop_tokens_per_s(config, args.steps))
        print(
            f"  round {round_index + 1}: bare {bare_rounds[-1]:,.1f}, "
            f"train loop {full_rounds[-1]:,.1f} tokens/s"
        )
    bare, full = max(bare_rounds), max(full_rounds)
    peak_tflops = measure_cpu_peak_tflops()
    achieved_tflops = flops_per_step(config) * full / (args.global_batch * args.seq_len) / 1e12
    print(f"{'bare loop over the compiled step':<36} {bare:10,.1f} tokens/s")
    print(f"{'msjax.train loop':<36} {full:10,.1f} tokens/s")
    print(f"{'ratio (train loop / bare loop)':<36} {full / bare:10.3f}   (target >= 0.97)")
    print(
        f"{'CPU MFU of the train loop':<36} {100 * achieved_tflops / peak_tflops:10.1f} %   "
        f"({achieved_tflops * 1e3:.1f} of {peak_tflops * 1e3:.1f} GFLOP/s measured matmul peak)"
    )


config_overrides: list[str] = []

if __name__ == "__main__":
    main()
