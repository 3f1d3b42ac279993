"""What the in-training known-answer check costs: msjax.train with one check of every device's
matmul every 100 steps (resilience.compute_check_every, the default) vs none.

Both loops run `configs/small.yaml` (smaller batch) with data 2 over 2 CPU devices in this
process, replica checks, checkpoints and evaluation off, alternating for --rounds rounds, each
keeping its best round. The step time comes from each run's metrics.jsonl, where a check's time
lands in the step after it. Because that is noise on a shared machine, one check is also timed on
its own and amortized over the period.

    python benchmarks/compute_check.py [--steps 300] [--every 100] [--rounds 2] [--tiny]
    python benchmarks/compute_check.py --smoke   # a tiny model, 8 steps, a check every 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["JAX_NUM_CPU_DEVICES"] = "2"
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.smoke import SMOKE_LABEL, TINY_CORPUS, TINY_MODEL, TINY_SEQ_LEN  # noqa: E402
from benchmarks.train_timing import mean_step_s as train_mean_step_s  # noqa: E402
from msjax.config import load_config  # noqa: E402
from msjax.parallel.mesh import build_mesh  # noqa: E402
from msjax.resilience.compute_checks import ComputeCheck  # noqa: E402
from msjax.resolve import resolve  # noqa: E402

WARMUP_STEPS = 2  # steps left out of both measurements (first dispatches, caches)
CHECK_TIMINGS = 5  # one check timed this often on its own; the median counts


def mean_step_s(overrides: list[str], every: int) -> float:
    """msjax.train's mean step time, from its own metrics.jsonl, with checks every `every`."""
    checks = [f"resilience.compute_check_every={every}"]
    return train_mean_step_s(REPO / "configs" / "small.yaml", [*overrides, *checks], WARMUP_STEPS)


def one_check_s(overrides: list[str]) -> float:
    """Seconds of one known-answer check of every device, gathered and read on the host."""
    config = resolve(load_config(REPO / "configs" / "small.yaml", overrides), 2, "cpu")
    check = ComputeCheck(build_mesh(config.mesh))
    check.failing_ranks()  # warm
    timings = []
    for _ in range(CHECK_TIMINGS):
        started = time.perf_counter()
        check.failing_ranks()
        timings.append(time.perf_counter() - started)
    return float(np.median(timings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="the smoke form's tiny model")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 8 steps, 1 round")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.every, args.seq_len, args.rounds = 8, 4, TINY_SEQ_LEN, 1
    tiny = args.smoke or args.tiny
    if tiny:
        args.seq_len = min(args.seq_len, TINY_SEQ_LEN)
    overrides = [
        f"train.steps={args.steps}",
        f"train.global_batch={args.global_batch}",
        f"data.seq_len={args.seq_len}",
        "train.eval_every=0",
        "checkpoint.enabled=false",
        "resilience.replica_check_every=0",
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        *(TINY_MODEL + TINY_CORPUS if tiny else []),
    ]
    label = SMOKE_LABEL if args.smoke else " (tiny model)" if tiny else ""
    print(
        f"configs/small.yaml{label} on 2 {jax.devices()[0].platform} devices (data 2), batch "
        f"{args.global_batch} x seq {args.seq_len}, {args.steps} steps ({WARMUP_STEPS} left "
        f"out), a known-answer check every {args.every} steps"
    )
    with tempfile.TemporaryDirectory(prefix="msjax-compute-check-cache-") as cache_dir:
        run_overrides = [*overrides, f"resilience.compile_cache_dir={cache_dir}"]
        bare_rounds, checked_rounds = [], []
        for round_index in range(args.rounds):
            bare_rounds.append(mean_step_s(run_overrides, 0))
            checked_rounds.append(mean_step_s(run_overrides, args.every))
            print(
                f"  round {round_index + 1}: no check {bare_rounds[-1] * 1e3:.2f} ms, "
                f"checked {checked_rounds[-1] * 1e3:.2f} ms per step"
            )
        check_s = one_check_s(run_overrides)  # while its compile cache is still there
    bare, checked = min(bare_rounds), min(checked_rounds)
    print(f"{'step time, no check':<40} {bare * 1e3:10.2f} ms")
    print(f"{f'step time, a check every {args.every} steps':<40} {checked * 1e3:10.2f} ms")
    print(f"{'ratio (check / no check)':<40} {checked / bare:10.3f}   (goal <= 1.01)")
    print(
        f"{'one check on its own':<40} {check_s * 1e3:10.2f} ms   (amortized: "
        f"{1 + check_s / (args.every * bare):.4f} x the step time)"
    )


if __name__ == "__main__":
    main()
