"""Pictures of a run: the rank x step heat map of per-rank work time (as text and as a PNG), and
PNG charts of loss, throughput and MFU, and the goodput breakdown. Reading the run dir is
msjax.report's job; these functions take the numbers.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SHADES = " .:-=+*#%@"
MISSING = "?"  # a rank-step with no record
FLAGGED = "!"  # after a row: that rank was flagged as a straggler


@dataclass(frozen=True)
class RankRow:
    """One rank as ranks.jsonl's header describes it."""

    rank: int
    host: str
    mesh: dict[str, list[int]]  # mesh axis -> the indices this rank's devices occupy


@dataclass(frozen=True)
class HeatMap:
    """Work seconds per rank and step; rows in mesh order, split into groups along one axis."""

    rows: list[RankRow]  # in display order
    steps: list[int]  # the recorded steps, ascending
    work_s: np.ndarray  # [rows, steps], NaN where a rank has no record
    group_axis: str | None  # the outermost mesh axis whose coordinates differ between rows
    group_starts: list[int]  # row indices where a new group of group_axis begins (not 0)
    vmin: float
    vmax: float  # colour scale top: warm-up steps excluded, so compilation does not wash it out
    flagged: frozenset[int]  # ranks flagged as stragglers

    @classmethod
    def build(
        cls,
        rows: Sequence[RankRow],
        work_by_step: dict[int, Sequence[float | None]],
        warmup_steps: set[int],
        flagged: set[int] = frozenset(),
    ) -> HeatMap:
        """rows: every rank (any order); work_by_step: step -> work_s by rank index."""
        axes = _axes(rows)
        ordered = sorted(rows, key=lambda row: ([row.mesh.get(a, []) for a in axes], row.rank))
        steps = sorted(work_by_step)
        work_s = np.full((len(ordered), len(steps)), np.nan)  # [ranks, steps]
        for column, step in enumerate(steps):
            values = work_by_step[step]
            for index, row in enumerate(ordered):
                if row.rank < len(values) and values[row.rank] is not None:
                    work_s[index, column] = float(values[row.rank])
        group_axis = next(
            (a for a in axes if len({tuple(row.mesh.get(a, [])) for row in ordered}) > 1), None
        )
        group_starts = []
        if group_axis is not None:
            group_starts = [
                index
                for index in range(1, len(ordered))
                if ordered[index].mesh.get(group_axis) != ordered[index - 1].mesh.get(group_axis)
            ]
        finite = work_s[np.isfinite(work_s)]
        warm = np.array([step not in warmup_steps for step in steps], dtype=bool)
        steady = work_s[:, warm]
        steady = steady[np.isfinite(steady)]
        scale = steady if steady.size else finite
        vmin = float(finite.min()) if finite.size else 0.0
        vmax = float(scale.max()) if scale.size else 1.0
        return cls(
            list(ordered),
            steps,
            work_s,
            group_axis,
            group_starts,
            vmin,
            max(vmax, vmin),
            frozenset(flagged),
        )

    def label(self, row: RankRow) -> str:
        """`r3 d1 f0-1 t0`: rank and mesh coordinates, one letter per axis when they differ."""
        axes = _axes(self.rows)
        short = len({a[0] for a in axes}) == len(axes)
        coordinates = " ".join(
            f"{a[0] if short else a + '='}{_indices(row.mesh.get(a, []))}" for a in axes
        )
        return f"r{row.rank} {coordinates}".strip()


def _axes(rows: Sequence[RankRow]) -> list[str]:
    """Mesh axes in the order the header lists them (outermost first)."""
    axes: list[str] = []
    for row in rows:
        axes.extend(a for a in row.mesh if a not in axes)
    return axes


def _indices(values: Sequence[int]) -> str:
    """[0] -> 0, [0, 1, 2] -> 0-2, [0, 2] -> 0,2."""
    values = sorted(values)
    if not values:
        return "?"
    if len(values) > 1 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(str(v) for v in values)


# --- text ----------------------------------------------------------------------------------


