"""`python -m msjax.plan`: a dry run for a cluster you do not have: per-device memory and traffic
of every mesh that can run a config on N devices, a predicted step time, and MegaScale's Table 2.

Memory and communication come from the analytical model (`msjax.parallel.planning`); `--xla`
compiles each mesh on simulated CPU devices to set XLA's numbers beside it (small N only);
`--lower` lowers the step on an abstract mesh of N devices, which JAX allows without them.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType

from msjax.cli import ArgumentParser, user_error
from msjax.config import Config, load_config
from msjax.errors import MsjaxError
from msjax.observe.flops import count_params
from msjax.parallel.aot import abstract_batch, compile_step
from msjax.parallel.candidates import MeshShape, config_for_mesh, mesh_of_config, valid_meshes
from msjax.parallel.mesh import MESH_AXES
from msjax.parallel.planning import (
    CommEstimate,
    MemoryEstimate,
    estimate_communication,
    estimate_memory,
)
from msjax.parallel.prediction import (
    Hardware,
    StepPrediction,
    compare_with_table2,
    predict_mesh_step,
)
from msjax.step import build_program

_PROG = "msjax.plan"
GIB = 2**30
MIB = 2**20
MAX_XLA_DEVICES = 64  # --xla simulates this many CPU devices at most
HEADROOM = 0.9  # recommend meshes that leave 10% free: the model is held to 10% of XLA


def _parser() -> argparse.ArgumentParser:
    defaults = Hardware()
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
        "flash-attention kernel on gpu); default gpu, or cpu with --xla",
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
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser


@dataclass(frozen=True)
class PlanRow:
    """One candidate mesh: the model's memory and traffic, a predicted step, XLA's memory."""

    mesh: MeshShape
    memory: MemoryEstimate
    comm: CommEstimate
    prediction: StepPrediction
    fits: bool | None
    xla_total_bytes: int | None = None


def hardware_from(args: argparse.Namespace, config: Config) -> Hardware:
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


def plan_rows(
    config: Config,
    devices: int,
    memory_gib: float | None,
    hardware: Hardware,
    platform: str = "gpu",
) -> list[PlanRow]:
    """Every valid mesh of `devices`, fitting ones first, then by predicted (serial) step time."""
    rows = []
    for mesh in valid_meshes(config, devices):
        memory = estimate_memory(config, mesh, platform)
        fits = None if memory_gib is None else memory.total_bytes <= memory_gib * GIB
        prediction = predict_mesh_step(config, mesh, hardware)
        rows.append(PlanRow(mesh, memory, estimate_communication(config, mesh), prediction, fits))
    return sorted(rows, key=lambda row: (row.fits is False, row.prediction.serial_s))


def add_xla_memory(config: Config, rows: list[PlanRow], stream: Any) -> list[PlanRow]:
    """Rows with XLA's per-device total from compiling each mesh here (simulated devices)."""
    checked = []
    for index, row in enumerate(rows, 1):
        step = compile_step(config, row.mesh)
        total = step.memory.total_bytes if step.memory else None
        checked.append(PlanRow(row.mesh, row.memory, row.comm, row.prediction, row.fits, total))
        ratio = f"model/XLA {row.memory.total_bytes / total:.3f}" if total else "no analysis"
        print(
            f"  [{index}/{len(rows)}] compiled {row.mesh} in {step.compile_s:.1f} s: {ratio}",
            file=stream,
            flush=True,
        )
    return checked


