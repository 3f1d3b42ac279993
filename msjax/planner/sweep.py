"""`python -m msjax.sweep`: compile and run the train step on several meshes and compare them.

For each mesh (data,fsdp,tensor): XLA's per-device memory, the collectives in the compiled step
and their bytes, its dot FLOPs over the model FLOPs (beside the planner's figure), and the
measured step time on synthetic tokens. A mesh of k devices runs on the
first k devices: k must be the device count or divide it (1,1,1 among eight is a baseline).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from msjax.cli import ArgumentParser, user_error
from msjax.config import Config, load_config
from msjax.errors import ConfigError, MsjaxError
from msjax.observe.flops import flops_per_step
from msjax.parallel.mesh import configure_cpu_devices
from msjax.planner.aot import compile_step
from msjax.planner.candidates import MeshShape, config_for_mesh, parse_mesh, valid_meshes
from msjax.planner.compute import estimate_compute
from msjax.planner.planning import estimate_memory
from msjax.resolve import RUNS_FOLDER, default_run_dir, mesh_device_count, resolve_model

_PROG = "msjax.sweep"
MIB = 2**20
GIB = 2**30
DEFAULT_CPU_DEVICES = 8  # what a -1 mesh axis counts as when simulating CPU devices


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=f"python -m {_PROG}",
        description="Compile and run the train step on several meshes; compare memory, "
        "collectives and speed.",
        epilog='example: python -m msjax.sweep --config configs/tiny.yaml --meshes "8,1,1 2,2,2"',
    )
    parser.add_argument("--config", help="YAML config (default: the built-in tiny config)")
    parser.add_argument(
        "--meshes",
        default="auto",
        help="meshes separated by spaces: data,fsdp,tensor (pipe 1) or data,fsdp,pipe,tensor; "
        'or "auto": every factorisation of the device count that the config accepts, pipe '
        "sizes too when the config's mesh.pipe is not 1 (default: auto)",
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mesh (default 5)")
    parser.add_argument(
        "--memory-gib",
        type=float,
        help="per-device memory; meshes that need more are marked and not run",
    )
    parser.add_argument(
        "--out", type=Path, help=f"output folder (default {RUNS_FOLDER}/sweep-NAME-TIME)"
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser


@dataclass
class SweepRow:
    """One mesh's results; speed fields stay None when the mesh was not run."""

    mesh: MeshShape
    compile_s: float
    memory: dict[str, int]  # XLA: argument/output/alias/temp/total bytes per device
    model_memory_bytes: int  # msjax.planner.planning's estimate, for comparison
    collectives: dict[str, dict[str, int]]
    fits: bool | None
    work_ratio: float = 0.0  # the compiled step's dot FLOPs (all devices) / model FLOPs
    planned_work_ratio: float = 0.0  # msjax.planner.compute's figure for it
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    losses: list[float] = field(default_factory=list)

    @property
    def collective_bytes(self) -> int:
        return sum(kind["result_bytes"] for kind in self.collectives.values())

    @property
    def collective_executions(self) -> int:
        return sum(kind["executions"] for kind in self.collectives.values())

    def record(self) -> dict[str, Any]:
        return {
            "mesh": str(self.mesh),
            **self.mesh.sizes(),
            "devices": self.mesh.devices,
            "compile_s": self.compile_s,
            "memory": self.memory,
            "model_memory_bytes": self.model_memory_bytes,
            "collectives": self.collectives,
            "collective_executions": self.collective_executions,
            "collective_bytes": self.collective_bytes,
            "fits": self.fits,
            "work_ratio": self.work_ratio,
            "planned_work_ratio": self.planned_work_ratio,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "losses": self.losses,
        }