def text_heatmap(heatmap: HeatMap, width: int = 80) -> list[str]:
    """Lines of a terminal heat map: one row per rank, steps binned into columns to fit width."""
    labels = [heatmap.label(row) for row in heatmap.rows]
    label_width = max(len(label) for label in labels)
    columns = max(min(len(heatmap.steps), width - label_width - 5), 1)
    per_column = math.ceil(len(heatmap.steps) / columns)
    columns = math.ceil(len(heatmap.steps) / per_column)
    first, last = heatmap.steps[0], heatmap.steps[-1]
    lines = [
        f"steps {first}-{last} ({len(heatmap.steps)} recorded), "
        + ("1 step" if per_column == 1 else f"{per_column} steps (mean)")
        + " per column; rows grouped by "
        + (heatmap.group_axis or "rank")
    ]
    span = heatmap.vmax - heatmap.vmin
    for index, (row, label) in enumerate(zip(heatmap.rows, labels, strict=True)):
        if index in heatmap.group_starts or (index == 0 and heatmap.group_starts):
            axis = heatmap.group_axis
            assert axis is not None
            lines.append(f"{'':{label_width}}  {axis} {_indices(row.mesh.get(axis, []))}")
        cells = []
        for column in range(columns):
            chunk = heatmap.work_s[index, column * per_column : (column + 1) * per_column]
            chunk = chunk[np.isfinite(chunk)]
            if not chunk.size:
                cells.append(MISSING)
                continue
            level = 0 if span <= 0 else int((float(chunk.mean()) - heatmap.vmin) / span * 10)
            cells.append(SHADES[min(max(level, 0), len(SHADES) - 1)])
        mark = f" {FLAGGED}" if row.rank in heatmap.flagged else ""
        lines.append(f"{label:>{label_width}} |{''.join(cells)}|{mark}")
    lines.extend(_legend(heatmap, width, any(MISSING in line for line in lines[1:])))
    return lines


def _legend(heatmap: HeatMap, width: int, missing: bool) -> list[str]:
    """Seconds per shade: each shade's lower bound; the last shade holds everything above."""
    span = heatmap.vmax - heatmap.vmin
    if span <= 0:
        return [f"legend: {SHADES[0]!r} = {heatmap.vmin:.3g} s (every rank-step alike)"]
    step = span / len(SHADES)
    decimals = max(0, 1 - math.floor(math.log10(step)))
    parts = [f"{shade!r}>={heatmap.vmin + i * step:.{decimals}f}" for i, shade in enumerate(SHADES)]
    finite = heatmap.work_s[np.isfinite(heatmap.work_s)]
    top = float(finite.max()) if finite.size else heatmap.vmax
    if top > heatmap.vmax * 1.0001:
        parts.append(f"(max {top:.{decimals}f}, in a warm-up step)")
    if missing:
        parts.append(f"{MISSING!r} no record")
    if heatmap.flagged:
        parts.append(f"{FLAGGED} flagged as a straggler")
    return textwrap.wrap(
        "legend, work s per rank-step: " + "  ".join(parts),
        width,
        subsequent_indent="  ",
        break_on_hyphens=False,
    )


# --- PNG -----------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _attempt_lines(axes: Any, attempt_starts: Sequence[int]) -> None:
    for start in attempt_starts[1:]:
        axes.axvline(start, color="0.6", linestyle="--", linewidth=0.8)