def format_plan(rows: list[PlanRow], own: MeshShape | None, memory_gib: float | None) -> str:
    largest = max(row.memory.total_bytes for row in rows)
    unit, scale = ("GiB", GIB) if largest >= GIB else ("MiB", MIB)
    with_xla = any(row.xla_total_bytes is not None for row in rows)
    header = (
        f"{'mesh d,f,t':>13} {'state':>8} {'grads':>8} {'activ.':>8} {'working':>8} "
        f"{'total':>8} {'fits':>4}"
        + (f" {'XLA':>8} {'ratio':>6}" if with_xla else "")
        + f" | {'tensor':>8} {'fsdp':>8} {'data':>8} | {'step s':>19} {'MFU %':>11}"
    )
    lines = [
        f"per device, {unit}: memory (model) and bytes sent per step by axis (ring); step time "
        "serial..overlapped",
        header,
    ]
    for row in rows:
        memory, comm, predicted = row.memory, row.comm, row.prediction
        fits = "-" if row.fits is None else ("yes" if row.fits else "NO")
        label = f"{row.mesh}{'*' if row.mesh == own else ''}"
        xla = ""
        if with_xla:
            total = row.xla_total_bytes
            xla = (
                f" {total / scale:>8.2f} {memory.total_bytes / total:>6.3f}"
                if total
                else f" {'-':>8} {'-':>6}"
            )
        sizes = [
            memory.state_bytes,
            memory.gradients_bytes,
            memory.activations_bytes,
            memory.working_bytes,
            memory.total_bytes,
        ]
        traffic = [comm.tensor_bytes, comm.fsdp_bytes, comm.data_bytes]
        lines.append(
            f"{label:>13} "
            + " ".join(f"{size / scale:>8.2f}" for size in sizes)
            + f" {fits:>4}{xla} | "
            + " ".join(f"{size / scale:>8.2f}" for size in traffic)
            + f" | {_band(predicted)}"
        )
    notes = ["state: parameters + optimizer moments (float32)"]
    if own is not None:
        notes.append("*: the config's own mesh")
    if memory_gib is not None:
        notes.append(f"fits: total <= {memory_gib:g} GiB")
    lines.append(f"  ({'; '.join(notes)})")
    return "\n".join(lines)


def choose(rows: list[PlanRow], memory_gib: float | None) -> tuple[PlanRow | None, list[PlanRow]]:
    """The fitting mesh with the shortest predicted step, and the meshes it was chosen from.

    Meshes that leave 10% of the memory free are preferred: the model is held to 10% of XLA.
    """
    fitting = [row for row in rows if row.fits is not False]
    if memory_gib is not None:
        roomy = [r for r in fitting if r.memory.total_bytes <= HEADROOM * memory_gib * GIB]
        fitting = roomy or fitting
    return (fitting[0] if fitting else None), fitting


def recommend(rows: list[PlanRow], memory_gib: float | None) -> str:
    """Which mesh to use and why, in a sentence."""
    best, pool = choose(rows, memory_gib)
    if best is None:
        least = min(rows, key=lambda row: row.memory.total_bytes)
        return (
            f"no mesh fits {memory_gib:g} GiB: the leanest, {least.mesh}, needs "
            f"{_human_bytes(least.memory.total_bytes)}; set model.remat=full, lower "
            "train.global_batch or add devices"
        )
    limit = ""
    if memory_gib is not None:
        roomy = all(r.memory.total_bytes <= HEADROOM * memory_gib * GIB for r in pool)
        limit = (
            f" that leave {1 - HEADROOM:.0%} of {memory_gib:g} GiB free"
            if roomy
            else f" that fit {memory_gib:g} GiB"
        )
    predicted = best.prediction
    costliest = max(predicted.comm_s, key=lambda axis: predicted.comm_s[axis])
    return (
        f"recommended: {best.mesh} (data {best.mesh.data} x fsdp {best.mesh.fsdp} x tensor "
        f"{best.mesh.tensor}), the shortest predicted step of the {len(pool)} meshes{limit}: "
        f"{_human_bytes(best.memory.total_bytes)} per device, {predicted.serial_s:.3g} s per "
        f"step if nothing overlaps ({predicted.compute_s:.3g} s of compute; the {costliest} "
        f"axis costs most, {predicted.comm_s[costliest]:.3g} s)."
    )


def _human_count(count: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return f"{count:.0f}"


def _human_bytes(size: float) -> str:
    return f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / MIB:.1f} MiB"


