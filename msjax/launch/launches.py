"""RUN_DIR/launches.jsonl: one record per launcher session of a run (node 0's), with its attempts,
nodes and scheduler job, so that goodput, incidents and the report cover every requeue."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from typing import Any

from msjax.launch.attempt import Attempt
from msjax.launch.incidents import Incident
from msjax.observe.goodput import read_records
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
