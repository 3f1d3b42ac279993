"""Slots: the places workers run (on one node, a process place of msjax.launch; across nodes, a
node), the faults each slot was the named cause of (RUN_DIR/health/slot_faults.jsonl, shared by
every node's launcher) and the slots marked bad (RUN_DIR/health/bad_slots.json)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from msjax.launch.layout import JobLayout
from msjax.observe.goodput import read_records
from msjax.run_dir import RunDir
from msjax.writable import AppendLog, read_no_follow, write_text_atomically


def node_name(environ: Mapping[str, str] = os.environ) -> str:
    """This node's name: Slurm's for it (SLURMD_NODENAME) when set, else the host's."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


def slot_of(layout: JobLayout, rank: int, node: str) -> str | None:
    """The slot that runs rank: on a multi-node job this node when rank runs here, None when it
    runs on another node (whose launcher blames its own); on one node its process place."""
    local_rank = rank - layout.process_id(0)
    if layout.nnodes == 1:
        return str(local_rank)
    return node if 0 <= local_rank < layout.nprocs else None


@dataclass(frozen=True)
class SlotFault:
    """A fault that names a slot as its cause. group: the attempt of the whole job it ended (the
    same on every node), so that the first fault of a group is told from those it caused."""

    slot: str
    rank: int
    cause: str
    incident: int
    fault_unix_s: float
    group: str

    @classmethod
    def of(cls, record: dict[str, Any]) -> SlotFault | None:
        try:
            return cls(
                str(record["slot"]),
                int(record["rank"]),
                str(record["cause"]),
                int(record["incident"]),
                float(record["fault_unix_s"]),
                str(record["group"]),
            )
        except (KeyError, TypeError, ValueError):
            return None


def faults_in_a_row(faults: Sequence[SlotFault], slot: str) -> list[SlotFault]:
    """The latest faults, oldest first, that slot was the named cause of with no fault of
    another slot between them. Of the faults of one group (one attempt of the job, seen on
    several nodes), the first to happen is the cause; the others are what it caused."""
    causes: dict[str, SlotFault] = {}
    for fault in faults:
        first = causes.get(fault.group)
        if first is None or fault.fault_unix_s < first.fault_unix_s:
            causes[fault.group] = fault
    in_a_row: list[SlotFault] = []
    for fault in sorted(causes.values(), key=lambda fault: fault.fault_unix_s, reverse=True):
        if fault.slot != slot:
            break
        in_a_row.insert(0, fault)
    return in_a_row


def record_slot_fault(run_dir: RunDir, fault: SlotFault) -> None:
    """One line more in RUN_DIR/health/slot_faults.jsonl (a full disk drops it, one warning)."""
    with contextlib.suppress(OSError):
        run_dir.health.mkdir(exist_ok=True)
    log = AppendLog(run_dir.slot_faults)
    log.write(json.dumps(asdict(fault)) + "\n")
    log.close()


def read_slot_faults(run_dir: RunDir) -> list[SlotFault]:
    """Every slot fault of the run, in the order written (a line cut short is skipped)."""
    faults = (SlotFault.of(record) for record in read_records(run_dir.slot_faults))
    return [fault for fault in faults if fault is not None]


@dataclass(frozen=True)
class BadSlot:
    """A slot marked bad, why, and what the supervisor does about it (resilience.on_bad_node)."""

    slot: str
    node: str
    rank: int
    reason: str
    on_bad_node: str  # exclude or restart
    incidents: tuple[int, ...]


def read_bad_slots(run_dir: RunDir) -> list[dict[str, Any]]:
    """The records of RUN_DIR/health/bad_slots.json, [] if none (or garbled)."""
    try:
        slots = json.loads(read_no_follow(run_dir.bad_slots))["slots"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return slots if isinstance(slots, list) else []


def mark_bad(run_dir: RunDir, bad: BadSlot, marked_unix_s: float) -> None:
    """Add (or renew) bad's record in RUN_DIR/health/bad_slots.json, written atomically."""
    slots = [record for record in read_bad_slots(run_dir) if record.get("slot") != bad.slot]
    record = {**asdict(bad), "incidents": list(bad.incidents), "marked_unix_s": marked_unix_s}
    run_dir.health.mkdir(exist_ok=True)
    text = json.dumps({"slots": [*slots, record]}, indent=1) + "\n"
    write_text_atomically(run_dir.bad_slots, text)