def lower_on_abstract_mesh(config: Config, mesh: MeshShape, platform: str = "cuda") -> str:
    """Trace and lower the step for `mesh` with no devices: the program and its shardings hold.

    JAX lowers for an `AbstractMesh` when given a platform; compiling needs real devices (a
    device assignment), so XLA's memory analysis is out of reach and the model's numbers stand.
    The state's shard sizes from JAX's own shardings are set beside the model's.
    """
    config = config_for_mesh(config, mesh)
    sizes = tuple(mesh.sizes()[axis] for axis in MESH_AXES)
    abstract = AbstractMesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(sizes))
    started = time.perf_counter()
    program = build_program(config, abstract)  # type: ignore[arg-type]
    state = program.abstract_state()
    # Raises if the step does not trace or its shardings do not fit this mesh.
    program.train_step.trace(state, abstract_batch(program)).lower(lowering_platforms=(platform,))
    lower_s = time.perf_counter() - started
    state_bytes = sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(state)
    )
    modelled = estimate_memory(config, mesh).state_bytes
    return (
        f"lowered the train step for {mesh} on an abstract {mesh.devices}-device mesh "
        f"({platform}) in {lower_s:.1f} s; JAX's shardings put {state_bytes / GIB:.3f} GiB of "
        f"parameters and optimizer state on each device (the model: {modelled / GIB:.3f} GiB). "
        "Compiling needs the devices, so the rest of the memory is the model's."
    )


def format_table2(config: Config, hardware: Hardware) -> str:
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
        paper_text = _band(paper)
        own_text = f"{comparison.msjax_mesh_shape!s:>10} {_band(own)}" if own else f"{'-':>10}"
        lines.append(
            f"{row.gpus:>5} {row.global_batch:>6} | "
            f"{row.megatron_s:>5.1f}s {100 * row.megatron_mfu:>5.1f}% "
            f"{row.megascale_s:>5.1f}s {100 * row.megascale_mfu:>5.1f}% | {paper_text} | "
            f"{own_text}"
        )
    lines.append(f"  (paper layout: {layout}, data the rest; msjax mesh: the config's)")
    lines.extend(_agreement(comparisons))
    return "\n".join(lines)


def _band(prediction: StepPrediction) -> str:
    serial, overlapped = prediction.serial_s, prediction.overlapped_s
    return (
        f"{f'{serial:.3g}..{overlapped:.3g}':>19} "
        f"{f'{100 * prediction.mfu(serial):.1f}..{100 * prediction.mfu(overlapped):.1f}':>11}"
    )


def _agreement(comparisons: list[Any]) -> list[str]:
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


def _configure_cpu_devices(devices: int) -> None:
    """Before JAX starts: simulate `devices` CPU devices for --xla (unless the env decides)."""
    if os.environ.get("JAX_NUM_CPU_DEVICES"):
        return
    with contextlib.suppress(RuntimeError):  # the backend already started: use its devices
        jax.config.update("jax_num_cpu_devices", devices)


def run_plan(args: argparse.Namespace, stream: Any = None) -> list[PlanRow]:
    """Validate, then print the plan (and the prediction); returns the ranked rows."""
    stream = stream if stream is not None else sys.stdout
    config = load_config(args.config, args.overrides)
    hardware = hardware_from(args, config)
    if args.devices is None and not args.predict:
        raise MsjaxError("--devices is required (or --predict alone for the Table 2 comparison)")
    if args.memory_gib is not None and not args.memory_gib > 0:
        raise MsjaxError(f"--memory-gib={args.memory_gib} must be positive")
    if args.top < 1:
        raise MsjaxError(f"--top={args.top} must be at least 1")
    rows: list[PlanRow] = []
    if args.devices is not None:
        if args.devices < 1:
            raise MsjaxError(f"--devices={args.devices} must be positive")
        if args.xla and args.devices > MAX_XLA_DEVICES:
            raise MsjaxError(
                f"--xla compiles on {args.devices} simulated CPU devices, more than "
                f"{MAX_XLA_DEVICES}; drop --xla (the analytical model needs no devices)"
            )
        if args.xla:
            _configure_cpu_devices(args.devices)  # before anything starts JAX's backend
        platform = args.platform or ("cpu" if args.xla else "gpu")
        rows = plan_rows(config, args.devices, args.memory_gib, hardware, platform)
        if not rows:
            raise MsjaxError(
                f"no mesh of {args.devices} devices passes the config's checks (global batch "
                f"{config.train.global_batch}, heads {config.model.num_heads}, embed "
                f"{config.model.embed_dim}); try another device count"
            )
        own = mesh_of_config(config, args.devices)
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
            print(lower_on_abstract_mesh(config, (best or rows[0]).mesh), file=stream)
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


if __name__ == "__main__":
    raise SystemExit(main())
