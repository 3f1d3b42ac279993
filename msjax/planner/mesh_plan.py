"""The plan for N devices: every mesh that can run a config, with the model's memory, traffic and
predicted step, ranked; XLA's memory beside it on request; the choice and the table that show it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from msjax.config import Config
from msjax.planner.aot import compile_step
from msjax.planner.candidates import PLANNED_BACKEND, MeshShape, valid_meshes
from msjax.planner.communication import CommEstimate, estimate_communication
from msjax.planner.compute import estimate_compute
from msjax.planner.planning import MemoryEstimate, estimate_memory
from msjax.planner.prediction import Hardware, StepPrediction, predict_mesh_step

GIB = 2**30
MIB = 2**20
HEADROOM = 0.9  # recommend meshes that leave 10% free: the model is held to 10% of XLA


@dataclass(frozen=True)
class PlanRow:
    """One candidate mesh: the model's memory, traffic and work, a predicted step, and XLA's
    memory and work."""

    mesh: MeshShape
    memory: MemoryEstimate
    comm: CommEstimate
    prediction: StepPrediction
    fits: bool | None
    work_ratio: float  # planned compiled FLOPs / model FLOPs (msjax.planner.compute)
    xla_total_bytes: int | None = None
    xla_work_ratio: float | None = None  # the compiled step's dot FLOPs / model FLOPs


def plan_rows(
    config: Config,
    devices: int,
    memory_gib: float | None,
    hardware: Hardware,
    platform: str = PLANNED_BACKEND,
) -> list[PlanRow]:
    """Every valid mesh of `devices`, fitting ones first, then by predicted (serial) step time."""
    rows = []
    for mesh in valid_meshes(config, devices, platform):
        memory = estimate_memory(config, mesh, platform)
        fits = None if memory_gib is None else memory.total_bytes <= memory_gib * GIB
        prediction = predict_mesh_step(config, mesh, hardware)
        comm = estimate_communication(config, mesh)
        work = estimate_compute(config, mesh, platform).ratio
        rows.append(PlanRow(mesh, memory, comm, prediction, fits, work))
    return sorted(rows, key=lambda row: (row.fits is False, row.prediction.serial_s))


def add_xla_memory(config: Config, rows: list[PlanRow], stream: Any) -> list[PlanRow]:
    """Rows with XLA's per-device total and the compiled step's dot FLOPs over the model's,
    from compiling each mesh here (simulated devices)."""
    checked = []
    for index, row in enumerate(rows, 1):
        step = compile_step(config, row.mesh)
        total = step.memory.total_bytes if step.memory else None
        work = step.flops.total * row.mesh.devices / row.prediction.model_flops
        checked.append(dataclasses.replace(row, xla_total_bytes=total, xla_work_ratio=work))
        ratio = f"model/XLA {row.memory.total_bytes / total:.3f}" if total else "no analysis"
        print(
            f"  [{index}/{len(rows)}] compiled {row.mesh} in {step.compile_s:.1f} s: {ratio}; "
            f"compiled/model FLOPs {work:.3f} (plan {row.work_ratio:.3f})",
            file=stream,
            flush=True,
        )
    return checked


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
            f"{human_bytes(least.memory.total_bytes)}; set model.remat=full, lower "
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
        f"recommended: {best.mesh} ({best.mesh.describe()}), the shortest predicted step of "
        f"the {len(pool)} meshes{limit}: "
        f"{human_bytes(best.memory.total_bytes)} per device, {predicted.serial_s:.3g} s per "
        f"step if nothing overlaps ({predicted.compute_s:.3g} s of compute; the {costliest} "
        f"axis costs most, {predicted.comm_s[costliest]:.3g} s)."
    )


def format_plan(rows: list[PlanRow], own: MeshShape | None, memory_gib: float | None) -> str:
    """The table of meshes: memory by what holds it, bytes sent by axis, predicted step."""
    largest = max(row.memory.total_bytes for row in rows)
    unit, scale = ("GiB", GIB) if largest >= GIB else ("MiB", MIB)
    with_xla = any(row.xla_total_bytes is not None for row in rows)
    mesh_title = "mesh d,f,t" if all(row.mesh.pipe == 1 for row in rows) else "mesh d,f[,p],t"
    with_experts = any(row.mesh.expert > 1 for row in rows)
    header = (
        f"{mesh_title:>14}"
        + (f" {'expert':>6}" if with_experts else "")
        + f" {'state':>8} {'grads':>8} {'activ.':>8} {'working':>8} {'total':>8} {'fits':>4}"
        + (f" {'XLA':>8} {'ratio':>6} {'work':>5} {'XLA':>5}" if with_xla else "")
        + f" | {'tensor':>8} {'fsdp':>8}"
        + (f" {'expert':>8}" if with_experts else "")
        + f" {'pipe':>8} {'data':>8} | {'step s':>19} {'MFU %':>11}"
    )
    lines = [
        f"per device, {unit}: memory (model) and bytes sent per step by axis (ring); step time "
        "serial..overlapped",
        header,
        *(_plan_line(row, own, scale, with_xla, with_experts) for row in rows),
    ]
    notes = ["state: parameters + optimizer moments (float32)"]
    if with_xla:
        notes.append(
            "ratio: model/XLA memory; work: compiled FLOPs / model FLOPs, planned and XLA's "
            "(dots per device x devices, recomputation and pipeline bubbles included)"
        )
    if own is not None:
        notes.append("*: the config's own mesh")
    if memory_gib is not None:
        notes.append(f"fits: total <= {memory_gib:g} GiB")
    lines.append(f"  ({'; '.join(notes)})")
    return "\n".join(lines)


def _plan_line(
    row: PlanRow, own: MeshShape | None, scale: int, with_xla: bool, with_experts: bool = False
) -> str:
    """One mesh's row of `format_plan`; with_experts: the expert size and traffic columns."""
    memory, comm = row.memory, row.comm
    fits = "-" if row.fits is None else ("yes" if row.fits else "NO")
    label = f"{row.mesh}{'*' if row.mesh == own else ''}"
    if with_experts:
        label = f"{label:>14} {row.mesh.expert:>6}"
    xla = ""
    if with_xla:
        total = row.xla_total_bytes
        xla = (
            f" {total / scale:>8.2f} {memory.total_bytes / total:>6.3f}"
            if total
            else f" {'-':>8} {'-':>6}"
        )
        xla += f" {row.work_ratio:>5.2f} {row.xla_work_ratio or 0:>5.2f}"
    sizes = [
        memory.state_bytes,
        memory.gradients_bytes,
        memory.activations_bytes,
        memory.working_bytes,
        memory.total_bytes,
    ]
    traffic = [comm.tensor_bytes, comm.fsdp_bytes, comm.pipe_bytes, comm.data_bytes]
    if with_experts:
        traffic.insert(2, comm.expert_bytes)
    return (
        f"{label:>14} "
        + " ".join(f"{size / scale:>8.2f}" for size in sizes)
        + f" {fits:>4}{xla} | "
        + " ".join(f"{size / scale:>8.2f}" for size in traffic)
        + f" | {step_band(row.prediction)}"
    )


def step_band(prediction: StepPrediction) -> str:
    """Step seconds and MFU %, each as serial..overlapped, in the tables' column widths."""
    serial, overlapped = prediction.serial_s, prediction.overlapped_s
    return (
        f"{f'{serial:.3g}..{overlapped:.3g}':>19} "
        f"{f'{100 * prediction.mfu(serial):.1f}..{100 * prediction.mfu(overlapped):.1f}':>11}"
    )


def human_bytes(size: float) -> str:
    return f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / MIB:.1f} MiB"
