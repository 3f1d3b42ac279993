"""`python -m msjax.plan`: a dry run for a cluster you do not have: per-device memory and traffic
of every mesh that can run a config on N devices, a predicted step time, and MegaScale's Table 2.

Memory and communication come from the analytical model (`msjax.planner.planning` and
`msjax.planner.communication`); `--xla` compiles each mesh on simulated CPU devices to set XLA's
numbers beside it (small N only);
`--lower` lowers the step on an abstract mesh of N devices, which JAX allows without them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from msjax.cli import ArgumentParser, user_error
from msjax.config import Config, load_config
from msjax.errors import MsjaxError
from msjax.observe.flops import count_params
from msjax.parallel.mesh import configure_cpu_devices
from msjax.planner.aot import lower_on_abstract_mesh
from msjax.planner.candidates import PLANNED_BACKEND, MeshShape, mesh_of_config
from msjax.planner.mesh_plan import (
    GIB,
    PlanRow,
    add_xla_memory,
    choose,
    format_plan,
    plan_rows,
    recommend,
    step_band,
)
from msjax.planner.planning import estimate_memory
from msjax.planner.prediction import (
    Hardware,
    StepPrediction,
    Table2Comparison,
    compare_with_table2,
)
from msjax.resolve import resolve_model

_PROG = "msjax.plan"
MAX_XLA_DEVICES = 64  # --xla simulates this many CPU devices at most


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=f"python -m {_PROG}",
        description="Per-device memory, communication and predicted step time of every mesh "
        "that can run a config on N devices, without the devices.",
        epilog="example: python -m msjax.plan --config configs/megascale_175b.yaml "
        "--devices 12288 --memory-gib 80 --predict",
    )
    parser.add_argument("--config", help="YAML config (default: the built-in tiny config)")
    parser.add_argument("--devices", type=int, help="device count of the target cluster")
    parser.add_argument("--memory-gib", type=float, help="memory per device on the target")
    parser.add_argument("--top", type=int, default=12, help="meshes to list (default 12)")
    parser.add_argument(
        "--platform",
        choices=("gpu", "cpu", "tpu"),
        help="the target's platform, which decides what model.attention_impl=auto runs (a "
        "fused attention on gpu for 16-bit models); default gpu, or cpu with --xla",
    )
    parser.add_argument(
        "--xla",
        action="store_true",
        help=f"also compile every listed mesh on simulated CPU devices (N <= {MAX_XLA_DEVICES})"
        " and show XLA's memory analysis beside the model's",
    )
    parser.add_argument(
        "--lower",
        action="store_true",
        help="lower the recommended mesh's step on an abstract N-device mesh (no devices needed)",
    )
    parser.add_argument(
        "--predict",
        action="store_true",
        help="predict step time and MFU at MegaScale's Table 2 GPU counts and batches",
    )
    _add_hardware_arguments(parser)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser


def _add_hardware_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that set the hardware a prediction assumes (defaults: Hardware's)."""
    defaults = Hardware()
    hardware = parser.add_argument_group("hardware assumed for predictions (A100 SXM nodes)")
    hardware.add_argument(
        "--peak-tflops",
        type=float,
        help=f"dense peak per device (default: train.peak_tflops, else {defaults.peak_tflops:g})",
    )
    hardware.add_argument(
        "--matmul-efficiency",
        type=float,
        default=defaults.matmul_efficiency,
        help=f"share of peak the matmuls sustain (default {defaults.matmul_efficiency:g})",
    )
    hardware.add_argument(
        "--intra-node-gb-s",
        type=float,
        default=defaults.intra_node_gb_s,
        help=f"GB/s per device each way inside a node (default {defaults.intra_node_gb_s:g}: "
        "NVLink 3)",
    )
    hardware.add_argument(
        "--inter-node-gb-s",
        type=float,
        default=defaults.inter_node_gb_s,
        help=f"GB/s per device across nodes (default {defaults.inter_node_gb_s:g}: one "
        "200 Gb/s NIC per GPU)",
    )
    hardware.add_argument(
        "--devices-per-node",
        type=int,
        default=defaults.devices_per_node,
        help=f"devices sharing the fast links (default {defaults.devices_per_node})",
    )


