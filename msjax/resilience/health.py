"""The verdict of one round of self-checks: every rank's figures (msjax.resilience.self_checks)
held against their bounds and against the other ranks' -- which ranks fail, which check, and the
figure against its bound. Pure: it reads figures and returns failures."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

KNOWN_ANSWER_TOLERANCE = 1e-4  # float32 with full-precision matmuls is within ~1e-6 of float64
MIN_HOST_MEMORY_MIB = 256.0  # less than this available: the host cannot even hold a batch
MIN_SLOW_LINK_EXCESS_S = 1e-3  # a group's all-reduce is slow only this far past its axis's median


@dataclass(frozen=True)
class Failure:
    rank: int
    check: str  # answer | compute | fingerprint | speed | memory | disk | collectives
    detail: str  # the figure against its bound

    def line(self) -> str:
        return f"rank {self.rank}: {self.check}: {self.detail}"


@dataclass(frozen=True)
class Bounds:
    slow_device_factor: float
    budget_s: float
    tolerance: float = KNOWN_ANSWER_TOLERANCE
    min_memory_mib: float = MIN_HOST_MEMORY_MIB


def judge(reports: dict[int, dict[str, Any] | None], bounds: Bounds) -> list[Failure]:
    """Every failure, one per rank and check, in rank order. reports: each rank's figures (None
    if it wrote none); a rank that did not finish is a failure of its own ("answer")."""
    done = {rank: r for rank, r in reports.items() if r is not None and r.get("phase") == "done"}
    failures = [
        Failure(rank, "answer", _no_answer(report, bounds.budget_s))
        for rank, report in reports.items()
        if rank not in done
    ]
    for rank, report in done.items():
        failures += _local(rank, report, bounds)
    failures += _fingerprints(done)
    failures += _speed(done, bounds.slow_device_factor)
    failures += _collectives(done, set(reports))
    failures += _slow_links(done, bounds.slow_device_factor)
    details: dict[tuple[int, str], list[str]] = {}
    for failure in failures:  # one failure per rank and check, naming each device in it
        found = details.setdefault((failure.rank, failure.check), [])
        if failure.detail not in found:
            found.append(failure.detail)
    return [
        Failure(rank, check, "; ".join(found)) for (rank, check), found in sorted(details.items())
    ]


def failed_ranks(failures: list[Failure]) -> list[int]:
    return sorted({failure.rank for failure in failures})


def as_records(failures: list[Failure]) -> list[dict[str, Any]]:
    return [asdict(failure) for failure in failures]


def _no_answer(report: dict[str, Any] | None, budget_s: float) -> str:
    if report is None:
        return f"no answer: it never reported (budget {budget_s:g} s)"
    phase = report.get("phase", "?")
    if "exited" in report:  # the doctor notes how a rank that did not finish ended
        return f"{report['exited']} in phase {phase}, before its checks were done"
    return f"did not finish its checks: last seen in phase {phase} (budget {budget_s:g} s)"


def _local(rank: int, report: dict[str, Any], bounds: Bounds) -> list[Failure]:
    failures = []
    for device in report["compute"]:
        if not device["error"] <= bounds.tolerance:
            failures.append(
                Failure(
                    rank,
                    "compute",
                    f"device {device['device']}: known-answer error {device['error']:.2e} > "
                    f"tolerance {bounds.tolerance:.0e} (against float64)",
                )
            )
    memory = report["memory"]["available_mib"]
    if memory < bounds.min_memory_mib:
        failures.append(
            Failure(rank, "memory", f"{memory:.0f} MiB available < {bounds.min_memory_mib:.0f} MiB")
        )
    disk = report["disk"]
    if "error" in disk:
        failures.append(Failure(rank, "disk", disk["error"]))
    elif not disk["intact"]:
        failures.append(Failure(rank, "disk", "the bytes read back differ from those written"))
    elif not (disk["write_mb_s"] > 0 and disk["read_mb_s"] > 0):
        failures.append(Failure(rank, "disk", f"write {disk['write_mb_s']} MB/s, need > 0"))
    return failures


def majority_fingerprint(done: dict[int, dict[str, Any]]) -> str | None:
    """The fingerprint more than half of all devices computed, or None if none did."""
    counts = Counter(device["fingerprint"] for r in done.values() for device in r["compute"])
    if not counts:
        return None
    value, count = counts.most_common(1)[0]
    return value if count * 2 > sum(counts.values()) else None


def _fingerprints(done: dict[int, dict[str, Any]]) -> list[Failure]:
    """Devices whose result differs from the majority's (none when there is no majority: then
    the float64 comparison alone judges)."""
    majority = majority_fingerprint(done)
    if majority is None:
        return []
    total = sum(len(report["compute"]) for report in done.values())
    agree = sum(d["fingerprint"] == majority for r in done.values() for d in r["compute"])
    return [
        Failure(
            rank,
            "fingerprint",
            f"device {device['device']}: result {device['fingerprint']} differs from the "
            f"majority's {majority} ({agree} of {total} devices)",
        )
        for rank, report in done.items()
        for device in report["compute"]
        if device["fingerprint"] != majority
    ]


def median_device_s(done: dict[int, dict[str, Any]]) -> float | None:
    seconds = [device["seconds"] for r in done.values() for device in r["compute"]]
    return statistics.median(seconds) if seconds else None


def _speed(done: dict[int, dict[str, Any]], factor: float) -> list[Failure]:
    median = median_device_s(done)
    if median is None:
        return []
    return [
        Failure(
            rank,
            "speed",
            f"device {device['device']}: known-answer program {1e3 * device['seconds']:.2f} ms "
            f"> {factor:g} x the median {1e3 * median:.2f} ms (resilience.slow_device_factor)",
        )
        for rank, report in done.items()
        for device in report["compute"]
        if device["seconds"] > factor * median
    ]


def _collectives(done: dict[int, dict[str, Any]], ranks: set[int]) -> list[Failure]:
    """The ranks a failed all-reduce points at: those that did not arrive or answer (named by a
    peer), or the ranks of a group whose sum came out wrong."""
    failures = []
    for reporter, report in done.items():
        for entry in report["collectives"]:
            if entry["ok"]:
                continue
            axis = entry["axis"]
            for rank in entry.get("missing", []):
                what = "finish" if entry.get("timed_out") else "arrive at"
                failures.append(
                    Failure(
                        rank,
                        "collectives",
                        f"did not {what} the all-reduce over {axis} within "
                        f"{entry['waited_s']:.1f} s (seen by rank {reporter})",
                    )
                )
            if entry.get("timed_out") and not entry.get("missing"):
                failures.append(
                    Failure(
                        reporter,
                        "collectives",
                        f"the all-reduce over {axis} did not finish within "
                        f"{entry['waited_s']:.1f} s, though every rank answers",
                    )
                )
            for wrong in entry.get("wrong", []):
                for rank in wrong["group_ranks"]:
                    failures.append(
                        Failure(
                            rank,
                            "collectives",
                            f"the all-reduce over {axis} gave {wrong['got']} on device "
                            f"{wrong['device']} (rank {reporter}), expected {wrong['expected']}",
                        )
                    )
    return [failure for failure in failures if failure.rank in ranks]


def _slow_links(done: dict[int, dict[str, Any]], factor: float) -> list[Failure]:
    """Groups whose all-reduce took more than factor x the median of their axis's groups (each
    group at the slowest any of its ranks timed it): every rank of the group is named."""
    failures = []
    by_axis: dict[str, dict[tuple[int, ...], dict[str, Any]]] = {}
    for report in done.values():
        for entry in report["collectives"]:
            for group in entry.get("groups", []):
                groups = by_axis.setdefault(entry["axis"], {})
                key = tuple(group["devices"])
                if key not in groups or group["seconds"] > groups[key]["seconds"]:
                    groups[key] = group
    for axis, groups in by_axis.items():
        median = statistics.median(group["seconds"] for group in groups.values())
        for group in groups.values():
            excess_s = group["seconds"] - median
            if group["seconds"] > factor * median and excess_s > MIN_SLOW_LINK_EXCESS_S:
                failures += [
                    Failure(
                        rank,
                        "collectives",
                        f"the all-reduce over {axis} among devices {group['devices']} took "
                        f"{1e3 * group['seconds']:.2f} ms > {factor:g} x the median "
                        f"{1e3 * median:.2f} ms of its axis's groups "
                        "(resilience.slow_device_factor)",
                    )
                    for rank in group["ranks"]
                ]
    return failures
