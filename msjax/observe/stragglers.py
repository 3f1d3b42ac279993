"""Straggler detection: which rank's own work is persistently slower than the others'.

In a synchronous job every rank waits for the slowest at each collective, so step times are all
alike; what differs is each rank's own work (rank_timing.py measures it without the waits). Each
window of steps, every rank's median own work is scored against the ranks' median with a robust
spread (MAD); a rank flagged in enough windows in a row is reported, with the phase its excess
time goes to. Pure numpy: no JAX, no processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PHASES = ("data", "host", "stalled")  # data wait, other host work, process not running
_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
_ABSOLUTE_FLOOR_S = 0.002  # timer and scheduler noise below which no difference counts


@dataclass(frozen=True)
class Finding:
    """One rank flagged in one window."""

    rank: int
    score: float  # robust deviations above the ranks' median
    excess_s: float  # median own work above the ranks' median, per step
    phase: str  # where the excess goes: one of PHASES


def own_work(parts: dict[str, np.ndarray]) -> np.ndarray:
    """A rank's own work per step: its data wait, other host work and stalls. [ranks, steps]"""
    return parts["data"] + parts["host"] + parts["stalled"]


def score_window(
    parts: dict[str, np.ndarray], step_time_s: float, min_excess: float, min_score: float
) -> list[Finding]:
    """Ranks whose median own work in this window is too far above the others'.

    parts: seconds per phase, each [ranks, steps]; step_time_s: the window's typical step time.
    A rank is flagged when its excess over the ranks' median is at least min_excess of a step
    and at least min_score robust deviations.
    """
    own = own_work(parts)  # [ranks, steps]
    ranks = own.shape[0]
    if ranks < 2 or own.shape[1] == 0:
        return []
    per_rank = np.median(own, axis=1)  # [ranks]
    center = float(np.median(per_rank))
    spread = _MAD_TO_SIGMA * float(np.median(np.abs(per_rank - center)))
    floor = max(spread, 0.02 * step_time_s, _ABSOLUTE_FLOOR_S)
    findings = []
    for rank in range(ranks):
        excess = float(per_rank[rank]) - center
        score = excess / floor
        if excess >= min_excess * step_time_s and score >= min_score:
            findings.append(Finding(rank, score, excess, _phase_of(parts, rank)))
    return findings


def _phase_of(parts: dict[str, np.ndarray], rank: int) -> str:
    """The phase in which this rank's median time most exceeds the ranks' median."""
    excess = {}
    for phase in PHASES:
        per_rank = np.median(parts[phase], axis=1)  # [ranks]
        excess[phase] = float(per_rank[rank] - np.median(per_rank))
    return max(excess, key=excess.get)


@dataclass(frozen=True)
class StragglerEvent:
    """A rank flagged in `windows` consecutive windows, ending at step last_step."""

    rank: int
    first_step: int  # the first step of the first flagged window
    last_step: int
    score: float
    excess_s: float
    phase: str


class StragglerDetector:
    """Feeds windows to score_window and reports ranks flagged in enough windows in a row.

    A rank is reported once when it becomes persistent, and again only after it has been clear
    for a window and becomes persistent anew.
    """

    def __init__(self, min_excess: float, min_score: float, windows: int):
        self.min_excess = min_excess
        self.min_score = min_score
        self.windows = windows
        self._streak: dict[int, list[int]] = {}  # rank -> first steps of its flagged windows
        self._reported: set[int] = set()

    def update(
        self, steps: Sequence[int], parts: dict[str, np.ndarray], step_time_s: np.ndarray
    ) -> list[StragglerEvent]:
        """One window: steps [steps], parts {phase: [ranks, steps]}, step_time_s [ranks, steps]."""
        typical_step_s = float(np.median(step_time_s))
        findings = score_window(parts, typical_step_s, self.min_excess, self.min_score)
        flagged = {finding.rank: finding for finding in findings}
        events = []
        for rank in list(self._streak):
            if rank not in flagged:
                del self._streak[rank]
                self._reported.discard(rank)
        for rank, finding in flagged.items():
            streak = self._streak.setdefault(rank, [])
            streak.append(int(steps[0]))
            if len(streak) >= self.windows and rank not in self._reported:
                self._reported.add(rank)
                events.append(
                    StragglerEvent(
                        rank,
                        streak[-self.windows],
                        int(steps[-1]),
                        finding.score,
                        finding.excess_s,
                        finding.phase,
                    )
                )
        return events
