"""Incidents: the diagnostics the supervisor collects after a fault (RUN_DIR/incidents/<n>/: stacks,
log tails, heartbeats, flight records and their verdict) and RUN_DIR/incidents.jsonl, one record
per incident, completed with restart and catch-up times as the next attempt progresses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msjax.launch.attempt import Attempt
from msjax.launch.fault_detection import CORRUPTION_KEYS, DetectedFault
from msjax.launch.policy import Action
from msjax.launch.workers import describe_exit
from msjax.observe.flight_recorder import diagnose
from msjax.observe.goodput import read_records
from msjax.resilience.fault_kinds import UNATTRIBUTED_CORRUPTION
from msjax.resilience.heartbeat import STARTUP_MARKS, STARTUP_PHASES
from msjax.run_dir import RunDir
from msjax.writable import (
    AppendLog,
    open_no_follow,
    read_no_follow,
    rewrite_best_effort,
    warn_write_dropped,
)

STACK_DUMP_WAIT_S = 1.0


@dataclass(frozen=True)
class IncidentDir:
    """The files of one incident's diagnostics, RUN_DIR/incidents/<n>/."""

    path: Path

    def stacks(self, rank: int) -> Path:
        """Rank's Python stacks, dumped on SIGUSR1 when the fault was detected."""
        return self.path / f"stacks-rank{rank}.txt"

    def log_tail(self, rank: int) -> Path:
        return self.path / f"log-rank{rank}.txt"

    @property
    def heartbeats(self) -> Path:
        """The fault, and each rank's pid, exit, process state and last heartbeat."""
        return self.path / "heartbeats.json"

    def flight_copy(self, flight_record: Path) -> Path:
        """Where a rank's flight record (RunDir.flight_record) is copied."""
        return self.path / f"flight-{flight_record.name}"


def flight_verdict(run_dir: RunDir, incident: IncidentDir) -> str | None:
    """The flight recorders' comparison (which rank stopped short of the others), with a copy
    of every rank's dump in the incident's directory."""
    for dump in run_dir.flight_records():
        copy_best_effort(dump, incident.flight_copy(dump))
    verdict = diagnose(run_dir.path)
    return None if verdict is None else verdict.summary


def collect_diagnostics(
    attempt: Attempt, fault: DetectedFault, run_dir: RunDir, incident: IncidentDir
) -> None:
    """Every live worker's Python stacks (SIGUSR1; a stopped one is continued to answer), each
    worker's log tail, and a summary of every rank's state, into the incident's directory."""
    live = [worker for worker in attempt.workers if worker.alive]
    states = {worker.rank: worker.state() for worker in live}
    for worker in live:
        # a worker hung before its first heartbeat has no heartbeats/ directory yet
        stacks = run_dir.stacks(worker.rank)
        with contextlib.suppress(OSError):  # a full disk: the dump below is simply not there
            stacks.parent.mkdir(parents=True, exist_ok=True)
        try:  # emptied in place (the worker holds it open), without following a link
            open_no_follow(stacks, "w").close()
        except OSError as error:
            warn_write_dropped(stacks, error)
        worker.signal(signal.SIGUSR1)
        if states[worker.rank] in ("T", "t"):
            worker.signal(signal.SIGCONT)  # a stopped process handles the dump once continued
    deadline = time.monotonic() + STACK_DUMP_WAIT_S
    while time.monotonic() < deadline:
        if all(_size(run_dir.stacks(w.rank)) > 0 for w in live if w.alive):
            time.sleep(0.1)  # let the last thread's lines land
            break
        time.sleep(0.05)
    for worker in live:
        source = run_dir.stacks(worker.rank)
        if _size(source):
            copy_best_effort(source, incident.stacks(worker.rank))
    ranks = {}
    for worker in attempt.workers:
        record = attempt.heartbeats.get(worker.rank)
        ranks[str(worker.rank)] = {
            "pid": worker.pid,
            "exit": None if worker.exit_code is None else describe_exit(worker.exit_code),
            "process_state": states.get(worker.rank),
            "heartbeat": None if record is None else record.__dict__,
        }
        rewrite_best_effort(incident.log_tail(worker.rank), worker.log_tail())
    summary = {"cause": fault.cause, "rank": fault.rank, "detail": fault.detail, "ranks": ranks}
    rewrite_best_effort(incident.heartbeats, json.dumps(summary, indent=1) + "\n")


