"""Flight recorder: each rank's ring buffer of its last events, on disk, and the comparison that
names the rank that did not reach the point the others reached (MegaScale: the first failed rank
of a hang, from each rank's last logged operation).

A daemon thread rewrites RUN_DIR/flight/rank<r>.json twice a second with the buffer and an
`alive_at` time, so the record survives a hang (the loop blocked in a collective), SIGKILL
(the last dump stays) and SIGSTOP (the dumps stop: the rank went silent while others did not).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msjax.observe.rank_timing import describe_place
from msjax.run_dir import RunDir
from msjax.writable import read_no_follow, rewrite_best_effort

DUMP_EVERY_S = 0.5
# The order of a step's events: a rank that logged a later one got further in that step.
EVENT_ORDER = {
    "start": 0,
    "compiled": 1,
    "step_begin": 2,
    "step_dispatched": 3,
    "step_end": 4,
    "eval_begin": 5,
    "eval_end": 6,
    "checkpoint_begin": 7,
    "checkpoint_end": 8,
    "finished": 9,
}


class FlightRecorder:
    """record(event, step=..., **fields) appends to the ring buffer; close() dumps a last time."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        attempt: int,
        capacity: int,
        mesh: dict[str, list[int]] | None = None,
    ):
        self.path = RunDir(run_dir).flight_record(rank)
        with contextlib.suppress(OSError):  # a full disk: the dumps warn once, the loop goes on
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._identity = {
            "rank": rank,
            "attempt": attempt,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "mesh": mesh or {},  # this rank's mesh coordinates (rank_timing.mesh_coordinates)
        }
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self.record("start")
        self._thread = threading.Thread(target=self._run, name="msjax-flight-recorder", daemon=True)
        self._thread.start()

    def record(self, event: str, step: int | None = None, **fields: Any) -> None:
        entry = {"t": time.time(), "event": event, "step": step, **fields}
        with self._lock:
            self._events.append(entry)

    def _run(self) -> None:
        while not self._stop.wait(DUMP_EVERY_S):
            self.dump()

    def dump(self) -> None:
        """Write the buffer atomically (a reader never sees half a file); a disk too full for
        that overwrites the last dump in place or drops this one, with one warning."""
        with self._lock:
            content = {
                **self._identity,
                "alive_at": time.time(),
                "closed": self._closed,
                "events": list(self._events),
            }
        rewrite_best_effort(self.path, json.dumps(content))

    def close(self, event: str = "finished", step: int | None = None) -> None:
        self.record(event, step)
        self._stop.set()
        self._thread.join(timeout=2.0)
        with self._lock:
            self._closed = True
        self.dump()


@dataclass(frozen=True)
class FlightVerdict:
    """The rank that did not get as far as the others, and why we think so."""

    rank: int
    summary: str  # one line
    details: list[str]  # each rank's last event and when it was last alive


def read_flight_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's last dump of the newest attempt, by rank."""
    records = []
    for path in RunDir(run_dir).flight_records():
        try:
            records.append(json.loads(read_no_follow(path)))
        except (OSError, ValueError):
            continue  # a dump cut short: nothing to compare
    if not records:
        return []
    newest = max(record.get("attempt", 0) for record in records)
    return sorted((r for r in records if r.get("attempt", 0) == newest), key=lambda r: r["rank"])


def _position(event: dict[str, Any]) -> tuple[int, int]:
    step = event.get("step")
    return (-1 if step is None else int(step), EVENT_ORDER.get(event["event"], 0))


def _describe(event: dict[str, Any]) -> str:
    step = event.get("step")
    return event["event"] + ("" if step is None else f" {step}")


def diagnose(run_dir: Path) -> FlightVerdict | None:
    """Name the rank that stopped first: the one whose dumps stopped first while the others' went
    on (it is not running: stopped or dead), else the one whose last event is behind the point the
    others reached (alive but stuck).

    None when there is nothing to compare, or every rank finished.
    """
    records = read_flight_records(run_dir)
    if len(records) < 2 or all(record.get("closed") for record in records):
        return None
    last = {r["rank"]: r["events"][-1] for r in records if r["events"]}
    places = {r["rank"]: describe_place(r["mesh"]) for r in records if r.get("mesh")}

    def named(rank: int) -> str:
        return f"rank {rank} ({places[rank]})" if rank in places else f"rank {rank}"

    positions = {rank: _position(event) for rank, event in last.items()}
    alive_at = {r["rank"]: r["alive_at"] for r in records}
    newest_alive = max(alive_at.values())
    details = _rank_details(records, last, alive_at)
    furthest = max(positions.values())
    behind = [rank for rank, position in positions.items() if position < furthest]
    # A rank whose dumps stopped while the others' continued is not running (stopped or dead).
    closed = {r["rank"] for r in records if r.get("closed")}
    silent = [
        rank
        for rank, at in alive_at.items()
        if newest_alive - at > 4 * DUMP_EVERY_S and rank not in closed and rank in last
    ]
    if silent:  # a process that stopped running is the likeliest first cause: the others wait
        rank = min(silent, key=lambda r: alive_at[r])
        gap_s = newest_alive - alive_at[rank]
        where = (
            "short of the point the others reached" if rank in behind else "where the others are"
        )
        summary = (
            f"{named(rank)} went silent {gap_s:.1f} s before the others, at "
            f"{_describe(last[rank])} ({where}): it stopped running"
        )
        return FlightVerdict(rank, summary, details)
    if behind:
        rank = min(behind, key=lambda r: positions[r])
        others = sorted(set(last) - {rank})
        reached = _describe(max((last[r] for r in others), key=_position))
        summary = (
            f"{named(rank)} stopped at {_describe(last[rank])} while the others reached {reached}"
        )
        return FlightVerdict(rank, summary, details)
    return None


def _rank_details(
    records: list[dict[str, Any]], last: dict[int, dict[str, Any]], alive_at: dict[int, float]
) -> list[str]:
    """A line per rank (its last event, how long before the newest dump it was last alive),
    after a first line when the ranks compiled different programs."""
    programs = {
        e.get("fingerprint") for r in records for e in r["events"] if e["event"] == "compiled"
    }
    newest_alive = max(alive_at.values())
    details = [
        f"rank {rank}: last {_describe(last[rank])}, alive {newest_alive - alive_at[rank]:.1f} s "
        "before the newest dump" + (" (finished)" if r.get("closed") else "")
        for r in records
        for rank in [r["rank"]]
        if rank in last
    ]
    if len(programs) > 1:
        details.insert(
            0, "ranks compiled different programs: " + ", ".join(sorted(map(str, programs)))
        )
    return details
