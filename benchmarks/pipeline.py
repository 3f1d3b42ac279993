"""Pipeline schedules side by side on 8 simulated CPU devices: the compiled step's dot FLOPs over
the model FLOPs (beside the planner's figure), the bytes a device sends over `pipe` per step inside
the pipeline's loop and outside it, tokens/s and XLA's peak memory per device for pipe 1, 2 and 4
x schedule (gpipe, circular, 1f1b) x microbatches x remat policy, beside the bubble of the
schedule's table, and 1f1b against gpipe on the same mesh, microbatches and remat.

Baseline: the same global batch on pipe 1 (data 8, or data 8/t x tensor t with --tensor t), at
the same remat. Simulated devices share the host's cores, so the CPU times show partitioning
overhead only (the bubble's idle stages still compute on zeros under gpipe and circular); the
memory figures are XLA's own buffer assignment (arguments + outputs - donated + temporaries),
exact for this program. A layout the config cannot split (layers not divisible by pipe x repeats)
prints one line saying why.

    python benchmarks/pipeline.py [--config configs/small.yaml] [--steps 2] [--quick]
    python benchmarks/pipeline.py --smoke   # --quick's shapes, 3 layouts (pipe 1, 2 gpipe, 2 1f1b)
    python benchmarks/pipeline.py --config configs/tiny.yaml --tensor 2 --remat none full
    python benchmarks/pipeline.py --config configs/tiny.yaml --set model.vocab_size=32768
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax

from msjax.config import load_config
from msjax.errors import MsjaxError
from msjax.observe.flops import flops_per_step
from msjax.parallel.pipeline import PipelineLayout
from msjax.planner.aot import compile_step
from msjax.planner.candidates import MeshShape, config_for_mesh
from msjax.planner.compute import estimate_compute
from msjax.planner.sweep import SweepRow, measure_mesh

DEVICES = 8
GIB = 2**30
MB = 1e6

# (label, pipe, tensor, pipeline overrides); data fills the 8 devices
LAYOUTS = [
    ("pipe 1 (baseline)", 1, 1, []),
    ("pipe 2 gpipe M=2", 2, 1, ["pipeline.microbatches=2"]),
    ("pipe 2 gpipe M=4", 2, 1, ["pipeline.microbatches=4"]),
    (
        "pipe 2 circular R=2 M=4",
        2,
        1,
        ["pipeline.schedule=circular", "pipeline.repeats=2", "pipeline.microbatches=4"],
    ),
    (
        "pipe 2 tp 2 seqpar gpipe M=4",
        2,
        2,
        ["pipeline.microbatches=4", "mesh.sequence_parallel=true"],
    ),
    ("pipe 4 gpipe M=4", 4, 1, ["pipeline.microbatches=4"]),
    ("pipe 4 gpipe M=8", 4, 1, ["pipeline.microbatches=8"]),
    (
        "pipe 4 circular R=3 M=8",
        4,
        1,
        ["pipeline.schedule=circular", "pipeline.repeats=3", "pipeline.microbatches=8"],
    ),
    ("pipe 2 1f1b M=4", 2, 1, ["pipeline.schedule=1f1b", "pipeline.microbatches=4"]),
    ("pipe 4 1f1b M=8", 4, 1, ["pipeline.schedule=1f1b", "pipeline.microbatches=8"]),
]

# the baseline and both schedules at one pipe size and microbatch count: every line still prints
SMOKE_LAYOUTS = ("pipe 1 (baseline)", "pipe 2 gpipe M=4", "pipe 2 1f1b M=4")


@dataclass(frozen=True)
class Measured:
    """One layout at one remat policy, as printed."""

    label: str
    mesh: MeshShape
    remat: str
    microbatches: int
    schedule: str
    sequence_parallel: bool
    row: SweepRow
    pipe_bytes_in_loop: float
    pipe_bytes_outside: float
    bubble: float

    @property
    def memory_bytes(self) -> int:
        return self.row.memory["total_bytes"]

    @property
    def pipe_bytes(self) -> float:
        return self.pipe_bytes_in_loop + self.pipe_bytes_outside


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


def layout_mesh(pipe: int, tensor: int) -> MeshShape:
    """data x pipe x tensor over the 8 devices (fsdp 1)."""
    if DEVICES % (pipe * tensor):
        raise MsjaxError(f"pipe {pipe} x tensor {tensor} does not divide {DEVICES} devices")
    return MeshShape(DEVICES // (pipe * tensor), 1, tensor, pipe)


def measure_layout(args, base: list[str], layout, remat: str) -> Measured:
    """Compile (and time, unless --compile-only) one layout at one remat policy."""
    label, pipe, tensor, overrides = layout
    mesh = layout_mesh(pipe, max(tensor, args.tensor))
    loaded = load_config(args.config, [*base, f"model.remat={remat}", *overrides])
    config = config_for_mesh(loaded, mesh, "cpu")
    pipeline = PipelineLayout.of(config)
    in_loop, outside = pipe_bytes(config, mesh)
    return Measured(
        label=label,
        mesh=mesh,
        remat=remat,
        microbatches=pipeline.microbatches,
        schedule=pipeline.schedule,
        sequence_parallel=config.mesh.sequence_parallel,
        row=measured(config, mesh, args.steps, args.compile_only),
        pipe_bytes_in_loop=in_loop,
        pipe_bytes_outside=outside,
        bubble=pipeline.bubble_fraction if pipe > 1 else 0.0,
    )


def print_row(result: Measured, baseline: Measured | None) -> None:
    row = result.row
    speed = row.tokens_per_s / baseline.row.tokens_per_s if baseline else float("nan")
    memory = result.memory_bytes / baseline.memory_bytes if baseline else float("nan")
    mesh = f"{result.mesh.data},{result.mesh.fsdp},{result.mesh.pipe},{result.mesh.tensor}"
    print(
        f"{result.label:<29} {mesh:>7} {result.remat:>5} {row.work_ratio:>5.2f} "
        f"{row.planned_work_ratio:>5.2f} {result.pipe_bytes_in_loop / MB:>8.3f} "
        f"{result.pipe_bytes_outside / MB:>8.3f} {result.bubble:>7.1%} "
        f"{row.tokens_per_s:>10,.0f} {speed:>9.2f} {result.memory_bytes / GIB:>11.3f} "
        f"{memory:>9.2f}"
    )


def print_one_f_one_b_against_gpipe(results: list[Measured]) -> None:
    """1F1B's point: memory (and work, pipe bytes) against gpipe on the same mesh, microbatch
    count and remat policy."""
    gpipe_of = {
        (r.mesh, r.microbatches, r.sequence_parallel, r.remat): r
        for r in results
        if r.schedule == "gpipe" and r.mesh.pipe > 1
    }
    for one_f_one_b in (r for r in results if r.schedule == "1f1b"):
        key = (one_f_one_b.mesh, one_f_one_b.microbatches, one_f_one_b.sequence_parallel)
        gpipe = gpipe_of.get((*key, one_f_one_b.remat))
        if gpipe is None:
            continue
        mesh = one_f_one_b.mesh
        print(
            f"pipe {mesh.pipe} M={one_f_one_b.microbatches} (data {mesh.data} x tensor "
            f"{mesh.tensor}), remat {one_f_one_b.remat}: 1f1b needs "
            f"{one_f_one_b.memory_bytes / gpipe.memory_bytes:.2f}x gpipe's XLA memory per device "
            f"({one_f_one_b.memory_bytes / GIB:.3f} vs {gpipe.memory_bytes / GIB:.3f} GiB), "
            f"{one_f_one_b.row.work_ratio / gpipe.row.work_ratio:.2f}x its compiled work "
            f"({one_f_one_b.row.work_ratio:.2f} vs {gpipe.row.work_ratio:.2f}), "
            f"{one_f_one_b.pipe_bytes / gpipe.pipe_bytes:.2f}x its pipe bytes "
            f"({one_f_one_b.pipe_bytes / MB:.3f} vs {gpipe.pipe_bytes / MB:.3f} MB)"
        )


def parse_args() -> argparse.Namespace:
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
    parser.add_argument(
        "--remat", nargs="+", default=["none"], help="model.remat policies, each layout at each"
    )
    parser.add_argument(
        "--tensor", type=int, default=1, help="tensor size of every layout (data fills the rest)"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    layouts = LAYOUTS
    if args.smoke:
        args.quick, args.steps = True, 1
        layouts = [row for row in LAYOUTS if row[0] in SMOKE_LAYOUTS]
    if args.layouts:
        layouts = [row for row in LAYOUTS if row[0] in args.layouts]
    base = [f"train.global_batch={args.global_batch}", *args.set]
    if args.quick:
        base += ["model.num_layers=12", "model.embed_dim=64", "model.mlp_dim=128"]
        base += ["model.num_heads=4", "model.num_kv_heads=2", "data.seq_len=64"]
    if args.smoke:
        base += ["model.num_layers=4"]  # 2 layers per stage at pipe 2
    timing = "compiled only" if args.compile_only else f"{args.steps} timed steps per layout"
    print(
        f"{args.config} {' '.join(args.set)}, global batch {args.global_batch}, "
        f"remat {' and '.join(args.remat)}, {timing}"
    )
    print(
        "mesh: data,fsdp,pipe,tensor; work: the compiled step's dot FLOPs (per device x "
        "devices) / model FLOPs; plan: the planner's figure for it (msjax.planner.compute); "
        "pipe MB: what a device sends over `pipe` per step, inside the pipeline's loop and "
        "outside it; bubble: the schedule table's idle share; vs pipe 1: at the same remat"
    )
    print(
        f"{'layout':<29} {'mesh':>7} {'remat':>5} {'work':>5} {'plan':>5} {'loop MB':>8} "
        f"{'out MB':>8} {'bubble':>7} {'tokens/s':>10} {'vs pipe 1':>9} {'XLA GiB/dev':>11} "
        f"{'vs pipe 1':>9}"
    )
    results = []
    for remat in args.remat:
        baseline = None
        for layout in layouts:
            try:
                result = measure_layout(args, base, layout, remat)
            except MsjaxError as error:
                print(f"{layout[0]:<29} remat {remat}: not measured: {error}")
                continue
            baseline = baseline or (result if result.mesh.pipe == 1 else None)
            print_row(result, baseline)
            results.append(result)
    print_one_f_one_b_against_gpipe(results)


if __name__ == "__main__":
    main()
