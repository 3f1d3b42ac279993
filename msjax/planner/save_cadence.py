"""How often to save, from what a save was measured to cost and an assumed failure rate: Young's
first-order optimum (J. W. Young, CACM 1974; J. T. Daly, FGCS 2006, refines it). Pure
arithmetic; `python -m msjax.report` reads the costs from a run's metrics.jsonl and prints it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_MTBF_HOURS = 24.0  # assumed mean time between failures of the whole job, if not given


def optimal_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """Young (1974): the training time between saves that makes the least time lost to saving
    and to rework after a failure, sqrt(2 x save_cost_s x mtbf_s); first order, so good while
    the save costs far less than the mean time between failures."""
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def interval_steps(interval_s: float, step_time_s: float) -> int:
    """An interval in seconds as a whole number of steps of `step_time_s` (at least 1)."""
    return max(1, round(interval_s / step_time_s))


def lost_share(save_cost_s: float, interval_s: float, mtbf_s: float) -> float:
    """The expected share of time lost when saving every `interval_s` of training, to first
    order: save_cost_s / interval_s (the saves) + interval_s / (2 x mtbf_s) (the work a failure
    undoes: half an interval on average). Young's interval is where this is smallest."""
    return save_cost_s / interval_s + interval_s / (2.0 * mtbf_s)


@dataclass(frozen=True)
class CadenceAdvice:
    """The recommended save interval for one kind of save, and what it and the configured one
    are expected to lose."""

    save_cost_s: float  # median measured cost of one save (the loop's pause)
    saves: int  # how many saves it is the median of
    step_time_s: float  # the median step time the intervals are converted with
    optimal_interval_s: float  # Young's optimum, in seconds of training
    recommended_steps: int  # that optimum in whole steps
    recommended_lost_share: float  # lost_share at recommended_steps
    configured_steps: int | None  # the run's interval in steps (None: not saving by steps)
    configured_lost_share: float | None  # lost_share at configured_steps


def advise(
    save_costs_s: Sequence[float],
    step_time_s: float,
    mtbf_s: float,
    configured_steps: int | None = None,
) -> CadenceAdvice | None:
    """Young's interval for saves that cost `save_costs_s` (their median) in a run whose steps
    take `step_time_s` (its median), in steps, with the share of time lost at it and at the
    configured interval; None without a save or a positive step time to go by."""
    if not save_costs_s or not step_time_s > 0:
        return None
    cost_s = statistics.median(save_costs_s)
    optimum_s = optimal_interval_s(cost_s, mtbf_s)
    steps = interval_steps(optimum_s, step_time_s)
    configured_share = None
    if configured_steps:
        configured_share = lost_share(cost_s, configured_steps * step_time_s, mtbf_s)
    return CadenceAdvice(
        save_cost_s=cost_s,
        saves=len(save_costs_s),
        step_time_s=step_time_s,
        optimal_interval_s=optimum_s,
        recommended_steps=steps,
        recommended_lost_share=lost_share(cost_s, steps * step_time_s, mtbf_s),
        configured_steps=configured_steps or None,
        configured_lost_share=configured_share,
    )


def _checkpoint_costs_s(records: Sequence[dict[str, Any]]) -> list[float]:
    """The loop's pause for each disk checkpoint save started (metrics.jsonl)."""
    return [r["checkpoint_save_blocked_s"] for r in records if "checkpoint_save_blocked_s" in r]


def _snapshot_costs_s(records: Sequence[dict[str, Any]]) -> list[float]:
    """The loop's stall for each in-memory snapshot taken (a skipped one copies no bytes)."""
    return [r["memory_snapshot_stall_s"] for r in records if r.get("memory_snapshot_bytes", 0) > 0]


def nothing_to_recommend(
    records: Sequence[dict[str, Any]], step_time_s: float | None
) -> str | None:
    """One line saying why a run's records give no save cadence, or None if they give one."""
    if not _checkpoint_costs_s(records) and not _snapshot_costs_s(records):
        return "save cadence: no checkpoint save or memory snapshot recorded, nothing to go by"
    if step_time_s is None or not step_time_s > 0:
        return "save cadence: no step time recorded, nothing to go by"
    return None


def cadence_texts(
    records: Sequence[dict[str, Any]],
    checkpoint: dict[str, Any],
    step_time_s: float,
    mtbf_s: float,
) -> list[tuple[str, str]]:
    """(label, text) for the disk checkpoints and the in-memory snapshots a run's metrics
    records measured: the median cost, Young's interval in seconds and as the config key's
    steps, and the share of time lost at it and at the interval in `checkpoint` (the run's
    resolved checkpoint config)."""
    enabled = checkpoint.get("enabled", True)
    texts = []
    for label, key, costs_s in (
        ("checkpoint", "every_steps", _checkpoint_costs_s(records)),
        ("memory", "memory_every_steps", _snapshot_costs_s(records)),
    ):
        every = checkpoint.get(key) if enabled or key == "memory_every_steps" else None
        advice = advise(costs_s, step_time_s, mtbf_s, every)
        if advice is not None:
            texts.append((label, _advice_text(key, advice)))
    return texts


def _share_text(share: float) -> str:
    return f"{100 * share:.3g}%"


def _advice_text(key: str, advice: CadenceAdvice) -> str:
    """Measured cost, the recommended interval and the share lost at it and as configured."""
    noun = "snapshot" if key == "memory_every_steps" else "save"
    counted = f"{advice.saves} {noun}{'' if advice.saves == 1 else 's'}"
    text = (
        f"median pause {advice.save_cost_s:.4g} s over {counted}: optimum "
        f"{advice.optimal_interval_s:.1f} s, so checkpoint.{key}={advice.recommended_steps}; "
        f"lost to saves and rework {_share_text(advice.recommended_lost_share)}"
    )
    if advice.configured_lost_share is not None:
        text += (
            f" (configured {advice.configured_steps}: {_share_text(advice.configured_lost_share)})"
        )
    return text
