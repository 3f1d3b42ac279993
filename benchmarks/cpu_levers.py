"""msjax's CPU step levers, each switched off against all on, in one run: tokens/s and ratios.

The side-by-side shape (embed 512, 8 layers, 8 heads of 64, mlp 1408, seq 512, batch 8, float32)
on one CPU device. Each variant runs the compiled train step in its own process (malloc reads
its settings at start) on batches already on the device, and prints tokens/s, minor page
faults per step and XLA's temp size. The levers:

- allocator: msjax's (jemalloc keeping what is freed where it is installed: msjax.allocator),
  against glibc's huge pages alone (`MSJAX_ALLOCATOR=glibc`) and against glibc as it is;
- layer loop: `model.layer_loop=unroll` (what `auto` is on CPU with `remat=none`) against scan;
- remat: none (the default) against attention, dots and full, each scanned (what `auto` runs
  under a remat policy: unrolled, recomputing saves no memory on CPU); all off runs full, the
  policy that keeps the least.

    python benchmarks/cpu_levers.py [--steps 4] [--rounds 1]
    python benchmarks/cpu_levers.py --smoke   # a tiny model, 2 steps, all on and all off

The variants run one after another; --rounds > 1 alternates them and keeps each one's best round,
so a burst of load from elsewhere on a shared machine does not decide a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.smoke import SMOKE_LABEL, TINY_CORPUS, TINY_MODEL, TINY_SEQ_LEN  # noqa: E402
from msjax.allocator import (  # noqa: E402
    ALLOCATOR_VAR,
    ALLOCATOR_VARS,
    REEXEC_MARKER_VAR,
    allocator_env,
)

SIDE_BY_SIDE = [
    "model.num_layers=8",
    "model.embed_dim=512",
    "model.num_heads=8",
    "model.num_kv_heads=8",
    "model.head_dim=64",
    "model.mlp_dim=1408",
    "model.attention_impl=xla",
    "data.seq_len=512",
    "train.global_batch=8",
    "data.max_corpus_mib=8",
]
ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipe=1"]
ALL_ON = {"allocator": "auto", "remat": "none", "layer_loop": "unroll"}
# name: what differs from ALL_ON
VARIANTS = {
    "all on": {},
    "allocator glibc": {"allocator": "glibc"},
    "allocator off": {"allocator": "off"},
    "layer loop scan": {"layer_loop": "scan"},
    "remat attention": {"remat": "attention", "layer_loop": "scan"},
    "remat dots": {"remat": "dots", "layer_loop": "scan"},
    "remat full": {"remat": "full", "layer_loop": "scan"},
    "all off": {"allocator": "off", "remat": "full", "layer_loop": "scan"},
}


WARMUP_STEPS = 3  # compiling's first run, and a heap that keeps what is freed growing to its peak


def run_variant(levers: dict, overrides: list[str], steps: int) -> dict:
    """In this process: the compiled step `steps` times after WARMUP_STEPS; what it measured."""
    import jax

    from msjax.config import load_config
    from msjax.data.dataset import build_training_data
    from msjax.observe.memory import compiled_memory
    from msjax.parallel.mesh import build_mesh
    from msjax.resolve import resolve
    from msjax.step import build_program

    levers_set = [f"model.remat={levers['remat']}", f"model.layer_loop={levers['layer_loop']}"]
    config = load_config(None, [*overrides, *levers_set])
    config = resolve(config, 1, jax.default_backend())
    program = build_program(config, build_mesh(config.mesh))
    state = program.init_state()
    source = build_training_data(config, lambda line: None).train
    batches = [
        jax.device_put(source.global_batch_at(step), program.batch_sharding)
        for step in range(WARMUP_STEPS + steps)
    ]
    compiled = program.train_step.lower(state, batches[0]).compile()
    for batch in batches[:WARMUP_STEPS]:
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    for batch in batches[WARMUP_STEPS:]:
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    elapsed_s = time.perf_counter() - started
    memory = compiled_memory(compiled)
    tokens = steps * config.train.global_batch * config.data.seq_len
    return {
        "tokens_per_s": tokens / elapsed_s,
        "minor_faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        / steps,
        "temp_mib": memory.temp_bytes / 2**20 if memory else float("nan"),
    }


def variant_env(allocator: str) -> dict[str, str]:
    """One device; MSJAX_ALLOCATOR=`allocator` (auto, glibc or off), whatever this process was
    started with."""
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1", "PYTHONPATH": str(REPO)}
    for name in (*ALLOCATOR_VARS, REEXEC_MARKER_VAR):
        env.pop(name, None)
    env[ALLOCATOR_VAR] = allocator
    return allocator_env(env)


def measure(name: str, overrides: list[str], steps: int) -> dict:
    """One variant's figures, measured in a process of its own."""
    levers = {**ALL_ON, **VARIANTS[name]}
    args = ["--variant", name, "--steps", str(steps), "--overrides", json.dumps(overrides)]
    completed = subprocess.run(
        [sys.executable, __file__, *args],
        env=variant_env(levers["allocator"]),
        capture_output=True,
        text=True,
        check=False,
    )
    if completed.returncode != 0:
        sys.exit(f"cpu_levers: variant {name!r} failed:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    """Every variant (or, as a child, the one --variant names) measured and printed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 2 steps")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # a child: one variant, JSON out
    parser.add_argument("--overrides", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is not None:
        levers = {**ALL_ON, **VARIANTS[args.variant]}
        print(json.dumps(run_variant(levers, json.loads(args.overrides), args.steps)))
        return
    overrides = [*SIDE_BY_SIDE, *ONE_DEVICE]
    variants = list(VARIANTS)
    label = "side-by-side shape, float32, 1 CPU device"
    if args.smoke:
        smoke_shape = [*TINY_MODEL, f"data.seq_len={TINY_SEQ_LEN}", "train.global_batch=2"]
        overrides = [*SIDE_BY_SIDE, *smoke_shape, *TINY_CORPUS, *ONE_DEVICE]
        args.steps, args.rounds, label = 2, 1, label + SMOKE_LABEL
        variants = ["all on", "all off"]
    print(f"msjax CPU levers: {label}, {args.steps} steps per variant")
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name in variants:
            result = measure(name, overrides, args.steps)
            if name not in best or result["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = result
    on = best["all on"]["tokens_per_s"]
    print(
        f"{'variant':<18} {'tokens/s':>10} {'all on / it':>12} {'faults/step':>12} {'temp MiB':>9}"
    )
    for name, result in best.items():
        print(
            f"{name:<18} {result['tokens_per_s']:>10,.1f} {on / result['tokens_per_s']:>12.3f} "
            f"{result['minor_faults_per_step']:>12,.0f} {result['temp_mib']:>9,.1f}"
        )


if __name__ == "__main__":
    main()