def hardware_from(args: argparse.Namespace, config: Config) -> Hardware:
    """The hardware flags as a Hardware (MsjaxError naming a flag out of range)."""
    peak = args.peak_tflops or config.train.peak_tflops or Hardware().peak_tflops
    values = {
        "--peak-tflops": peak,
        "--matmul-efficiency": args.matmul_efficiency,
        "--intra-node-gb-s": args.intra_node_gb_s,
        "--inter-node-gb-s": args.inter_node_gb_s,
        "--devices-per-node": args.devices_per_node,
    }
    for flag, value in values.items():
        if not value > 0:
            raise MsjaxError(f"{flag}={value} must be positive")
    if args.matmul_efficiency > 1:
        raise MsjaxError(f"--matmul-efficiency={args.matmul_efficiency} must be at most 1")
    return Hardware(
        peak_tflops=peak,
        matmul_efficiency=args.matmul_efficiency,
        intra_node_gb_s=args.intra_node_gb_s,
        inter_node_gb_s=args.inter_node_gb_s,
        devices_per_node=args.devices_per_node,
    )


def _human_count(count: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return f"{count:.0f}"


def format_table2(config: Config, hardware: Hardware) -> str:
    """MegaScale's Table 2 beside the predictions for its layout and the config's own mesh."""
    comparisons = compare_with_table2(config, hardware)
    layout = comparisons[0].paper_layout.layout.split("x", 1)[1].strip()
    lines = [
        f"Scale prediction for {config.run.name} (remat {config.model.remat}); "
        + hardware.describe(),
        f"{'':12} | {'MegaScale Table 2 (measured)':^27} | {'predicted: paper layout':^31} | "
        f"{'predicted: msjax mesh':^42}",
        f"{'GPUs':>5} {'batch':>6} | {'Megatron-LM':>13} {'MegaScale':>13} | "
        f"{'step s':>19} {'MFU %':>11} | {'mesh':>10} {'step s':>19} {'MFU %':>11}",
    ]
    for comparison in comparisons:
        row, paper, own = comparison.row, comparison.paper_layout, comparison.msjax_mesh
        paper_text = step_band(paper)
        own_text = f"{comparison.msjax_mesh_shape!s:>10} {step_band(own)}" if own else f"{'-':>10}"
        lines.append(
            f"{row.gpus:>5} {row.global_batch:>6} | "
            f"{row.megatron_s:>5.1f}s {100 * row.megatron_mfu:>5.1f}% "
            f"{row.megascale_s:>5.1f}s {100 * row.megascale_mfu:>5.1f}% | {paper_text} | "
            f"{own_text}"
        )
    lines.append(f"  (paper layout: {layout}, data the rest; msjax mesh: the config's)")
    lines.extend(_agreement(comparisons))
    return "\n".join(lines)


def _agreement(comparisons: list[Table2Comparison]) -> list[str]:
    """Where the paper-layout band holds the measured MFUs, and how the trends compare."""
    inside = {"Megatron-LM": 0, "MegaScale": 0}
    for comparison in comparisons:
        paper = comparison.paper_layout
        low, high = paper.mfu(paper.serial_s), paper.mfu(paper.overlapped_s)
        for name, measured in (
            ("Megatron-LM", comparison.row.megatron_mfu),
            ("MegaScale", comparison.row.megascale_mfu),
        ):
            inside[name] += low - 0.005 <= measured <= high + 0.005
    first, last = comparisons[0], comparisons[-1]

    def drop(prediction: StepPrediction, which: str) -> float:
        step = prediction.serial_s if which == "serial" else prediction.overlapped_s
        return 100 * prediction.mfu(step)

    count = len(comparisons)
    return [
        f"agreement: the paper-layout band holds Megatron-LM's MFU at {inside['Megatron-LM']} "
        f"of {count} sizes and MegaScale's at {inside['MegaScale']} of {count}.",
        f"trend {first.row.gpus} -> {last.row.gpus} GPUs: measured "
        f"{100 * first.row.megatron_mfu:.1f} -> {100 * last.row.megatron_mfu:.1f}% "
        f"(Megatron-LM), {100 * first.row.megascale_mfu:.1f} -> "
        f"{100 * last.row.megascale_mfu:.1f}% (MegaScale); predicted serial "
        f"{drop(first.paper_layout, 'serial'):.1f} -> {drop(last.paper_layout, 'serial'):.1f}%, "
        f"overlapped {drop(first.paper_layout, 'overlapped'):.1f} -> "
        f"{drop(last.paper_layout, 'overlapped'):.1f}%.",
    ]


def check_arguments(args: argparse.Namespace) -> None:
    """MsjaxError naming the first flag that cannot make a plan."""
    if args.devices is None and not args.predict:
        raise MsjaxError("--devices is required (or --predict alone for the Table 2 comparison)")
    if args.memory_gib is not None and not args.memory_gib > 0:
        raise MsjaxError(f"--memory-gib={args.memory_gib} must be positive")
    if args.top < 1:
        raise MsjaxError(f"--top={args.top} must be at least 1")
    if args.devices is not None and args.devices < 1:
        raise MsjaxError(f"--devices={args.devices} must be positive")
    if args.devices is not None and args.xla and args.devices > MAX_XLA_DEVICES:
        raise MsjaxError(
            f"--xla compiles on {args.devices} simulated CPU devices, more than "
            f"{MAX_XLA_DEVICES}; drop --xla (the analytical model needs no devices)"
        )


def plan_devices(
    args: argparse.Namespace, config: Config, hardware: Hardware, platform: str, stream: Any
) -> list[PlanRow]:
    """Print the ranked meshes of `--devices`, the recommendation and, on request, a lowering."""
    rows = plan_rows(config, args.devices, args.memory_gib, hardware, platform)
    if not rows:
        raise MsjaxError(
            f"no mesh of {args.devices} devices passes the config's checks (global batch "
            f"{config.train.global_batch}, heads {config.model.num_heads}, embed "
            f"{config.model.embed_dim}); try another device count"
        )
    own = mesh_of_config(config, args.devices, platform)
    shown = rows[: args.top]
    own_rows = [row for row in rows if row.mesh == own]
    if own_rows and own_rows[0] not in shown:
        shown.append(own_rows[0])
    params = count_params(config.model)
    print(
        f"plan: {args.config or 'defaults (tiny)'} on {args.devices} devices"
        + (f" with {args.memory_gib:g} GiB each" if args.memory_gib else "")
        + f"; {_human_count(params.total)} parameters, global batch "
        f"{config.train.global_batch} x {config.data.seq_len} tokens, remat "
        f"{config.model.remat}, {config.model.compute_dtype}, {platform} kernels; "
        f"{len(rows)} valid meshes, {len(shown)} shown",
        file=stream,
    )
    if args.xla:
        shown = add_xla_memory(config, shown, stream)
    print(format_plan(shown, own, args.memory_gib), file=stream)
    print(recommend(rows, args.memory_gib), file=stream)
    if args.lower:
        best, _ = choose(rows, args.memory_gib)
        print(describe_lowering(config, (best or rows[0]).mesh), file=stream)
    return rows


def describe_lowering(config: Config, mesh: MeshShape) -> str:
    """Lower the step for `mesh` for GPUs; JAX's state shard sizes beside the model's."""
    lowered = lower_on_abstract_mesh(config, mesh, PLANNED_BACKEND)
    modelled = estimate_memory(config, mesh, PLANNED_BACKEND).state_bytes
    return (
        f"lowered the train step for {mesh} on an abstract {mesh.devices}-device mesh "
        f"({lowered.platform}) in {lowered.lower_s:.1f} s; JAX's shardings put "
        f"{lowered.state_bytes_per_device / GIB:.3f} GiB of parameters and optimizer state on "
        f"each device (the model: {modelled / GIB:.3f} GiB). Compiling needs the devices, so the "
        "rest of the memory is the model's."
    )


def run_plan(args: argparse.Namespace, stream: Any = None) -> list[PlanRow]:
    """Validate, then print the plan (and the prediction); returns the ranked rows."""
    stream = stream if stream is not None else sys.stdout
    config = load_config(args.config, args.overrides)
    hardware = hardware_from(args, config)
    check_arguments(args)
    if args.xla and args.devices is not None:
        configure_cpu_devices(args.devices)  # before anything starts JAX's backend
    platform = args.platform or ("cpu" if args.xla else PLANNED_BACKEND)
    config = dataclasses.replace(config, model=resolve_model(config.model, platform))
    rows: list[PlanRow] = []
    if args.devices is not None:
        rows = plan_devices(args, config, hardware, platform, stream)
    if args.predict:
        print("", file=stream)
        print(format_table2(config, hardware), file=stream)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; 0 on success, 2 (one line on stderr) on a user mistake."""
    try:
        args = _parser().parse_intermixed_args(argv)
        run_plan(args)
    except MsjaxError as error:
        return user_error(_PROG, error)
    return 0
