"""What checkpointing costs the training loop: msjax.train with saves every 5 steps vs none.

Runs `configs/small.yaml` (smaller batch) on one CPU device, in this process:
(a) how long each `save()` holds up the loop, as a fraction of a step;
(b) tokens/s with a save every 5 steps against no saves (target >= 0.95), counting the time
    saves hold the loop;
(c) save throughput (start to finalized on disk) and restore throughput, in MB/s.

It also measures the CPU time one save costs (user + system, every thread) and the ratio that
cost allows at best when the steps already keep every core busy, as they do on a CPU-only
machine: there the background write and the step share the same cores, while on an accelerator
the step runs on the device and the write on otherwise idle host cores.

    python benchmarks/checkpoint_overhead.py [--steps 16] [--global-batch 1] [--seq-len 256]
    python benchmarks/checkpoint_overhead.py --smoke   # a tiny model for 7 steps, in seconds
    python benchmarks/checkpoint_overhead.py --save-restore-only configs/llama_1b.yaml [k=v ...]
        # only init_state -> save -> wait -> restore -> block_until_ready (-> save), in GB/s
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ["JAX_NUM_CPU_DEVICES"] = "1"
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402

from benchmarks.smoke import SMOKE_LABEL, TINY_CORPUS, TINY_MODEL, TINY_SEQ_LEN  # noqa: E402
from msjax.checkpoint.manager import Checkpointer  # noqa: E402
from msjax.config import load_config  # noqa: E402
from msjax.observe.metrics import read_metrics  # noqa: E402
from msjax.parallel.mesh import build_mesh  # noqa: E402
from msjax.resolve import resolve  # noqa: E402
from msjax.step import build_program  # noqa: E402
from msjax.train import train  # noqa: E402

WARMUP_STEPS = 2


def loop_throughput(overrides: list[str]) -> tuple[float, list[float], float]:
    """(tokens/s counting save pauses, each save's pause in s, median step time in s)."""
    with tempfile.TemporaryDirectory() as root:
        run_dir = Path(root) / "run"
        config = load_config(REPO / "configs" / "small.yaml", [*overrides, f"run.dir={run_dir}"])
        with open(os.devnull, "w") as quiet:
            train(config, progress_stream=quiet)
        records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r][WARMUP_STEPS:]
    first_measured = steps[0]["step"]
    pauses = [
        r["checkpoint_save_blocked_s"]
        for r in records
        if "checkpoint_save_blocked_s" in r and first_measured < r["step"] <= steps[-1]["step"]
    ]
    elapsed = sum(r["step_time_s"] for r in steps) + sum(pauses)
    tokens = len(steps) * config.train.global_batch * config.data.seq_len
    step_times = sorted(r["step_time_s"] for r in steps)
    return tokens / elapsed, pauses, step_times[len(step_times) // 2]


def cpu_seconds() -> float:
    """User + system CPU time of this process so far, every thread counted."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def save_restore_mb_per_s(overrides: list[str]) -> tuple[float, float, float, float]:
    """(state MB, save MB/s until finalized, restore MB/s, CPU s of the save) for one save."""
    phases = {
        timed["phase"]: timed
        for timed in save_and_restore(REPO / "configs" / "small.yaml", overrides)
    }
    state_mb = phases["state"]["bytes"] / 1e6
    return (
        state_mb,
        state_mb / phases["first_save"]["seconds"],
        state_mb / phases["restore"]["seconds"],
        phases["first_save"]["cpu_seconds"],
    )


def save_and_restore(config_path: Path, overrides: list[str]) -> Iterator[dict[str, Any]]:
    """A state of this config made by init_state, then saved, restored and saved again: one
    record per phase as it ends.

    The first save also compiles the fingerprint program; the second is the steady cost. The
    restore follows the first save, so its files are in the page cache (warm).
    """
    config = load_config(config_path, overrides)
    config = resolve(config, jax.device_count(), jax.default_backend())
    program = build_program(config, build_mesh(config.mesh))
    state = jax.block_until_ready(program.init_state())
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    yield {"phase": "state", "bytes": state_bytes}
    with tempfile.TemporaryDirectory() as root:
        checkpointer = Checkpointer(Path(root), config.checkpoint)
        for step, phase in ((1, "first_save"), (None, "restore"), (2, "second_save")):
            started, cpu_started = time.perf_counter(), cpu_seconds()
            if step is None:
                restored = checkpointer.restore(1, program.abstract_state())
                jax.block_until_ready(restored.state)
                del restored
            else:
                checkpointer.save(step, state, {"config": config.to_dict()})
                checkpointer.wait()
            seconds = time.perf_counter() - started
            yield {
                "phase": phase,
                "seconds": seconds,
                "cpu_seconds": cpu_seconds() - cpu_started,
                "gb_per_s": state_bytes / 1e9 / seconds,
                "bytes_on_disk": sum(
                    f.stat().st_size for f in Path(root).rglob("*") if f.is_file()
                ),
            }
        checkpointer.close()


def print_save_restore_only(config_path: Path, overrides: list[str]) -> None:
    """--save-restore-only: init_state -> save -> wait -> restore -> save again, in GB/s; one
    JSON line per phase, flushed as it ends (a run cut short keeps the phases it finished)."""
    device = jax.devices()[0].device_kind
    for timed in save_and_restore(config_path, overrides):
        print(json.dumps({"config": str(config_path), "device": device, **timed}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--global-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--smoke", action="store_true", help="a tiny model for 7 steps")
    parser.add_argument(
        "--save-restore-only",
        type=Path,
        metavar="CONFIG",
        help="only time init_state -> save -> restore of CONFIG's state (GB/s, JSON lines)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value for --save-restore-only")
    args = parser.parse_args()
    if args.save_restore_only:
        print_save_restore_only(args.save_restore_only, args.overrides)
        return
    if args.smoke:
        args.steps, args.seq_len = 7, TINY_SEQ_LEN  # one save (step 5) inside the measured steps
    base = [
        f"train.steps={args.steps}",
        f"train.global_batch={args.global_batch}",
        f"data.seq_len={args.seq_len}",
        "train.eval_every=0",
        "mesh.data=-1",
        *(TINY_MODEL + TINY_CORPUS if args.smoke else []),
    ]
    print(
        f"configs/small.yaml{SMOKE_LABEL if args.smoke else ''} on 1 {jax.devices()[0].platform} "
        f"device, batch {args.global_batch} x seq {args.seq_len}, {args.steps} steps "
        f"({WARMUP_STEPS} left out)"
    )
    without, _, _ = loop_throughput([*base, "checkpoint.enabled=false"])
    with_saves, pauses, step_s = loop_throughput([*base, "checkpoint.every_steps=5"])
    state_mb, save_rate, restore_rate, save_cpu_s = save_restore_mb_per_s(base)
    cores = len(os.sched_getaffinity(0))
    # saves every 5 steps; each takes save_cpu_s of CPU from steps that already use every core
    best_ratio = 5 * step_s / (5 * step_s + save_cpu_s / cores)
    mean_pause = sum(pauses) / max(len(pauses), 1)
    print(f"{'no checkpoints':<40} {without:10,.1f} tokens/s")
    print(f"{'a save every 5 steps (async)':<40} {with_saves:10,.1f} tokens/s")
    print(f"{'ratio (with saves / without)':<40} {with_saves / without:10.3f}   (target >= 0.95)")
    print(
        f"{'save() holds the loop':<40} {mean_pause:10.3f} s per save "
        f"= {mean_pause / step_s:.2f} of a {step_s:.2f} s step ({len(pauses)} saves)"
    )
    # the first save also compiles the fingerprint program
    print(f"{'  each save':<40} {' '.join(f'{pause:.3f}' for pause in pauses)} s")
    print(f"{'state size':<40} {state_mb:10,.1f} MB")
    print(f"{'save, start to finalized on disk':<40} {save_rate:10,.1f} MB/s")
    print(f"{'restore onto the mesh':<40} {restore_rate:10,.1f} MB/s")
    print(
        f"{'CPU time of one save':<40} {save_cpu_s:10.2f} s on {cores} cores: with the steps "
        f"using every core, the ratio can reach at most {best_ratio:.3f} here"
    )


if __name__ == "__main__":
    main()
