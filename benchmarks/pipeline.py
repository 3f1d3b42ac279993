"""Pipeline schedules side by side on 8 simulated CPU devices: the compiled step's dot FLOPs over
the model FLOPs (beside the planner's figure), the bytes a device sends over `pipe` per step inside
the pipeline's loop and outside it, tokens/s and XLA's peak memory per device for pipe 1, 2 and 4
x schedule (gpipe, circular, 1f1b) x microbatches, beside the bubble formula, and 1f1b's memory
against gpipe's at the same pipe size and microbatches.

Baseline: the same global batch on data 8 x pipe 1. Simulated devices share the host's cores,
so the CPU times show partitioning overhead only (the bubble's idle stages still compute on
zeros); the memory figures are XLA's own buffer assignment, exact for this program.

    python benchmarks/pipeline.py [--config configs/small.yaml] [--steps 2] [--quick]
    python benchmarks/pipeline.py --smoke   # --quick's shapes, 3 layouts (pipe 1, 2 gpipe, 2 1f1b)
    python benchmarks/pipeline.py --config configs/tiny.yaml --set model.vocab_size=32768
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax

from msjax.config import load_config
from msjax.observe.flops import flops_per_step
from msjax.parallel.pipeline import PipelineLayout
from msjax.planner.aot import compile_step
from msjax.planner.candidates import MeshShape, config_for_mesh
from msjax.planner.compute import estimate_compute
from msjax.planner.sweep import SweepRow, measure_mesh

GIB = 2**30
MB = 1e6

# (label, mesh (data, fsdp, tensor, pipe), pipeline overrides)
LAYOUTS = [
    ("pipe 1 (baseline)", MeshShape(8, 1, 1, 1), []),
    ("pipe 2 gpipe M=2", MeshShape(4, 1, 1, 2), ["pipeline.microbatches=2"]),
    ("pipe 2 gpipe M=4", MeshShape(4, 1, 1, 2), ["pipeline.microbatches=4"]),
    (
        "pipe 2 circular R=2 M=4",
        MeshShape(4, 1, 1, 2),
        ["pipeline.schedule=circular", "pipeline.repeats=2", "pipeline.microbatches=4"],
    ),
    (
        "pipe 2 tp 2 seqpar gpipe M=4",
        MeshShape(2, 1, 2, 2),
        ["pipeline.microbatches=4", "mesh.sequence_parallel=true"],
    ),
    ("pipe 4 gpipe M=4", MeshShape(2, 1, 1, 4), ["pipeline.microbatches=4"]),
    ("pipe 4 gpipe M=8", MeshShape(2, 1, 1, 4), ["pipeline.microbatches=8"]),
    (
        "pipe 4 circular R=3 M=8",
        MeshShape(2, 1, 1, 4),
        ["pipeline.schedule=circular", "pipeline.repeats=3", "pipeline.microbatches=8"],
    ),
    (
        "pipe 2 1f1b M=4",
        MeshShape(4, 1, 1, 2),
        ["pipeline.schedule=1f1b", "pipeline.microbatches=4"],
    ),
    (
        "pipe 4 1f1b M=8",
        MeshShape(2, 1, 1, 4),
        ["pipeline.schedule=1f1b", "pipeline.microbatches=8"],
    ),
]

# the baseline and both schedules at one pipe size and microbatch count: every line still prints
SMOKE_LAYOUTS = ("pipe 1 (baseline)", "pipe 2 gpipe M=4", "pipe 2 1f1b M=4")


def pipe_bytes(config, mesh: MeshShape) -> tuple[float, float]:
    """(inside loops, outside them): bytes one device sends per step in collectives spanning
    `pipe` (the compile is measure_mesh's, cached)."""
    step = compile_step(config, mesh)
    total = sum(sent for axes, sent in step.sent_by_axes.items() if "pipe" in axes.split("+"))
    in_loops = sum(
        sent for axes, sent in step.sent_by_axes_in_loops.items() if "pipe" in axes.split("+")
    )
    return in_loops, total - in_loops


def measured(config, mesh: MeshShape, steps: int, compile_only: bool) -> SweepRow:
    """The sweep's row for one layout; compile_only: its compiled counts, no steps run."""
    if not compile_only:
        return measure_mesh(config, mesh, steps, None)
    step = compile_step(config, mesh)
    return SweepRow(
        mesh=mesh,
        compile_s=step.compile_s,
        memory={"total_bytes": step.memory.total_bytes},
        model_memory_bytes=0,
        collectives={},
        fits=None,
        work_ratio=step.flops.total * mesh.devices / flops_per_step(step.config),
        planned_work_ratio=estimate_compute(config, mesh, jax.default_backend()).ratio,
        tokens_per_s=float("nan"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/small.yaml")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, every layout")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 3 layouts, 1 step")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides (key=value)")
    parser.add_argument("--layouts", nargs="*", help="only the layouts with these labels")
    parser.add_argument(
        "--compile-only", action="store_true", help="counts and memory only (no tokens/s)"
    )
    parser.add_argument("--remat", default="none", help="model.remat for every layout")
    args = parser.parse_args()
    layouts = LAYOUTS
    if args.smoke:
        args.quick, args.steps = True, 1
        layouts = [row for row in LAYOUTS if row[0] in SMOKE_LAYOUTS]
    if args.layouts:
        layouts = [row for row in LAYOUTS if row[0] in args.layouts]
    base = [f"train.global_batch={args.global_batch}", f"model.remat={args.remat}", *args.set]
    if args.quick:
        base += ["model.num_layers=12", "model.embed_dim=64", "model.mlp_dim=128"]
        base += ["model.num_heads=4", "model.num_kv_heads=2", "data.seq_len=64"]
    if args.smoke:
        base += ["model.num_layers=4"]  # 2 layers per stage at pipe 2
    print(
        f"{args.config} {' '.join(args.set)}, global batch {args.global_batch}, "
        f"remat {args.remat}, {args.steps} timed steps per layout"
    )
    print(
        "work: the compiled step's dot FLOPs (per device x devices) / model FLOPs; plan: the "
        "planner's figure for it (msjax.planner.compute); pipe MB: what a device sends over "
        "`pipe` per step, inside the pipeline's loop and outside it"
    )
    print(
        f"{'layout':<29} {'work':>5} {'plan':>5} {'loop MB':>8} {'out MB':>8} {'bubble':>7} "
        f"{'tokens/s':>10} {'vs pipe 1':>9} {'XLA GiB/dev':>11} {'vs pipe 1':>9}"
    )
    baseline = None
    memory_of: dict[tuple[int, int, str], int] = {}  # (pipe, microbatches, schedule) -> bytes
    for label, mesh, overrides in layouts:
        config = config_for_mesh(load_config(args.config, [*base, *overrides]), mesh, "cpu")
        layout = PipelineLayout.of(config)
        bubble = layout.bubble_fraction if mesh.pipe > 1 else 0.0
        row = measured(config, mesh, args.steps, args.compile_only)
        in_loop, outside = pipe_bytes(config, mesh)
        memory = row.memory["total_bytes"]
        memory_of[(mesh.pipe, layout.microbatches, layout.schedule)] = memory
        baseline = baseline or (row.tokens_per_s, memory)
        print(
            f"{label:<29} {row.work_ratio:>5.2f} {row.planned_work_ratio:>5.2f} "
            f"{in_loop / MB:>8.3f} {outside / MB:>8.3f} {bubble:>7.1%} "
            f"{row.tokens_per_s:>10,.0f} "
            f"{row.tokens_per_s / baseline[0]:>9.2f} {memory / GIB:>11.3f} "
            f"{memory / baseline[1]:>9.2f}"
        )
    # 1F1B's point: memory against gpipe at the same pipe size and microbatch count
    for (pipe, microbatches, schedule), memory in memory_of.items():
        gpipe = memory_of.get((pipe, microbatches, "gpipe"))
        if schedule == "1f1b" and gpipe:
            print(
                f"pipe {pipe} M={microbatches}: 1f1b needs {memory / gpipe:.2f}x gpipe's XLA "
                f"memory per device ({memory / GIB:.3f} vs {gpipe / GIB:.3f} GiB)"
            )


if __name__ == "__main__":
    main()
