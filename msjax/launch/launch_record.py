"""This launch's own record, kept by node 0's supervisor: its line in RUN_DIR/launches.jsonl
(written at its start, kept current while it runs, final at its end), the run's goodput.json, the
requeue incident that opens a launch after an unfinished one, and the name for its slot faults.
"""

from __future__ import annotations

import hashlib
import socket
import time
from collections.abc import Callable
from typing import Any

from msjax.launch.attempt import Attempt
from msjax.launch.incidents import IncidentLog
from msjax.launch.launches import (
    REQUEUE,
    RUNNING,
    append_launch,
    attempt_record,
    read_launches,
    requeue_incident,
    scheduler_context,
)
from msjax.launch.layout import JobLayout
from msjax.launch.supervisor_states import StopRequest
from msjax.observe.goodput import session_split, write_goodput
from msjax.parallel.agreement import job_secret
from msjax.run_dir import RunDir


def launch_id(layout: JobLayout, context: dict[str, Any], started_unix_s: float) -> str:
    """What names this launch of the job alike on every node (slot faults are grouped by it):
    the job's secret (fresh per launch under launch/slurm), else its scheduler job and
    coordinator; on one node, this supervisor's start."""
    if layout.nnodes == 1:
        return f"{socket.gethostname()} {started_unix_s:.6f}"
    secret = job_secret()
    if secret is not None:
        return hashlib.sha256(secret).hexdigest()[:16]
    return f"{context['slurm_job_id']}.{context['slurm_restart_count']} {layout.coordinator}"


class LaunchRecord:
    """The launch's line in launches.jsonl and the run's goodput; node 0's supervisor alone
    keeps the run's record (the others' calls write nothing)."""

    def __init__(
        self,
        run_dir: RunDir,
        layout: JobLayout,
        attempts: list[Attempt],
        incidents: IncidentLog,
        stop: StopRequest,
        every_s: float,
    ):
        self.run_dir = run_dir
        self.layout = layout
        self.attempts = attempts  # the supervisor's list, appended to as attempts start
        self.incidents = incidents
        self.stop = stop
        self.every_s = every_s  # resilience.launch_record_every_s
        self.started_unix_s = time.time()
        self.keeps_record = layout.node_rank == 0
        self.context = scheduler_context()
        self.earlier_launches = read_launches(run_dir) if self.keeps_record else []
        self.launch_id = launch_id(layout, self.context, self.started_unix_s)
        self.recorded_unix_s = 0.0  # when this launch's record was last appended

    def open_requeue_incident(self, say: Callable[[str], None]) -> None:
        """A launch after one that did not finish the run (a requeued job) is an incident."""
        if not self.keeps_record:
            return
        if not self.earlier_launches or self.earlier_launches[-1]["outcome"] == "done":
            return
        number = self.incidents.next_number()
        incident = requeue_incident(
            number, self.earlier_launches[-1], self.started_unix_s, self.context
        )
        self.incidents.open(incident)
        say(f"incident {number}: requeue: {incident.detail}")

    def keep_current(self, now_unix_s: float) -> None:
        """Append this launch's record again every resilience.launch_record_every_s while it runs:
        a launcher killed outright (SIGKILL) leaves its time up to the last one on record."""
        if now_unix_s - self.recorded_unix_s >= self.every_s:
            self.append(now_unix_s, RUNNING, goodput=False)

    def append(self, ended: float, outcome: str, goodput: bool = True) -> str | None:
        """Append this launch (so far) to launches.jsonl and (goodput) write the run's
        goodput.json; returns goodput's summary line."""
        if not self.keeps_record:
            return None
        self.recorded_unix_s = ended
        faults = [i for i in self.incidents.written if i["cause"] != REQUEUE]
        launch = {
            "launch": len(self.earlier_launches) + 1,
            **self.context,
            "nnodes": self.layout.nnodes,
            "started_unix_s": self.started_unix_s,
            "ended_unix_s": ended,
            "stop_requested_unix_s": self.stop.unix_s,
            "outcome": outcome,
            "attempts": [attempt_record(attempt) for attempt in self.attempts],
            "incidents": len(self.incidents.written),
            "split_s": session_split(ended, self.attempts, faults),
        }
        summary = None
        if goodput:
            summary = write_goodput(self.run_dir, [*self.earlier_launches, launch], outcome)
        append_launch(self.run_dir, launch)
        return summary
