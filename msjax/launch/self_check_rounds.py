"""Self-check rounds: P `python -m msjax.resilience.self_checks` processes of one job started at
once, waited on within a budget, judged together (msjax.resilience.health) and written to
RUN_DIR/health/N.json. Run by `python -m msjax.doctor` and by the supervisor before an attempt.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from msjax.config import Config
from msjax.distributed import worker_env
from msjax.launch.devices import slot_devices
from msjax.launch.workers import WorkerProcess, describe_exit, stop_workers
from msjax.resilience.faults import ENV_VAR as FAULT_ENV_VAR
from msjax.resilience.faults import SLOT_ENV_VAR
from msjax.resilience.health import (
    Bounds,
    Failure,
    as_records,
    failed_ranks,
    judge,
    majority_fingerprint,
    median_device_s,
)
from msjax.run_dir import RunDir, write_text_atomically

DOCTOR_BUDGET_S = 120.0  # python -m msjax.doctor when resilience.check_budget_s is 0
COLLECTIVE_SHARE = 0.25  # each wait on peers in the collective check: this share of the budget
END_GRACE_S = 5.0  # for ranks that reported everything to exit by themselves
POLL_S = 0.1


@dataclass(frozen=True)
class HealthRound:
    """One round of self-checks as judged: its number in RUN_DIR/health and its failures."""

    number: int
    path: Path
    failures: list[Failure]
    wall_s: float
    summary: str

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def failed_ranks(self) -> list[int]:
        return failed_ranks(self.failures)


def next_health_number(run_dir: RunDir, attempt: int) -> int:
    """The attempt's number, or the next free one past it (a requeued job counts again from 0; a
    round still running, a slot's check for re-admission, holds its folder already)."""
    number = attempt
    while run_dir.health_verdict(number).exists() or run_dir.health_rank(number, 0).parent.exists():
        number += 1
    return number


class SelfCheckRound:
    """One round of self-checks under way: its processes started at once, polled with settled()
    (never blocking), judged by finish(). `slots`: the launcher slot each rank checks (its
    MSJAX_SLOT: injected faults follow the slot); `logs`: each rank's output, else its rank log."""

    def __init__(
        self,
        config: Config,
        ranks: Sequence[int],
        num_processes: int,
        devices_per_proc: int | None,
        coordinator: str,
        attempt: int = 0,
        faults: str | None = None,
        budget_s: float | None = None,
        slots: Sequence[int] | None = None,
        logs: Sequence[Path] | None = None,
        collectives: bool = True,
    ):
        self.config = config
        self.attempt = attempt
        self.budget_s = budget_s or config.resilience.check_budget_s or DOCTOR_BUDGET_S
        self.run_dir = RunDir(Path(config.run.dir))
        self.number = next_health_number(self.run_dir, attempt)
        folder = self.run_dir.health_rank(self.number, 0).parent
        folder.mkdir(parents=True, exist_ok=True)
        job_config = folder / "job.yaml"
        write_text_atomically(job_config, config.to_yaml())
        command = [
            sys.executable,
            "-m",
            "msjax.resilience.self_checks",
            "--config",
            str(job_config),
            "--number",
            str(self.number),
            "--wait-s",
            f"{COLLECTIVE_SHARE * self.budget_s:g}",
            "--end-unix-s",
            f"{time.time() + self.budget_s:.3f}",
            *([] if collectives else ["--no-collectives"]),
        ]
        self.started = time.monotonic()
        self.deadline = self.started + self.budget_s
        self.workers: list[WorkerProcess] = []
        for index, rank in enumerate(ranks):
            env = {
                **os.environ,
                **worker_env(coordinator, num_processes, rank, attempt),
                "PYTHONUNBUFFERED": "1",
            }
            if devices_per_proc is not None:
                env["JAX_NUM_CPU_DEVICES"] = str(devices_per_proc)
            if faults:
                env[FAULT_ENV_VAR] = faults
            if slots is not None:
                env[SLOT_ENV_VAR] = str(slots[index])
            # the slot's own GPUs (on one node the launcher's slot, else the rank's place here)
            env.update(slot_devices(slots[index] if slots is not None else index, devices_per_proc))
            log = logs[index] if logs is not None else self.run_dir.log(rank)
            self.workers.append(WorkerProcess(rank, command, env, log, attempt, echo=None))
        self.reports: dict[int, dict[str, Any] | None] = {}

    def settled(self) -> bool:
        """Whether every rank is done, or each rank not done is named missing by a rank that is,
        or has exited, or the deadline has passed: nothing waits on a silent process."""
        workers = self.workers
        self.reports = {
            w.rank: _read_report(self.run_dir.health_rank(self.number, w.rank)) for w in workers
        }
        done = _done(self.reports)
        named = {rank for report in done.values() for rank in report.get("missing", [])}
        pending = [w for w in workers if w.rank not in done]
        settled = all(w.rank in named or w.poll() is not None for w in pending)
        return not pending or settled or time.monotonic() > self.deadline

    def finish(self) -> HealthRound:
        """Once settled: stop what is left, judge the figures, write RUN_DIR/health/N.json."""
        reports = self._end_workers()
        wall_s = time.monotonic() - self.started
        bounds = Bounds(self.config.resilience.slow_device_factor, self.budget_s)
        failures = judge(reports, bounds)
        summary = _summary(reports, failures, bounds, len(self.workers))
        verdict = {
            "number": self.number,
            "attempt": self.attempt,
            "passed": not failures,
            "failed_ranks": failed_ranks(failures),
            "failures": as_records(failures),
            "summary": summary,
            "wall_s": round(wall_s, 3),
            "unix_s": time.time(),
            "spawned_unix_s": min(worker.spawned_unix_s for worker in self.workers),
            "bounds": asdict(bounds),
            "majority_fingerprint": majority_fingerprint(_done(reports)),
            "median_device_s": median_device_s(_done(reports)),
            "ranks": {str(rank): report for rank, report in reports.items()},
        }
        path = self.run_dir.health_verdict(self.number)
        write_text_atomically(path, json.dumps(verdict, indent=1))
        return HealthRound(self.number, path, failures, wall_s, summary)

    def wait(self) -> HealthRound:
        """Block until the round has settled (its budget bounds the wait), then finish it."""
        while not self.settled():
            time.sleep(POLL_S)
        return self.finish()

    def cancel(self) -> None:
        """Stop the round's processes without a verdict (the job ended first)."""
        stop_workers(self.workers, grace_s=2.0)

    def _end_workers(self) -> dict[int, dict[str, Any] | None]:
        reports = self.reports
        done = _done(reports)
        end = min(self.deadline, time.monotonic() + END_GRACE_S)
        for worker in self.workers:  # those done exit by themselves; leave them a moment to
            if worker.rank in done:
                worker.wait(end - time.monotonic())
        for worker in self.workers:
            if worker.rank not in done and worker.poll() is not None:
                reports[worker.rank] = {
                    "phase": "start",
                    **(reports[worker.rank] or {}),
                    "exited": describe_exit(worker.exit_code or 0),
                }
        stop_workers(self.workers, grace_s=2.0)
        return reports


