"""The split of a run's step time: what counts as kept, lost, data and first-step time."""

from __future__ import annotations

import pytest

from msjax.observe.goodput import step_time_split


def step(index: int, seconds: float, data_wait_s: float = 0.0) -> dict:
    return {"step": index, "loss": 1.0, "step_time_s": seconds, "data_wait_s": data_wait_s}


def test_a_step_in_flight_at_a_hang_counts_as_a_typical_lost_step():
    """Rank 0 stopped during step 4 for 8 s, resumed only to be stopped, and recorded it."""
    records = [
        step(0, 2.0),  # the first step of an attempt also waits for compilation
        *[step(index, 0.2) for index in (1, 2, 3)],
        step(4, 8.2),  # superseded: redone after the restart
        {"step": 4, "event": "resume", "checkpoint": "checkpoints/4"},
        step(4, 1.5),  # the restart's first step
        step(5, 0.2),
    ]
    split = step_time_split(records)
    assert split["superseded_step_s"] == pytest.approx(0.2)  # not the 8.2 s the fault held it
    # kept: steps 0-3 and 5 as recorded, except first steps, which count as a typical step
    assert split["kept_step_s"] == pytest.approx(0.2 + 3 * 0.2 + 0.2 + 0.2)
    assert split["first_step_typical_s"] == pytest.approx(0.4)
    assert split["kept_steps"] == 6


def test_a_superseded_step_of_typical_length_counts_in_full():
    records = [
        step(0, 0.3),
        step(1, 0.25),
        step(2, 0.25),
        {"step": 1, "event": "resume", "checkpoint": "checkpoints/1"},
        step(1, 0.25),
        step(2, 0.25, data_wait_s=0.05),
    ]
    split = step_time_split(records)
    assert split["superseded_step_s"] == pytest.approx(0.5)
    assert split["data_s"] == pytest.approx(0.05)


def test_a_memory_snapshots_stall_is_a_checkpoint_pause_not_the_next_steps_time():
    """Snapshots every step (checkpoint.memory_every_steps=1), each stalling the loop 0.3 s:
    the stall is inside the time of the step recorded after it."""
    stall = {"memory_snapshot_stall_s": 0.3, "memory_snapshot_bytes": 1000}
    records = [
        step(0, 0.2),
        {"step": 0, **stall},
        step(1, 0.5),
        {"step": 1, **stall},
        step(2, 0.5),
        {"step": 2, **stall},
        {"step": 3, "checkpoint_save_blocked_s": 1.0},
        step(3, 0.5),
    ]
    split = step_time_split(records)
    assert split["kept_step_s"] == pytest.approx(4 * 0.2)
    assert split["checkpoint_s"] == pytest.approx(3 * 0.3 + 1.0)
    assert split["superseded_step_s"] == 0.0


def test_goodput_of_a_requeued_run_spans_every_launch_and_counts_the_wait_between_as_lost(
    tmp_path,
):
    """Two launches of one run (a preempted Slurm job and its requeue), 40 s apart."""
    import json

    from msjax.observe.goodput import write_goodput
    from msjax.run_dir import RunDir

    run_dir = RunDir(tmp_path)
    records = [step(0, 1.0), step(1, 1.0), {"step": 2, "event": "resume"}, step(2, 1.0)]
    run_dir.metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    split = {"startup_s": 5.0, "compile_s": 3.0, "detection_s": 0.0, "restart_s": 0.0}
    launches = [
        {"started_unix_s": 100.0, "ended_unix_s": 130.0, "attempts": [{}], "incidents": 0},
        {"started_unix_s": 170.0, "ended_unix_s": 200.0, "attempts": [{}, {}], "incidents": 2},
    ]
    summary = write_goodput(run_dir, [{**launch, "split_s": split} for launch in launches], "done")
    goodput = json.loads(run_dir.goodput.read_text())
    assert goodput["wall_s"] == 100.0  # from the first launch's start to the last one's end
    assert goodput["breakdown_s"]["scheduler_s"] == 40.0
    assert goodput["breakdown_s"]["startup_s"] == 10.0
    assert (goodput["launches"], goodput["attempts"], goodput["incidents"]) == (2, 3, 2)
    assert goodput["effective_training_time_ratio"] == pytest.approx(3.0 / 100.0)
    assert "2 launches, 3 attempts, 2 incidents" in summary