def resolve_meshes(text: str, config: Config, device_count: int) -> list[MeshShape]:
    """The meshes to sweep, every one checked before any compile (MsjaxError on the first bad)."""
    backend = jax.default_backend()  # the sweep compiles and runs here
    if text.strip() == "auto":
        meshes = valid_meshes(config, device_count, backend)
        if not meshes:
            raise MsjaxError(f"no factorisation of {device_count} devices passes the config checks")
        return meshes
    meshes: list[MeshShape] = []
    for word in text.replace(";", " ").split():
        mesh = parse_mesh(word)
        if mesh.devices > device_count or device_count % mesh.devices:
            raise MsjaxError(
                f"mesh {mesh} (data,fsdp,tensor) uses {mesh.devices} devices but {device_count} "
                f"are available; use all {device_count} or a divisor of {device_count} (a "
                "smaller mesh runs on the first devices)"
            )
        config_for_mesh(config, mesh, backend)  # ConfigError names the mesh and the failed check
        if mesh not in meshes:
            meshes.append(mesh)
    if not meshes:
        raise MsjaxError(
            "--meshes is empty; give data,fsdp,tensor or data,fsdp,pipe,tensor meshes, or 'auto'"
        )
    return meshes


def synthetic_batch(config: Config, seed: int = 0) -> dict[str, Any]:
    """One global batch of random tokens: the step's speed does not depend on their values."""
    rng = np.random.default_rng(seed)
    shape = (config.train.global_batch, config.data.seq_len)
    tokens = rng.integers(0, config.model.vocab_size, size=(shape[0], shape[1] + 1))
    return {
        "inputs": tokens[:, :-1].astype(np.int32),  # [batch, seq]
        "targets": tokens[:, 1:].astype(np.int32),
        "positions": np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape).copy(),
        "segment_ids": np.ones(shape, np.int32),
    }


def measure_mesh(config: Config, mesh: MeshShape, steps: int, memory_gib: float | None) -> SweepRow:
    """Compile on the first mesh.devices devices, then (if it fits) time `steps` steps."""
    step = compile_step(config, mesh)
    memory = step.memory
    memory_record = {}
    if memory is not None:
        memory_record = {**dataclasses.asdict(memory), "total_bytes": memory.total_bytes}
    fits = None
    if memory_gib is not None and memory is not None:
        fits = memory.total_bytes <= memory_gib * GIB
    row = SweepRow(
        mesh=mesh,
        compile_s=step.compile_s,
        memory=memory_record,
        model_memory_bytes=estimate_memory(config, mesh, jax.default_backend()).total_bytes,
        collectives={
            kind: {"ops": s.ops, "executions": s.executions, "result_bytes": s.result_bytes}
            for kind, s in step.collectives.items()
        },
        fits=fits,
        work_ratio=step.flops.total * mesh.devices / flops_per_step(step.config),
        planned_work_ratio=estimate_compute(config, mesh, jax.default_backend()).ratio,
    )
    if fits is False:
        return row
    state = step.program.init_state()
    batch = jax.device_put(synthetic_batch(config), step.program.batch_sharding)
    state, metrics = step.compiled(state, batch)  # warm-up: first run allocates and loads
    jax.block_until_ready((state, metrics))
    times_s = []
    for _ in range(steps):
        started = time.perf_counter()
        state, metrics = step.compiled(state, batch)
        jax.block_until_ready((state, metrics))
        times_s.append(time.perf_counter() - started)
        row.losses.append(float(metrics["loss"]))
    del state
    row.step_time_s = statistics.median(times_s)
    row.tokens_per_s = config.train.global_batch * config.data.seq_len / row.step_time_s
    return row


def sort_by_speed(rows: list[SweepRow]) -> list[SweepRow]:
    """Fastest first; meshes that were not run last, smallest memory first."""
    return sorted(
        rows,
        key=lambda row: (
            row.tokens_per_s is None,
            -(row.tokens_per_s or 0.0),
            row.memory.get("total_bytes", 0),
        ),
    )


