"""Where a supervised run's wall time went, and its effective training time ratio.

MegaScale's effective training time is productive step time over wall time: the steps that
count (each step index's last record in metrics.jsonl) against everything from the first
supervisor's start to the last one's end. The rest is split into start-up, compilation,
checkpoint pauses, lost progress (steps trained and then redone after a fault, and the time
until the fault was detected), restarting (diagnostics, stopping workers, backoff) and the
scheduler's time between two launcher sessions of one run (a requeued job waiting and starting
again). The corruption guard's verdicts are counted beside it (a replayed window's steps are lost
progress). Written to RUN_DIR/goodput.json by the supervisor (msjax.launch) for the whole run,
every requeue included; the report reads it, or splits metrics.jsonl alone the same way.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

from msjax.run_dir import RunDir
from msjax.writable import rewrite_best_effort


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a .jsonl file ([] if there is none), skipping lines cut short."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut short by a killed writer
            continue
    return records


def step_time_split(records: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds of kept steps (data wait apart), of superseded steps, of checkpoint pauses.

    The first step of each attempt also waits for every rank to finish compiling; it counts as
    a typical step here (`first_step_typical_s`), the rest of its time as compilation. A memory
    snapshot's stall (checkpoint.memory_every_steps) is inside the time of the step recorded
    after it: it counts as a checkpoint pause, not as that step's time.
    """
    steps = [(i, r) for i, r in enumerate(records) if "loss" in r and "step_time_s" in r]
    step_times, snapshot_stall_s = _without_snapshot_stalls(records)
    last_index = {record["step"]: index for index, record in steps}
    first = set()
    previous_step = None
    for position, (index, record) in enumerate(steps):
        resumed = (
            any(r.get("event") == "resume" for r in records[steps[position - 1][0] + 1 : index])
            if position
            else True
        )
        if resumed or previous_step is None or record["step"] <= previous_step:
            first.add(index)
        previous_step = record["step"]
    typical = sorted(step_times[index] for index, _ in steps if index not in first)
    median_s = typical[len(typical) // 2] if typical else 0.0
    kept_s = data_s = lost_s = first_typical_s = 0.0
    for index, record in steps:
        step_time_s = step_times[index]
        if index in first and typical:
            step_time_s = min(step_time_s, median_s)
        if index in first:
            first_typical_s += step_time_s
        if last_index[record["step"]] == index:
            kept_s += step_time_s
            # a first step's wait for its batch is start-up beyond a typical step, like its compile
            data_s += min(record.get("data_wait_s", 0.0), step_time_s)
        else:
            # A step in flight at a fault also holds the wait until the fault was detected (a
            # stopped rank resumes only to be stopped, then records it): that wait is detection,
            # counted on its own, so a superseded step counts at most a typical step.
            lost_s += min(step_time_s, median_s) if typical else step_time_s
    checkpoint_s = snapshot_stall_s + sum(r.get("checkpoint_save_blocked_s", 0.0) for r in records)
    return {
        "kept_step_s": kept_s,
        "data_s": data_s,
        "superseded_step_s": lost_s,
        "checkpoint_s": checkpoint_s,
        "first_step_typical_s": first_typical_s,
        "kept_steps": len(last_index),
    }


def _without_snapshot_stalls(records: list[dict[str, Any]]) -> tuple[dict[int, float], float]:
    """Each step record's time (by its index in records) less the memory snapshots' stalls
    recorded before it since the step before, and those stalls' seconds in all."""
    times, stalls_s, pending_s = {}, 0.0, 0.0
    for index, record in enumerate(records):
        pending_s += record.get("memory_snapshot_stall_s", 0.0)
        if "loss" in record and "step_time_s" in record:
            stall_s = min(pending_s, record["step_time_s"])
            times[index] = record["step_time_s"] - stall_s
            stalls_s += stall_s
            pending_s = 0.0
    return times, stalls_s


def session_split(
    ended_unix_s: float, attempts: list[Any], incidents: list[dict[str, Any]]
) -> dict[str, float]:
    """One launcher session's start-up, compilation (up to each attempt's first step, that
    step included), detection and restart seconds, from its attempts (each with spawned_unix_s,
    compile_unix_s, first_step_unix_s, ended_unix_s) and the incidents it detected."""
    startup_s = compile_s = 0.0
    for attempt in attempts:
        end = attempt.ended_unix_s if attempt.ended_unix_s is not None else ended_unix_s
        compiled = attempt.compile_unix_s if attempt.compile_unix_s is not None else end
        first_step = attempt.first_step_unix_s if attempt.first_step_unix_s is not None else end
        startup_s += max(compiled - attempt.spawned_unix_s, 0.0)
        compile_s += max(first_step - compiled, 0.0)
    detection_s = sum(max(incident["detection_latency_s"], 0.0) for incident in incidents)
    restart_s = 0.0
    for incident, attempt in zip(incidents, attempts[1:], strict=False):
        restart_s += max(attempt.spawned_unix_s - incident["detected_unix_s"], 0.0)
    return {
        "startup_s": startup_s,
        "compile_s": compile_s,
        "detection_s": detection_s,
        "restart_s": restart_s,
    }


def corruption_verdicts(run_dir: RunDir) -> dict[str, int]:
    """How many of each verdict the corruption guard logged in RUN_DIR/replica_mismatches.jsonl
    (transient, persistent, undecided, compute_check); the mismatches themselves are not
    verdicts."""
    counts: dict[str, int] = {}
    for record in read_records(run_dir.replica_mismatches):
        event = record.get("event")
        if isinstance(event, str) and event != "mismatch":
            counts[event] = counts.get(event, 0) + 1
    return counts


def write_goodput(run_dir: RunDir, sessions: list[dict[str, Any]], outcome: str) -> str:
    """Write RUN_DIR/goodput.json for the whole run and return a one-line summary.

    `sessions`: every launcher session of the run so far, oldest first (RUN_DIR/launches.jsonl's
    records, then the current one), each with started_unix_s, ended_unix_s, attempts (a list),
    incidents (a count) and split_s (session_split). Wall time runs from the first session's start
    to the last one's end; the gaps between sessions (a scheduler requeueing and starting the job
    again) count as lost, as `scheduler_s`.
    """
    started_unix_s = sessions[0]["started_unix_s"]
    ended_unix_s = sessions[-1]["ended_unix_s"]
    wall_s = max(ended_unix_s - started_unix_s, 1e-9)
    steps = step_time_split(read_records(run_dir.metrics))
    totals = {key: sum(s["split_s"][key] for s in sessions) for key in sessions[-1]["split_s"]}
    scheduler_s = sum(
        max(later["started_unix_s"] - earlier["ended_unix_s"], 0.0)
        for earlier, later in pairwise(sessions)
    )
    # each attempt's compile window ends with its first step, whose typical part is a step
    compile_s = max(totals["compile_s"] - steps["first_step_typical_s"], 0.0)
    breakdown = {
        "step_s": steps["kept_step_s"] - steps["data_s"],
        "data_s": steps["data_s"],
        "checkpoint_s": steps["checkpoint_s"],
        "startup_s": totals["startup_s"],
        "compile_s": compile_s,
        "lost_progress_s": steps["superseded_step_s"] + totals["detection_s"],
        "restart_s": totals["restart_s"],
        "scheduler_s": scheduler_s,
    }
    breakdown["other_s"] = max(wall_s - sum(breakdown.values()), 0.0)
    ratio = steps["kept_step_s"] / wall_s
    attempts = sum(len(session["attempts"]) for session in sessions)
    incidents = sum(session["incidents"] for session in sessions)
    summary = {
        "outcome": outcome,
        "wall_s": round(wall_s, 3),
        "effective_training_time_ratio": round(ratio, 4),
        "steps": steps["kept_steps"],
        "launches": len(sessions),
        "attempts": attempts,
        "incidents": incidents,
        "corruption_verdicts": corruption_verdicts(run_dir),
        "breakdown_s": {key: round(value, 3) for key, value in breakdown.items()},
    }
    rewrite_best_effort(run_dir.goodput, json.dumps(summary, indent=1) + "\n")  # full disk: warns
    shares = ", ".join(
        f"{key[:-2]} {100 * value / wall_s:.0f}%" for key, value in breakdown.items() if value > 0
    )
    launches = f"{len(sessions)} launches, " if len(sessions) > 1 else ""
    verdicts = "".join(
        f", {count} {verdict.replace('_', ' ')}"
        for verdict, count in summary["corruption_verdicts"].items()
    )
    return (
        f"goodput: effective training time {100 * ratio:.1f}% of {wall_s:.0f} s wall "
        f"({launches}{attempts} attempts, {incidents} incidents{verdicts}; {shares})"
    )
