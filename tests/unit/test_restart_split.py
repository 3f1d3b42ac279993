"""Where a restart's seconds go: each worker's heartbeat carries the start-up marks it has
reached, and the incident names when the last rank reached each, counted from the spawn."""

from __future__ import annotations

import time

from msjax.launch.attempt import Attempt
from msjax.launch.fault_detection import DetectedFault
from msjax.launch.incidents import Incident
from msjax.resilience import fault_kinds
from msjax.resilience.heartbeat import (
    STARTUP_MARKS,
    Heartbeat,
    HeartbeatRecord,
    mark_startup,
)


def test_a_heartbeat_carries_the_start_up_marks_reached_first_time_kept(tmp_path):
    mark_startup("first_batch")
    reached = HeartbeatRecord.read(write_beat(tmp_path)).startup["first_batch"]
    while time.time() == reached:  # a later batch, at a later time
        pass
    mark_startup("first_batch")  # the first batch's time stays
    assert HeartbeatRecord.read(write_beat(tmp_path)).startup["first_batch"] == reached
    assert set(HeartbeatRecord.read(write_beat(tmp_path)).startup) <= set(STARTUP_MARKS)


def write_beat(tmp_path):
    heartbeat = Heartbeat(tmp_path, rank=0, every_s=0.0)
    heartbeat.beat("step", 1)
    return heartbeat.path


def beat(rank: int, startup: dict[str, float]) -> HeartbeatRecord:
    return HeartbeatRecord(
        rank, 100 + rank, 1, 11, 10, "step", 107.0, 108.0, start_source="memory", startup=startup
    )


def test_the_incident_times_each_mark_by_the_last_rank_to_reach_it():
    attempt = Attempt(number=1, workers=[], spawned_unix_s=100.0)
    attempt.heartbeats = {
        0: beat(0, {"main": 100.5, "distributed_joined": 102.0, "first_step_done": 107.0}),
        1: beat(1, {"main": 101.0, "distributed_joined": 102.25}),  # its step not yet noted
    }
    attempt.start_step, attempt.compile_unix_s, attempt.first_step_unix_s = 10, 106.0, 107.0
    incident = Incident.of_fault(1, crash_detected_at(99.0), attempt, 0.1, "incidents/1", None, [])
    # rank 0's first step caught up with the fault's step, rank 1's is not on record yet:
    # the incident stays open
    assert incident.progress(attempt) is False
    record = incident.record()
    assert record["restart_s"] == 8.0
    # a mark only some ranks reached is left out until they all have
    assert record["startup_s"] == {"main": 1.0, "distributed_joined": 2.25}
    attempt.heartbeats[1] = beat(
        1, {"main": 101.0, "distributed_joined": 102.25, "first_step_done": 107.5}
    )
    assert incident.progress(attempt) is True  # the record is complete: it is written now
    assert incident.record()["startup_s"] == {
        "main": 1.0,
        "distributed_joined": 2.25,
        "first_step_done": 7.5,
    }


def crash_detected_at(detected_unix_s: float) -> DetectedFault:
    return DetectedFault(
        fault_kinds.CRASH, 1, "exit code 1", detected_unix_s, 98.9, "exit", 10, "step"
    )
