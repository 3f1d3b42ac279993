"""What the corruption guard costs: msjax.train with one replica check every 100 steps vs no guard.

Both loops run `configs/small.yaml` (smaller batch) with data 2 over 2 CPU devices in this process
(two data-parallel replicas to compare), without checkpoints or evaluation, and alternate for
--rounds rounds, each keeping its best round. The step time comes from each run's metrics.jsonl,
where a check's time lands in the step after it. Because the time is noise on a shared machine,
the work is counted too: one check timed on its own, and the bytes its all-gather moves (a few
integers per tensor per device) against the parameter bytes it reads where they lie.

    python benchmarks/corruption_guard.py [--steps 300] [--every 100] [--rounds 2] [--tiny]
    python benchmarks/corruption_guard.py --smoke   # a tiny model, 8 steps, a check every 4

--tiny takes the smoke form's model (its steps are short, so a check weighs the most). Every run
loads the train step compiled by the first (one compile cache for the process).
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
from msjax.observe.collectives import collective_ops, count_collectives  # noqa: E402
from msjax.parallel.mesh import build_mesh  # noqa: E402
from msjax.resilience.replica_guard import ReplicaFingerprints  # noqa: E402
from msjax.resolve import resolve  # noqa: E402
from msjax.step import build_program  # noqa: E402

WARMUP_STEPS = 2  # steps left out of both measurements (first dispatches, caches)
CHECK_TIMINGS = 5  # one check timed this often on its own; the median counts


def mean_step_s(overrides: list[str], every: int) -> float:
    """msjax.train's mean step time, from its own metrics.jsonl, with checks every `every`."""
    checks = [
        f"resilience.replica_check_every={every}",
        "resilience.compute_check_every=0",  # the known-answer check: compute_check.py
    ]
    return train_mean_step_s(REPO / "configs" / "small.yaml", [*overrides, *checks], WARMUP_STEPS)


def one_check(overrides: list[str]) -> tuple[float, int, int, int]:
    """(seconds of one check, all-gather bytes it leaves on each device, as its compiled program
    counts them, the tensors it fingerprints, parameter bytes per device)."""
    config = resolve(load_config(REPO / "configs" / "small.yaml", overrides), 2, "cpu")
    program = build_program(config, build_mesh(config.mesh))
    state = program.init_state()
    params = state.params
    fingerprints = ReplicaFingerprints(program.mesh, program.state_shardings)
    compiled = fingerprints.lower(state).compile()
    gathered = count_collectives(collective_ops(compiled.as_text()))["all-gather"].result_bytes
    fingerprints.table(state)  # compiled and warm
    timings = []
    for _ in range(CHECK_TIMINGS):
        started = time.perf_counter()
        fingerprints.table(state)
        timings.append(time.perf_counter() - started)
    local = jax.local_devices()[0]
    param_bytes = sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(params)
        for shard in leaf.addressable_shards
        if shard.device == local
    )
    return float(np.median(timings)), gathered, len(fingerprints.tensor_names), param_bytes


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
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        *(TINY_MODEL + TINY_CORPUS if tiny else []),
    ]
    with tempfile.TemporaryDirectory(prefix="msjax-guard-benchmark-cache-") as cache_dir:
        measure(args, overrides, [*overrides, f"resilience.compile_cache_dir={cache_dir}"])


def measure(args: argparse.Namespace, overrides: list[str], run_overrides: list[str]) -> None:
    """Both loops, alternating, then one check on its own; prints every figure."""
    tiny = args.smoke or args.tiny
    print(
        f"configs/small.yaml{SMOKE_LABEL if args.smoke else ' (tiny model)' if tiny else ''} on 2 "
        f"{jax.devices()[0].platform} devices (data 2), batch {args.global_batch} x seq "
        f"{args.seq_len}, {args.steps} steps ({WARMUP_STEPS} left out), a check every "
        f"{args.every} steps"
    )
    bare_rounds, guarded_rounds = [], []
    for round_index in range(args.rounds):
        bare_rounds.append(mean_step_s(run_overrides, 0))
        guarded_rounds.append(mean_step_s(run_overrides, args.every))
        print(
            f"  round {round_index + 1}: no guard {bare_rounds[-1] * 1e3:.2f} ms, "
            f"guard {guarded_rounds[-1] * 1e3:.2f} ms per step"
        )
    bare, guarded = min(bare_rounds), min(guarded_rounds)
    check_s, gathered_bytes, tensors, param_bytes = one_check(overrides)
    print(f"{'step time, no guard':<40} {bare * 1e3:10.2f} ms")
    print(f"{f'step time, a check every {args.every} steps':<40} {guarded * 1e3:10.2f} ms")
    print(f"{'ratio (guard / no guard)':<40} {guarded / bare:10.3f}   (goal <= 1.01)")
    print(
        f"{'one check on its own':<40} {check_s * 1e3:10.2f} ms   (amortized: "
        f"{1 + check_s / (args.every * bare):.4f} x the step time)"
    )
    print(
        f"{'bytes one check moves':<40} {gathered_bytes:10,d} bytes per device   (an all-gather "
        f"of {tensors} tensors x 2 devices x 8 bytes)"
    )
    print(f"{'parameter bytes it reads in place':<40} {param_bytes:10,d} bytes per device")


if __name__ == "__main__":
    main()