def copy_best_effort(source: Path, target: Path) -> None:
    """A copy of a run dir file for the incident: read without following a link, written (or
    dropped, on a full disk, with one warning) like every diagnostic."""
    try:
        text = read_no_follow(source).decode(errors="replace")
    except OSError:
        return  # gone, or not a regular file: nothing of it to keep
    rewrite_best_effort(target, text)


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except OSError:
        return 0


@dataclass(kw_only=True)
class Incident:
    """One incident's record in incidents.jsonl, as detected and handled; the restart fields are
    filled in as the attempt after it progresses (progress). The keys of OPTIONAL appear in the
    record only once set."""

    incident: int
    cause: str
    rank: int | None
    detail: str
    attempt: int | None  # None: a requeue, before the session's first attempt
    launch: int | None = None  # a requeue: the launch it opens
    phase: str | None
    step: int
    fault_unix_s: float
    fault_time_from: str
    detected_unix_s: float
    detection_latency_s: float
    stop_s: float
    scheduler_s: float | None = None  # a requeue: the scheduler's share (requeue and start)
    diagnostics: str | None
    flight_recorder: str | None
    action: str = "restart"
    resumed_from_step: int | None = None
    resumed_from: str | None = None  # disk or memory (a snapshot); None: a new state
    memory_not_used: str | None = None  # why memory snapshots were passed over, where they were
    # each rank's restore: {"source": own, buddy (memory snapshots) or disk, "bytes", "seconds"}
    restored_by_rank: dict[str, dict[str, Any]] | None = None
    steps_lost: int | None = None
    restart_s: float | None = None
    catch_up_s: float | None = None
    killed_after_grace: list[int] | None = None  # ranks that did not stop on SIGTERM in time
    killed_at_once: list[int] | None = None  # other ranks with nothing to finish: no grace
    stop_reason: str | None = None
    skipped_step: int | None = None
    backoff_s: float | None = None
    restart: int | None = None
    restart_to_first_step_s: float | None = None
    # where the restart's seconds went: when the last rank reached each start-up mark
    # (msjax.resilience.heartbeat.STARTUP_MARKS), in seconds after the spawn
    startup_s: dict[str, float] | None = None
    bad_slot: dict[str, Any] | None = None  # the fault's slot, marked bad (msjax.launch.slots)
    membership: dict[str, Any] | None = None  # a slot excluded or re-admitted, with its timings
    # silent corruption: the guard's verdict (event: transient, persistent, undecided,
    # compute_check), its step, window, the ranks it named and those it marked bad
    corruption: dict[str, Any] | None = None

    OPTIONAL = (
        "launch",
        "scheduler_s",
        "killed_after_grace",
        "killed_at_once",
        "stop_reason",
        "skipped_step",
        "backoff_s",
        "restart",
        "restart_to_first_step_s",
        "startup_s",
        "bad_slot",
        "membership",
        "corruption",
        "resumed_from",
        "memory_not_used",
        "restored_by_rank",
    )

    @classmethod
    def of_fault(
        cls,
        number: int,
        fault: DetectedFault,
        attempt: Attempt,
        stop_s: float,
        diagnostics: str,
        flight_recorder: str | None,
        killed_after_grace: list[int],
    ) -> Incident:
        return cls(
            incident=number,
            cause=fault.cause,
            # an undecided corruption verdict names no rank: none is blamed
            rank=None if fault.kind is UNATTRIBUTED_CORRUPTION else fault.rank,
            detail=fault.detail,
            attempt=attempt.number,
            phase=fault.phase,
            step=fault.step,
            fault_unix_s=fault.fault_unix_s,
            fault_time_from=fault.fault_time_from,
            detected_unix_s=fault.detected_unix_s,
            detection_latency_s=round(fault.detected_unix_s - fault.fault_unix_s, 3),
            stop_s=round(stop_s, 3),
            diagnostics=diagnostics,
            flight_recorder=flight_recorder,
            killed_after_grace=killed_after_grace,
            corruption=fault.corruption,
        )

    @classmethod
    def of_transient_corruption(cls, number: int, record: dict[str, Any], attempt: int) -> Incident:
        """A replica mismatch its replay did not reproduce (RUN_DIR/replica_mismatches.jsonl):
        the attempt went on from the replay, blaming the rank(s) that differed from their own."""
        ranks = [int(rank) for rank in record.get("ranks", ())]
        unix_s = float(record.get("unix_s", time.time()))
        return cls(
            incident=number,
            cause="silent_corruption",
            rank=ranks[0] if ranks else None,
            detail=(
                f"transient replica mismatch after step {record['step']} (window "
                f"{record['window'][0]}..{record['window'][1]}, first in {record['tensor']}); "
                "replayed from step "
                f"{record.get('replayed_from')}, rank(s) {', '.join(map(str, ranks)) or 'none'} "
                "differed from their own replay"
            ),
            attempt=attempt,
            phase="step",
            step=int(record["step"]),
            fault_unix_s=unix_s,
            fault_time_from="replica_mismatches.jsonl",
            detected_unix_s=unix_s,
            detection_latency_s=0.0,
            stop_s=0.0,
            diagnostics=None,
            flight_recorder=None,
            action="replay",
            corruption={key: record.get(key) for key in CORRUPTION_KEYS},
        )

    def take(self, action: Action) -> None:
        """What the supervisor decided (msjax.launch.policy)."""
        self.action = action.name
        if action.skip_step is not None:
            self.skipped_step = action.skip_step
        if action.stop_code is not None:
            self.stop_reason = action.reason
        else:
            self.backoff_s = action.backoff_s
            self.restart = action.restart
        if action.bad_slot is not None:
            self.bad_slot = {**dataclasses.asdict(action.bad_slot), "action": action.name}

    def progress(self, attempt: Attempt) -> bool:
        """Fill in restart and catch-up times as the attempt after the incident progresses;
        True once it has caught up after its first step and every rank's first step is done
        (the record is complete)."""
        detected = self.detected_unix_s
        if self.resumed_from_step is None and attempt.start_step is not None:
            self.resumed_from_step = attempt.start_step
            self.steps_lost = max(self.step - attempt.start_step, 0)
            self.resumed_from = attempt.start_source or None
        if self.resumed_from_step is not None:  # each rank's note, as its heartbeats arrive
            self.memory_not_used = memory_not_used(attempt) or self.memory_not_used
            self.restored_by_rank = restored_by_rank(attempt) or self.restored_by_rank
            self.startup_s = startup_seconds(attempt) or self.startup_s
        membership = self.membership
        if membership and membership["first_step_unix_s"] is None and attempt.first_step_unix_s:
            membership["first_step_unix_s"] = attempt.first_step_unix_s  # on the new mesh
            if membership.get("first_fault_unix_s") is not None:
                membership["first_fault_to_new_mesh_s"] = round(
                    attempt.first_step_unix_s - membership["first_fault_unix_s"], 3
                )
        if self.restart_s is None and attempt.first_step_unix_s is not None:
            self.restart_s = round(attempt.first_step_unix_s - detected, 3)
            self.restart_to_first_step_s = round(
                attempt.first_step_unix_s - attempt.spawned_unix_s, 3
            )
        caught_up = None
        if attempt.start_step is not None and attempt.start_step >= self.step:
            caught_up = attempt.compile_unix_s  # resumed at (or past) the pre-fault step
        elif attempt.max_step >= self.step and attempt.first_step_unix_s is not None:
            caught_up = max(
                record.unix_s
                for record in attempt.heartbeats.values()
                if record.phase not in STARTUP_PHASES
            )
        if caught_up is not None:
            self.catch_up_s = round(caught_up - detected, 3)
        # the split is whole once every rank's heartbeat says its first step is done
        split_whole = STARTUP_MARKS[-1] in (self.startup_s or {})
        return caught_up is not None and self.restart_s is not None and split_whole

    def record(self) -> dict[str, Any]:
        """The line of incidents.jsonl."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name not in self.OPTIONAL or getattr(self, field.name) is not None
        }


class IncidentLog:
    """RUN_DIR/incidents.jsonl. The newest incident stays open while the attempt after it
    resumes and catches up; it is written then, or when that attempt ends first."""

    def __init__(self, run_dir: RunDir, say: Callable[[str], None]):
        self.run_dir = run_dir
        self.path = run_dir.incidents_log
        self.say = say
        self.written: list[dict[str, Any]] = []  # this supervisor's incidents
        self.open_incident: Incident | None = None
        self.held: list[Incident] = []  # added while an incident was open (add)
        earlier = self._earlier_lines()
        self.count = sum(1 for line in earlier.splitlines() if line.strip())
        # transient corruption verdicts earlier supervisors of this run made incidents of
        self.transients_recorded = earlier.count('"event": "transient"')

    def _earlier_lines(self) -> str:
        """The incidents of earlier supervisors of this run (numbers go on from theirs)."""
        try:
            return read_no_follow(self.path).decode(errors="replace")
        except FileNotFoundError:
            return ""

    def record_transient_corruption(self, attempt: Attempt) -> None:
        """Every transient verdict the guard logged (RUN_DIR/replica_mismatches.jsonl) and no
        incident records yet becomes one (the final verdicts end their attempt: the fault's
        incident carries them)."""
        records = [
            record
            for record in read_records(self.run_dir.replica_mismatches)
            if record.get("event") == "transient"
        ]
        for record in records[self.transients_recorded :]:
            self.add(Incident.of_transient_corruption(self.next_number(), record, attempt.number))
            self.transients_recorded += 1

    def next_number(self) -> int:
        """The next incident number, claimed by making RUN_DIR/incidents/<n>/ (mkdir is atomic,
        on a shared file system too), so the launchers of a multi-node job never take the same
        number; where the folder cannot be made (a full disk), the next after this log's count."""
        candidate = self.count + 1
        while True:
            try:
                self.run_dir.incident(candidate).mkdir(parents=True)
            except FileExistsError:
                candidate += 1
                continue
            except OSError:
                pass
            self.count = candidate
            return candidate

    def open(self, incident: Incident) -> None:
        self.open_incident = incident

    def update(self, attempt: Attempt) -> None:
        """Fill in restart and catch-up times as the attempt after an incident progresses."""
        incident = self.open_incident
        if incident is None or incident.attempt == attempt.number:
            return
        if incident.progress(attempt):
            self.write()  # after the first step, even if resumed at or past the fault's step

    def close(self, attempt: Attempt) -> None:
        """The attempt ended: write the open incident with what it got to know."""
        if self.open_incident is not None:
            self.update(attempt)
        if self.open_incident is not None:
            self.write()
        self.record_transient_corruption(attempt)

    def add(self, incident: Incident) -> None:
        """An incident no attempt stops for (a slot kept out after its check for re-admission):
        written now, or right after the open one so that the log stays in number order. It is
        not one of `written`, the faults the goodput split counts against attempts."""
        if self.open_incident is None:
            self._append(incident.record())
        else:
            self.held.append(incident)

    def write(self) -> None:
        incident = self.open_incident
        assert incident is not None
        self.open_incident = None
        record = incident.record()
        self.written.append(record)
        self._append(record)
        for held in self.held:
            self._append(held.record())
        self.held.clear()
        if incident.catch_up_s is not None:
            self.say(
                f"incident {incident.incident}: caught up with step {incident.step} "
                f"{incident.catch_up_s:.1f} s after detection"
            )

    def _append(self, record: dict[str, Any]) -> None:
        log = AppendLog(self.path)  # a full disk drops the record with one warning
        log.write(json.dumps(record) + "\n")
        log.close()


def memory_not_used(attempt: Attempt) -> str:
    """Why the attempt's ranks passed over their memory snapshots, each in its own words ("" where
    none had any): the rank whose snapshot failed its check names the file."""
    notes = {rank: record.start_note for rank, record in attempt.heartbeats.items()}
    return "; ".join(f"rank {rank}: {note}" for rank, note in sorted(notes.items()) if note)


def restored_by_rank(attempt: Attempt) -> dict[str, dict[str, Any]]:
    """Each rank's restore as its heartbeat names it (source, bytes, seconds), by rank."""
    return {
        str(rank): record.start_restore
        for rank, record in sorted(attempt.heartbeats.items())
        if record.start_restore
    }


def startup_seconds(attempt: Attempt) -> dict[str, float]:
    """Each start-up mark every rank has reached, in the order of STARTUP_MARKS: seconds from the
    attempt's spawn to the last rank's reaching it (a warm standby's `main`: its hand-over)."""
    marks = [record.startup for record in attempt.heartbeats.values()]
    if len(marks) < len(attempt.workers):
        return {}
    return {
        name: round(max(mark[name] for mark in marks) - attempt.spawned_unix_s, 3)
        for name in STARTUP_MARKS
        if all(name in mark for mark in marks)
    }