def format_table(rows: list[SweepRow], device_count: int, memory_gib: float | None) -> str:
    header = (
        f"{'mesh d,f,t':>11} {'devices':>7} {'XLA MiB/dev':>11} {'model MiB':>9} "
        f"{'fits':>5} {'collectives':>11} {'coll MiB':>9} {'work':>5} {'plan':>5} "
        f"{'compile s':>9} {'step ms':>9} {'tokens/s':>10}"
    )
    lines = [header]
    for row in rows:
        total = row.memory.get("total_bytes")
        fits = "-" if row.fits is None else ("yes" if row.fits else "NO")
        devices = f"{row.mesh.devices}" + ("" if row.mesh.devices == device_count else "*")
        lines.append(
            f"{row.mesh!s:>11} {devices:>7} "
            f"{'?' if total is None else f'{total / MIB:.1f}':>11} "
            f"{row.model_memory_bytes / MIB:>9.1f} {fits:>5} {row.collective_executions:>11} "
            f"{row.collective_bytes / MIB:>9.2f} {row.work_ratio:>5.2f} "
            f"{row.planned_work_ratio:>5.2f} {row.compile_s:>9.1f} "
            f"{'-' if row.step_time_s is None else f'{1e3 * row.step_time_s:.1f}':>9} "
            f"{'not run' if row.tokens_per_s is None else f'{row.tokens_per_s:,.0f}':>10}"
        )
    notes = [
        "collectives: executions per step (loop bodies once per layer); MiB of results",
        "work: compiled dot FLOPs / model FLOPs (plan: the planner's figure)",
    ]
    if any(row.mesh.devices != device_count for row in rows):
        notes.append(f"*: a baseline on the first devices, not all {device_count}")
    if memory_gib is not None:
        notes.append(f"fits: XLA's per-device total <= {memory_gib:g} GiB; NO rows were not run")
    return "\n".join([*lines, f"  ({'; '.join(notes)})"])


def recommend(rows: list[SweepRow], device_count: int, memory_gib: float | None) -> str:
    """Which mesh to use and why, in a sentence or two."""
    full = [row for row in rows if row.mesh.devices == device_count]
    ran = [row for row in full if row.tokens_per_s is not None]
    limit = f" and fit {memory_gib:g} GiB" if memory_gib is not None else ""
    if not ran:
        needs = min(full or rows, key=lambda row: row.memory.get("total_bytes", 0))
        return (
            f"no mesh on all {device_count} devices{limit}: the smallest, {needs.mesh}, needs "
            f"{needs.memory.get('total_bytes', 0) / GIB:.2f} GiB per device; raise fsdp, "
            "lower train.global_batch or set model.remat=full"
        )
    best = max(ran, key=lambda row: row.tokens_per_s or 0.0)
    slowest = min(ran, key=lambda row: row.tokens_per_s or 0.0)
    text = (
        f"recommended: {best.mesh} ({best.mesh.describe()}), the fastest of {len(ran)} meshes "
        f"that use all {device_count} "
        f"devices{limit}: {best.tokens_per_s:,.0f} tokens/s"
    )
    if len(ran) > 1:
        text += f", {best.tokens_per_s / slowest.tokens_per_s:.2f}x the slowest ({slowest.mesh})"
    text += (
        f"; {best.memory.get('total_bytes', 0) / MIB:.1f} MiB per device and "
        f"{best.collective_bytes / MIB:.2f} MiB of collectives per step"
    )
    smaller = [row for row in ran if row.memory.get("total_bytes", 0) < 0.8 * _total(best)]
    if smaller:
        lean = min(smaller, key=_total)
        text += (
            f". If memory is tight, {lean.mesh} needs {_total(lean) / MIB:.1f} MiB at "
            f"{lean.tokens_per_s / best.tokens_per_s:.0%} of the speed"
        )
    return text + "."


def _total(row: SweepRow) -> int:
    return row.memory.get("total_bytes", 0)


