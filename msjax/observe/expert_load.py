"""A mixture of experts' load over a run, read from the `moe_*` fields of metrics.jsonl: the
imbalance, the dropped share, the hottest experts and the persistently hot ones. Drawing the
expert x step heat map is msjax.observe.plots' job; this module gives it the numbers.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

import numpy as np

TOKENS_FIELD = "moe_tokens_per_expert"  # per step: tokens routed to each expert, summed over layers
# An expert is hot at a step when its share of the step's tokens is over HOT_SHARE_RATIO times
# the mean share (1 / experts): 1.5x leaves room for the noise of a small batch, while a router
# that has collapsed onto a few experts sends them 2x and more.
HOT_SHARE_RATIO = 1.5
# It is persistently hot when it was hot in at least HOT_STEP_FRACTION of the trailing window of
# HOT_WINDOW_STEPS steps (all the steps, in a shorter run): like a straggler, one bad step is
# noise, most of a window is a routing problem the balancing losses are not fixing.
HOT_WINDOW_STEPS = 20
HOT_STEP_FRACTION = 0.8
HOTTEST_SHOWN = 3  # experts named in the "hottest" line


@dataclass(frozen=True)
class HotExpert:
    """An expert hot in most of the trailing window."""

    expert: int
    hot_steps: int  # steps of the window in which it was hot
    window: tuple[int, int]  # first and last step of the trailing window
    max_share: float  # its largest share of a step's tokens in the window


@dataclass(frozen=True)
class ExpertLoad:
    """The expert load of a run's kept steps that recorded it."""

    steps: list[int]  # ascending
    shares: np.ndarray  # [experts, steps]: each step's tokens per expert over its tokens
    run_shares: np.ndarray  # [experts]: tokens per expert over the run's tokens
    mean_imbalance: float | None  # mean over steps of moe_mean_load_imbalance
    max_imbalance: float | None  # max over steps of moe_max_load_imbalance
    mean_dropped_share: float | None
    max_dropped_share: float | None

    @property
    def mean_share(self) -> float:
        """The share each expert would have under an even load."""
        return 1.0 / self.shares.shape[0]

    def hot_experts(self) -> list[HotExpert]:
        """The experts hot (over HOT_SHARE_RATIO x the mean share) in at least HOT_STEP_FRACTION
        of the trailing HOT_WINDOW_STEPS steps, most often hot first."""
        window = self.shares[:, -HOT_WINDOW_STEPS:]  # [experts, window steps]
        hot = window > HOT_SHARE_RATIO * self.mean_share
        needed = HOT_STEP_FRACTION * window.shape[1]
        span = (self.steps[-window.shape[1]], self.steps[-1])
        found = [
            HotExpert(int(expert), int(hot[expert].sum()), span, float(window[expert].max()))
            for expert in range(window.shape[0])
            if hot[expert].sum() >= needed
        ]
        return sorted(found, key=lambda item: (-item.hot_steps, -item.max_share))


def _values(records: list[dict[str, Any]], key: str) -> list[float]:
    return [float(record[key]) for record in records if record.get(key) is not None]


def expert_load(steps: dict[int, dict[str, Any]]) -> ExpertLoad | None:
    """The load of the steps (step -> its metrics record) that recorded tokens per expert; None
    for a dense run."""
    moe = {
        step: record
        for step, record in sorted(steps.items())
        if isinstance(record.get(TOKENS_FIELD), list) and record[TOKENS_FIELD]
    }
    if not moe:
        return None
    experts = max(len(record[TOKENS_FIELD]) for record in moe.values())
    tokens = np.zeros((experts, len(moe)))  # [experts, steps]
    for column, record in enumerate(moe.values()):
        tokens[: len(record[TOKENS_FIELD]), column] = record[TOKENS_FIELD]
    step_totals = np.maximum(tokens.sum(axis=0), 1e-9)  # [steps]
    records = list(moe.values())
    imbalance = _values(records, "moe_mean_load_imbalance")
    worst = _values(records, "moe_max_load_imbalance")
    dropped = _values(records, "moe_dropped_share")
    return ExpertLoad(
        steps=list(moe),
        shares=tokens / step_totals,
        run_shares=tokens.sum(axis=1) / max(tokens.sum(), 1e-9),
        mean_imbalance=float(np.mean(imbalance)) if imbalance else None,
        max_imbalance=max(worst) if worst else None,
        mean_dropped_share=float(np.mean(dropped)) if dropped else None,
        max_dropped_share=max(dropped) if dropped else None,
    )


def _percent(share: float | None) -> str:
    return "?" if share is None else f"{100 * share:.1f}%"


def _ratio(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def expert_load_lines(steps: dict[int, dict[str, Any]], width: int = 80) -> list[str]:
    """The report's expert-load section; no lines for a dense run."""
    load = expert_load(steps)
    if load is None:
        return []
    experts = load.shares.shape[0]
    first, last = load.steps[0], load.steps[-1]
    hottest = np.argsort(-load.run_shares, kind="stable")[:HOTTEST_SHOWN]
    texts = [
        f"steps {first}-{last} ({len(load.steps)} steps), {experts} experts, even share "
        f"{_percent(load.mean_share)}",
        f"imbalance (max over mean tokens per expert): mean {_ratio(load.mean_imbalance)}, "
        f"max {_ratio(load.max_imbalance)}",
        f"dropped share: mean {_percent(load.mean_dropped_share)}, "
        f"max {_percent(load.max_dropped_share)}",
        "hottest over the run: "
        + ", ".join(f"expert {e} {_percent(float(load.run_shares[e]))}" for e in hottest),
    ]
    lines = ["expert load (metrics.jsonl)"]
    for text in texts:
        lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="      ")
    return lines + _hot_lines(load, width)


def _hot_lines(load: ExpertLoad, width: int) -> list[str]:
    """The persistently hot experts, named the way a straggler rank is."""
    hot = load.hot_experts()
    window = min(HOT_WINDOW_STEPS, len(load.steps))
    rule = f"over {HOT_SHARE_RATIO:g}x the even share in {HOT_STEP_FRACTION:.0%} of the last "
    if not hot:
        return [f"hot experts: none ({rule}{window} steps)"]
    lines = [f"hot experts: {len(hot)} expert(s) {rule}{window} steps"]
    for item in hot:
        text = (
            f"expert {item.expert}: hot in {item.hot_steps} of {window} steps "
            f"(steps {item.window[0]}-{item.window[1]}), share up to {_percent(item.max_share)} "
            f"({item.max_share / load.mean_share:.2f}x the even share)"
        )
        lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="      ")
    return lines