def run_self_checks(
    config: Config,
    ranks: Sequence[int],
    num_processes: int,
    devices_per_proc: int | None,
    coordinator: str,
    attempt: int = 0,
    faults: str | None = None,
    budget_s: float | None = None,
    slots: Sequence[int] | None = None,
) -> HealthRound:
    """Run the self-checks on `ranks` (this node's processes of the job) and judge them; no wait
    goes past budget_s (resilience.check_budget_s unless given)."""
    checks = SelfCheckRound(
        config,
        ranks,
        num_processes,
        devices_per_proc,
        coordinator,
        attempt,
        faults,
        budget_s,
        slots=slots,
    )
    return checks.wait()


def _done(reports: dict[int, dict[str, Any] | None]) -> dict[int, dict[str, Any]]:
    return {rank: r for rank, r in reports.items() if r is not None and r.get("phase") == "done"}


def _read_report(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _summary(
    reports: dict[int, dict[str, Any] | None],
    failures: list[Failure],
    bounds: Bounds,
    processes: int,
) -> str:
    """One line of figures: the worst of each against its bound."""
    done = _done(reports)
    devices = [d for r in done.values() for d in r["compute"]]
    if not devices:
        return f"{processes} processes, none finished its checks"
    median = median_device_s(done) or 0.0
    majority = majority_fingerprint(done)
    agree = sum(d["fingerprint"] == majority for d in devices)
    disks = [r["disk"] for r in done.values() if "error" not in r["disk"]]
    parts = [
        f"{processes} processes x {len(devices) // max(len(done), 1)} devices",
        f"known-answer error <= {max(d['error'] for d in devices):.1e} "
        f"(tolerance {bounds.tolerance:.0e})",
        f"fingerprints: {agree} of {len(devices)} agree"
        if majority
        else "fingerprints: no majority",
        f"slowest device {max(d['seconds'] for d in devices) / max(median, 1e-12):.2f} x the "
        f"median {1e3 * median:.2f} ms (bound {bounds.slow_device_factor:g})",
        f"host memory >= {min(r['memory']['available_mib'] for r in done.values()):.0f} MiB",
    ]
    if disks:
        parts.append(
            f"disk >= {min(d['write_mb_s'] for d in disks):.0f} MB/s write+fsync, "
            f"{min(d['read_mb_s'] for d in disks):.0f} MB/s read"
        )
    axes: dict[str, float] = {}
    for report in done.values():
        for entry in report["collectives"]:
            if entry.get("seconds") is not None:
                axes[entry["axis"]] = max(axes.get(entry["axis"], 0.0), entry["seconds"])
    if axes:
        parts.append("all-reduce " + ", ".join(f"{a} {1e3 * s:.2f} ms" for a, s in axes.items()))
    return "; ".join(parts)


def detail(health: HealthRound) -> str:
    """A failed round in one line: each failure, and where the verdict is."""
    failures = "; ".join(failure.line() for failure in health.failures)
    return f"{failures} ({health.path.parent.name}/{health.path.name})"


def failed_by_every_rank(health: HealthRound, ranks: Sequence[int]) -> list[str]:
    """The checks every one of the round's ranks (two or more) failed: the node's or the
    storage's (a full disk, low host memory), not one slot's, so no slot is to blame."""
    if len(ranks) < 2:
        return []
    checks = sorted({failure.check for failure in health.failures})
    return [
        check
        for check in checks
        if {f.rank for f in health.failures if f.check == check} >= set(ranks)
    ]


def report_lines(health: HealthRound) -> list[str]:
    """What the doctor prints: pass with its figures, or each failing rank's check and figure."""
    if health.passed:
        return [f"passed in {health.wall_s:.1f} s: {health.summary} ({health.path})"]
    ranks = ", ".join(str(rank) for rank in health.failed_ranks)
    return [
        f"FAILED: rank(s) {ranks} in {health.wall_s:.1f} s ({health.path})",
        *(f"  {failure.line()}" for failure in health.failures),
    ]