def write_chart(rows: list[SweepRow], path: Path, memory_gib: float | None) -> Path | None:
    """Bars per mesh: tokens/s, memory per device, collective bytes; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = [str(row.mesh) for row in rows]
    figure, axes = plt.subplots(1, 3, figsize=(13, 0.45 * len(rows) + 1.8), sharey=True)
    panels = [
        ("tokens/s", [row.tokens_per_s or 0.0 for row in rows]),
        ("MiB per device (XLA)", [_total(row) / MIB for row in rows]),
        ("collective MiB per step", [row.collective_bytes / MIB for row in rows]),
    ]
    over_limit = ["#c03030" if row.fits is False else "#4878a8" for row in rows]
    for axis, (title, values) in zip(axes, panels, strict=True):
        axis.barh(labels, values, color=over_limit if "MiB per device" in title else "#4878a8")
        axis.set_title(title)
        axis.invert_yaxis()
        axis.grid(axis="x", alpha=0.3)
    for position, row in enumerate(rows):
        if row.tokens_per_s is None:
            axes[0].text(0, position, "  not run (does not fit)", va="center", fontsize=9)
    if memory_gib is not None:
        axes[1].axvline(memory_gib * GIB / MIB, color="#c03030", linestyle="--", label="limit")
        axes[1].legend(loc="lower right")
    axes[0].set_ylabel("mesh data,fsdp,tensor")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def cpu_devices_wanted(meshes_text: str, config: Config) -> int:
    """The CPU devices to simulate: the largest mesh asked for, else the config's mesh size."""
    explicit = [parse_mesh(word).devices for word in meshes_text.split() if word != "auto"]
    return max(explicit) if explicit else mesh_device_count(config.mesh, DEFAULT_CPU_DEVICES)


def run_sweep(args: argparse.Namespace, stream: Any = None) -> list[SweepRow]:
    """Validate everything, then measure each mesh and write the outputs; returns rows by speed."""
    stream = stream if stream is not None else sys.stdout
    config = load_config(args.config, args.overrides)
    if args.steps < 1:
        raise MsjaxError(f"--steps={args.steps} must be at least 1")
    if args.memory_gib is not None and not args.memory_gib > 0:
        raise MsjaxError(f"--memory-gib={args.memory_gib} must be positive")
    configure_cpu_devices(cpu_devices_wanted(args.meshes, config))  # before JAX's backend starts
    platform = jax.default_backend()
    config = dataclasses.replace(config, model=resolve_model(config.model, platform))
    device_count = jax.device_count()
    meshes = resolve_meshes(args.meshes, config, device_count)
    out = args.out or default_run_dir(f"sweep-{config.run.name}")
    if out.exists() and not out.is_dir():
        raise MsjaxError(f"--out {out} exists and is not a folder")
    print(
        f"sweep: {args.config or 'defaults (tiny)'}, {len(meshes)} meshes on {device_count} "
        f"{platform} devices, {args.steps} timed steps each; outputs in {out}",
        file=stream,
        flush=True,
    )
    rows = []
    for index, mesh in enumerate(meshes, 1):
        try:
            row = measure_mesh(config, mesh, args.steps, args.memory_gib)
        except ConfigError as error:
            raise MsjaxError(str(error)) from None
        rows.append(row)
        speed = (
            "does not fit, not run"
            if row.tokens_per_s is None
            else f"{1e3 * (row.step_time_s or 0):.1f} ms/step, {row.tokens_per_s:,.0f} tokens/s"
        )
        print(
            f"[{index}/{len(meshes)}] {mesh}: compiled in {row.compile_s:.1f} s, "
            f"{_total(row) / MIB:.1f} MiB/device, {row.collective_executions} collectives "
            f"({row.collective_bytes / MIB:.2f} MiB), compiled/model FLOPs "
            f"{row.work_ratio:.3f} (plan {row.planned_work_ratio:.3f}), {speed}",
            file=stream,
            flush=True,
        )
    rows = sort_by_speed(rows)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "sweep.jsonl").open("w") as jsonl:
        for row in rows:
            jsonl.write(json.dumps(row.record()) + "\n")
    chart = write_chart(rows, out / "sweep.png", args.memory_gib)
    print("\n" + format_table(rows, device_count, args.memory_gib), file=stream)
    print("\n" + recommend(rows, device_count, args.memory_gib), file=stream)
    if platform == "cpu":
        print(
            "note: simulated CPU devices share the host's cores, so times show partitioning and "
            "collective overhead, not what accelerators would do",
            file=stream,
        )
    written = "sweep.jsonl" + (", sweep.png" if chart else " (no chart: matplotlib is missing)")
    print(f"outputs in {out}: {written}", file=stream)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; 0 on success, 2 (one line on stderr) on a user mistake."""
    try:
        args = _parser().parse_intermixed_args(argv)
        run_sweep(args)
    except MsjaxError as error:
        return user_error(_PROG, error)
    return 0