def plot_loss(
    path: Path,
    steps: Sequence[int],
    losses: Sequence[float],
    eval_steps: Sequence[int],
    eval_losses: Sequence[float],
    attempt_starts: Sequence[int] = (),
) -> None:
    """Training loss per step, and eval loss where it was measured."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 4.5))
    axes.plot(steps, losses, color="tab:blue", linewidth=1.2, label="loss")
    if eval_steps:
        axes.plot(eval_steps, eval_losses, "o-", color="tab:orange", label="eval loss")
    _attempt_lines(axes, attempt_starts)
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats/token)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_throughput(
    path: Path,
    steps: Sequence[int],
    tokens_per_s: Sequence[float],
    mfu: Sequence[float],
    warmup_steps: set[int],
    attempt_starts: Sequence[int] = (),
) -> None:
    """Two panels over steps: tokens/s and MFU; each attempt's warm-up steps drawn hollow."""
    plt = _pyplot()
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    warm = [step in warmup_steps for step in steps]
    for axes, values, colour, label in (
        (top, tokens_per_s, "tab:green", "tokens/s"),
        (bottom, [100 * value for value in mfu], "tab:purple", "MFU (%)"),
    ):
        axes.plot(steps, values, color=colour, linewidth=1.0)
        steady = [(s, v) for s, v, w in zip(steps, values, warm, strict=True) if not w]
        early = [(s, v) for s, v, w in zip(steps, values, warm, strict=True) if w]
        if steady:
            axes.plot(*zip(*steady, strict=True), "o", color=colour, markersize=3)
        if early:
            axes.plot(
                *zip(*early, strict=True),
                "o",
                markerfacecolor="none",
                color=colour,
                markersize=5,
                label="warm-up (compiles)",
            )
            axes.legend(loc="lower right")
        _attempt_lines(axes, attempt_starts)
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
    bottom.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_heatmap(
    path: Path,
    heatmap: HeatMap,
    straggler_windows: Sequence[tuple[int, int, int]] = (),
) -> None:
    """rank x step image of work seconds with a colorbar; rows labelled with mesh coordinates,
    lines between groups of the outermost varying mesh axis, flagged windows outlined."""
    plt = _pyplot()
    from matplotlib.patches import Rectangle

    first, last = heatmap.steps[0], heatmap.steps[-1]
    image = np.full((len(heatmap.rows), last - first + 1), np.nan)  # [ranks, every step]
    image[:, [step - first for step in heatmap.steps]] = heatmap.work_s
    height = min(max(2.5, 0.35 * len(heatmap.rows) + 1.5), 20)
    figure, axes = plt.subplots(figsize=(10, height))
    colours = plt.get_cmap("magma").with_extremes(bad="0.85")  # no record: grey
    shown = axes.imshow(
        np.ma.masked_invalid(image),
        aspect="auto",
        interpolation="nearest",
        cmap=colours,
        vmin=heatmap.vmin,
        vmax=heatmap.vmax if heatmap.vmax > heatmap.vmin else heatmap.vmin + 1e-9,
        extent=(first - 0.5, last + 0.5, len(heatmap.rows) - 0.5, -0.5),
    )
    clipped = bool(np.nanmax(heatmap.work_s) > heatmap.vmax) if heatmap.work_s.size else False
    bar = figure.colorbar(shown, ax=axes, extend="max" if clipped else "neither")
    bar.set_label("work s")
    axes.set_yticks(range(len(heatmap.rows)))
    axes.set_yticklabels([heatmap.label(row) for row in heatmap.rows], fontsize=8)
    for start in heatmap.group_starts:
        axes.axhline(start - 0.5, color="white", linewidth=2)
    row_of = {row.rank: index for index, row in enumerate(heatmap.rows)}
    for rank, window_first, window_last in straggler_windows:
        if rank in row_of:
            axes.add_patch(
                Rectangle(
                    (window_first - 0.5, row_of[rank] - 0.5),
                    window_last - window_first + 1,
                    1,
                    fill=False,
                    edgecolor="tab:cyan",
                    linewidth=1.5,
                )
            )
    grouped = f", grouped by {heatmap.group_axis}" if heatmap.group_axis else ""
    axes.set_title(f"per-rank work time (waits for other ranks excluded){grouped}")
    axes.set_xlabel("step")
    axes.set_ylabel("rank and mesh coordinates")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_goodput(path: Path, breakdown_s: dict[str, float], title: str) -> None:
    """One horizontal stacked bar: where the wall time went, each part labelled in seconds."""
    plt = _pyplot()
    parts = [(name.removesuffix("_s"), s) for name, s in breakdown_s.items() if s > 0]
    total = sum(seconds for _, seconds in parts) or 1.0
    figure, axes = plt.subplots(figsize=(10, 2.8))
    colours = plt.get_cmap("tab10")
    left = 0.0
    for index, (name, seconds) in enumerate(parts):
        axes.barh(
            0,
            seconds,
            left=left,
            color=colours(index % 10),
            label=f"{name} {seconds:.1f} s ({100 * seconds / total:.0f}%)",
        )
        if seconds / total > 0.06:
            axes.text(left + seconds / 2, 0, name, ha="center", va="center", fontsize=8)
        left += seconds
    axes.set_yticks([])
    axes.set_xlim(0, total)
    axes.set_xlabel("seconds")
    axes.set_title(title, fontsize=10)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)


def plot_expert_load(
    path: Path, steps: Sequence[int], shares: np.ndarray, hot_experts: Sequence[int] = ()
) -> None:
    """expert x step image of each expert's share of the step's tokens, with a colorbar centred
    on the even share (white), so hot experts show red and idle ones blue; hot experts' rows
    labelled."""
    plt = _pyplot()
    experts = shares.shape[0]  # shares: [experts, steps]
    first, last = steps[0], steps[-1]
    image = np.full((experts, last - first + 1), np.nan)  # [experts, every step]
    image[:, [step - first for step in steps]] = shares
    even = 1.0 / experts
    top = max(float(np.nanmax(shares)), 2 * even)
    figure, axes = plt.subplots(figsize=(10, min(max(2.5, 0.3 * experts + 1.5), 20)))
    from matplotlib.colors import TwoSlopeNorm

    shown = axes.imshow(
        np.ma.masked_invalid(image),
        aspect="auto",
        interpolation="nearest",
        cmap=plt.get_cmap("RdBu_r").with_extremes(bad="0.85"),  # no record: grey
        norm=TwoSlopeNorm(vcenter=even, vmin=0.0, vmax=top),
        extent=(first - 0.5, last + 0.5, experts - 0.5, -0.5),
    )
    figure.colorbar(shown, ax=axes).set_label("share of the step's tokens")
    axes.set_yticks(range(experts))
    hot = set(hot_experts)
    axes.set_yticklabels(
        [f"{expert}{' hot' if expert in hot else ''}" for expert in range(experts)], fontsize=8
    )
    axes.set_title(f"tokens per expert, share of each step's (even share {100 * even:.1f}%)")
    axes.set_xlabel("step")
    axes.set_ylabel("expert")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
