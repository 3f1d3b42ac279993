"""RUN_DIR/launches.jsonl: one record per launcher session of a run (node 0's), with its attempts,
nodes and scheduler job, so that goodput, incidents and the report cover every requeue; this
launch's own record (`LaunchRecord`: its line kept current while it runs, the run's goodput.json,
the requeue incident that opens a launch after an unfinished one, the name for its slot faults)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from msjax.launch.attempt import Attempt
from msjax.launch.incidents import Incident, IncidentLog
from msjax.launch.layout import JobLayout
from msjax.launch.supervisor_states import StopRequest
from msjax.observe.goodput import read_records, session_split, write_goodput
from msjax.parallel.agreement import job_secret
from msjax.run_dir import RunDir
from msjax.writable import AppendLog

REQUEUE = "requeue"  # the cause of the incident that opens a launch after an unfinished one
# the outcome of a launch's record while it runs: written at its start and kept current, it is
# the last one of a launcher killed outright, whose time up to then still counts
RUNNING = "running"


def scheduler_context(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Where this session runs: its nodes, and under Slurm the job and how often it was requeued
    (SLURM_RESTART_COUNT is unset on a job's first run)."""
    job = environ.get("SLURM_JOB_ID")
    return {
        "host": socket.gethostname(),
        "nodes": environ.get("SLURM_JOB_NODELIST") or socket.gethostname(),
        "slurm_job_id": job,
        "slurm_restart_count": int(environ.get("SLURM_RESTART_COUNT") or 0) if job else None,
    }


def read_launches(run_dir: RunDir) -> list[dict[str, Any]]:
    """The run's sessions, oldest first: each one's last record (a session writes one when it
    is asked to stop, in case it is killed while its workers save, and one when it ends)."""
    last: dict[int, dict[str, Any]] = {}
    for record in read_records(run_dir.launches):
        if "started_unix_s" in record and isinstance(record.get("launch"), int):
            last[record["launch"]] = record
    return [last[number] for number in sorted(last)]


def attempt_record(attempt: Attempt) -> dict[str, Any]:
    return {
        "attempt": attempt.number,
        "spawned_unix_s": attempt.spawned_unix_s,
        "first_step_unix_s": attempt.first_step_unix_s,
        "ended_unix_s": attempt.ended_unix_s,
        "start_step": attempt.start_step,
        "max_step": attempt.max_step,
        "outcome": attempt.outcome,
    }


def append_launch(run_dir: RunDir, record: dict[str, Any]) -> None:
    """One record more; a full disk drops it with one warning (the supervisor's exit code stays)."""
    log = AppendLog(run_dir.launches)
    log.write(json.dumps(record) + "\n")
    log.close()


def requeue_incident(
    number: int, previous: dict[str, Any], started_unix_s: float, context: dict[str, Any]
) -> Incident:
    """The incident that opens a session after one that did not finish the run: from the stop
    request (or the end) of the previous session to this one's first step. Its restart fields are
    filled in as the session's first attempt progresses, like any incident's."""
    ended = previous["ended_unix_s"]
    stopped_at = previous.get("stop_requested_unix_s") or ended
    attempts = previous.get("attempts") or [{}]
    step = max((a.get("max_step") or 0 for a in attempts), default=0)
    by = ""
    ended_how = f"ended ({previous['outcome']})"
    if previous["outcome"] == RUNNING:  # killed outright: its last record says when it was alive
        ended_how = "was killed (its last record, running)"
    if context["slurm_job_id"]:
        by = f" by Slurm (job {context['slurm_job_id']}, restart {context['slurm_restart_count']})"
    return Incident(
        incident=number,
        cause=REQUEUE,
        rank=None,
        detail=f"launch {previous['launch']} {ended_how} on "
        f"{previous['nodes']}; started again{by} on {context['nodes']} "
        f"{started_unix_s - ended:.1f} s later",
        attempt=None,  # before this session's first attempt
        launch=previous["launch"] + 1,
        phase=None,
        step=step,
        fault_unix_s=stopped_at,
        fault_time_from="stop request" if previous.get("stop_requested_unix_s") else "end",
        detected_unix_s=ended,
        detection_latency_s=0.0,
        stop_s=round(ended - stopped_at, 3),  # saving and stopping, msjax's side
        scheduler_s=round(started_unix_s - ended, 3),  # requeue and start, the scheduler's
        diagnostics=None,
        flight_recorder=None,
    )


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
