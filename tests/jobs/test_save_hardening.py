"""Saves under real faults: a disk that fills in the background, a save that fails on one
process of two, a worker killed in a save. A save counts only once committed, every process
enters it or skips it together, and nothing a failed or killed save wrote outlives a restart."""

from __future__ import annotations

import itertools
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from checkpoint_fault_helpers import (
    SMALL_RUN,
    committed_on_disk,
    mounted_tmpfs,
    stopped_step,
    unfinished_on_disk,
)
from checkpoint_fault_helpers import start_run as start_run  # a fixture, re-exported for pytest
from harness import LaunchJob, TrainJob

from msjax.config import CheckpointConfig
from msjax.resilience import exit_codes
from msjax.run_dir import RunDir
from msjax.training.save_schedule import SaveSchedule

CHECKPOINT_DISK_MIB = (
    4  # the checkpoints' own disk: the tiny model's state (about 10 MB) never fits
)


def run_train(run_dir: Path, overrides: list[str], **env: str) -> tuple[int, str]:
    """`python -m msjax.train`: its exit code and output."""
    ended = TrainJob.start(run_dir, overrides, env=env).finish()
    return ended.exit_code, ended.output


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    lines = RunDir(run_dir).metrics.read_text().splitlines()
    return [record for record in map(json.loads, lines) if "loss" in record]


# --- a disk that fills while saves are written in the background ---------------------------------


@pytest.mark.slow
def test_saves_failing_in_the_background_end_the_attempt_after_max_unsaved_minutes(tmp_path):
    """Saves fail while being written (or, with the disk still full, as they start) on a disk too
    small for any, each failure a few lines: none is committed, so the failures and the unsaved
    clock keep running until exit 6, long before the run's last step; each failed save's partial
    files are removed once it is known failed."""
    run_dir = tmp_path / "run"
    steps = 100_000  # it ends by exit 6, however fast it steps
    overrides = [
        *SMALL_RUN,
        "data.max_corpus_mib=1",
        f"train.steps={steps}",
        "checkpoint.every_steps=2",
        "checkpoint.max_unsaved_minutes=0.25",
    ]
    checkpoints = RunDir(run_dir).checkpoints
    with mounted_tmpfs(checkpoints, CHECKPOINT_DISK_MIB):
        started = time.monotonic()
        code, output = run_train(run_dir, overrides)
        wall_s = time.monotonic() - started
        committed, unfinished = committed_on_disk(checkpoints), unfinished_on_disk(checkpoints)
    assert code == exit_codes.SAVES_FAILED, output[-4000:]
    assert "kept failing for checkpoint.max_unsaved_minutes=0.25" in output, output[-4000:]
    # each failed save is msjax's warning and Orbax's error lines, one line each: no traceback
    # from Orbax's threads, none from the writes still pending when Orbax closed its event loop
    assert "Traceback" not in output and "Event loop is closed" not in output, output[:4000]
    # a save fails in the background (not committed), or, when the disk is still full of the
    # one before, already when it starts (not started); either counts as one failure in a row
    failed = [line for line in output.splitlines() if "warning: checkpoint save at step" in line]
    in_background = [line for line in failed if "failed (not committed" in line]
    # the write's own error (ENOSPC, whatever Orbax wrapped it in), or (when Orbax logged it and
    # went on) the step found unfinalized
    reasons = ("No space left on device", "os_error_code='28'", "was not finalized")
    assert in_background, output[-4000:]
    assert all(any(r in line for r in reasons) for line in in_background), in_background
    # the back-off spaces the retries (1 s, 2 s, 4 s, 8 s within 15 s), not one per step; how
    # many fit depends on how long each failing save takes to be known failed (the machine's load)
    pauses = [float(line.rsplit("retried in ", 1)[1].split()[0]) for line in failed]
    assert pauses == [2.0**n for n in range(len(pauses))], failed
    assert len(failed) <= 6, output[-4000:]
    trained = max(record["step"] for record in step_records(run_dir)) + 1
    assert trained < steps, f"ran to the end ({trained} steps in {wall_s:.0f} s)"
    assert committed == []
    assert len(unfinished) <= 1  # at most the save in flight at the exit


# --- a save that fails on one process of two ----------------------------------------------------


def flight_events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    return json.loads(RunDir(run_dir).flight_record(rank).read_text())["events"]


def checkpoint_spans(run_dir: Path, rank: int) -> dict[int, float]:
    """How long each save held rank's loop: its checkpoint_begin to checkpoint_end, by step."""
    begun: dict[int, float] = {}
    spans: dict[int, float] = {}
    for event in flight_events(run_dir, rank):
        if event["event"] == "checkpoint_begin":
            begun[event["step"]] = event["t"]
        elif event["event"] == "checkpoint_end":
            spans[event["step"]] = event["t"] - begun[event["step"]]
    return spans


@pytest.fixture(scope="module")
def one_rank_fails_a_save(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """A 2-process job (msjax.launch) whose save of step 2 fails on rank 1 only (ENOSPC). It runs
    until a save after step 2 is committed (the retry, 1 s later, however fast the machine
    steps), then gets SIGTERM and both processes save the step they stop at."""
    run_dir = tmp_path_factory.mktemp("one_rank") / "run"
    cache_dir = tmp_path_factory.mktemp("compile_cache")
    overrides = [
        "model.num_layers=2", "data.seq_len=32", "data.max_corpus_mib=1",
        "train.global_batch=8", "train.steps=100000", "train.eval_every=0",
        "train.peak_tflops=0.5", "checkpoint.every_steps=2", "mesh.data=2", "mesh.fsdp=2",
        "mesh.tensor=1", "resilience.max_restarts=0", f"resilience.compile_cache_dir={cache_dir}",
    ]  # fmt: skip
    job = LaunchJob.start(
        run_dir,
        overrides,
        nprocs=2,
        devices_per_proc=2,
        launch_flags=["--fault=save_error@step=2,rank=1"],
        log_path=run_dir.parent / "launch.log",
    )
    checkpoints = RunDir(run_dir).checkpoints
    try:
        job.wait_for(
            lambda: [step for step in committed_on_disk(checkpoints) if step > 2],
            "a save after step 2 committed",
        )
        ended = job.stop(signal.SIGTERM)
    finally:
        job.kill()
    return run_dir, ended.exit_code, ended.output


@pytest.mark.slow
def test_a_save_failing_on_one_process_is_skipped_by_all_without_waiting(one_rank_fails_a_save):
    run_dir, code, output = one_rank_fails_a_save
    assert code == exit_codes.TERMINATED, output[-5000:]
    spans = [checkpoint_spans(run_dir, rank) for rank in (0, 1)]
    # rank 0 did not wait in Orbax's save barrier (300 s) for rank 1, which never entered it
    assert spans[0][2] < 30 and spans[1][2] < 30, spans
    logs = [RunDir(run_dir).log(rank).read_text().splitlines() for rank in (0, 1)]
    skipped = [
        [line for line in log if "at step 2 failed (skipped by every process" in line]
        for log in logs
    ]
    assert [len(lines) for lines in skipped] == [1, 1], skipped
    assert "another process could not start it" in skipped[0][0]  # rank 0 was ready
    assert "No space left on device" in skipped[1][0]  # rank 1's own failure
    assert not RunDir(run_dir).incidents_log.exists()  # no hang, no restart


@pytest.mark.slow
def test_both_processes_retry_the_skipped_save_together_and_it_commits(one_rank_fails_a_save):
    run_dir, code, output = one_rank_fails_a_save
    assert code == exit_codes.TERMINATED, output[-5000:]
    saved = [sorted(checkpoint_spans(run_dir, rank)) for rank in (0, 1)]
    assert saved[0] == saved[1], saved  # every save entered by both processes, at one step
    retry, stopped = saved[0][1], saved[0][-1]  # the first save after step 2's; SIGTERM's
    assert 2 < retry <= stopped, saved
    committed = committed_on_disk(RunDir(run_dir).checkpoints)
    assert retry in committed or retry < min(committed), committed  # committed (maybe pruned)
    assert 2 not in committed and committed[-1] == stopped == stopped_step(output), committed


# --- a worker killed in a save ------------------------------------------------------------------


@pytest.mark.slow
def test_a_save_killed_mid_write_leaves_nothing_behind_after_the_restart(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*SMALL_RUN, "checkpoint.every_steps=2", "checkpoint.max_to_keep=5"]
    code, output = run_train(
        run_dir, [*overrides, "train.steps=6"], MSJAX_FAULT="crash_in_save@step=4,rank=0"
    )
    assert code == 1, output[-4000:]  # the injected crash
    checkpoints = RunDir(run_dir).checkpoints
    left = unfinished_on_disk(checkpoints)
    assert committed_on_disk(checkpoints) == [2] and left, (left, output[-4000:])

    code, output = run_train(run_dir, [*overrides, "train.steps=6"])
    assert code == 0, output[-4000:]
    assert f"removed {len(left)} unfinished saves in {checkpoints}" in output, output[-4000:]
    assert unfinished_on_disk(checkpoints) == []
    assert committed_on_disk(checkpoints) == [2, 4, 6]


# --- a save due by the clock that fails --------------------------------------------------------


@pytest.mark.slow
def test_a_failed_save_due_by_the_clock_is_retried_on_the_back_off_not_at_every_step(
    tmp_path, start_run
):
    """Three saves due by the clock fail in a row; the run goes on (however fast the machine
    steps) until the fourth is committed, then gets SIGTERM."""
    run_dir = tmp_path / "run"
    overrides = [
        *SMALL_RUN,
        "model.num_layers=2",
        "train.steps=100000",
        "checkpoint.every_steps=0",
        "checkpoint.every_minutes=0.02",
        "observe.flight_recorder_events=4096",
    ]
    run = start_run(run_dir, overrides, MSJAX_FAULT="save_error@step=1,rank=0,times=3")
    run.wait_for(lambda: committed_on_disk(RunDir(run_dir).checkpoints), "a committed save")
    code = run.stop(signal.SIGTERM).exit_code
    output = run.output
    assert code == exit_codes.OK, output[-4000:]  # stopped by SIGTERM, saved
    begun = [  # the saves tried in the loop (not the one SIGTERM asked for)
        event["t"]
        for event in flight_events(run_dir, 0)
        if event["event"] == "checkpoint_begin" and event["step"] < stopped_step(output)
    ]
    failed = [
        line
        for line in output.splitlines()
        if line.startswith("warning: checkpoint save at step") and "injected save_error" in line
    ]
    assert len(failed) == 3 and len(begun) >= 4, (failed, begun)
    gaps = [later - earlier for earlier, later in itertools.pairwise(begun[:4])]
    # retried 1 s, 2 s, 4 s after each failure, not at the next step because the clock still
    # says a save is due
    assert all(gap >= pause for gap, pause in zip(gaps, (1, 2, 4), strict=True)), gaps
    assert committed_on_disk(RunDir(run_dir).checkpoints)[-1] == stopped_step(output)


def test_one_schedule_answers_save_now_and_while_saves_fail_only_its_back_off_does():
    schedule = SaveSchedule(CheckpointConfig(every_steps=2, every_minutes=0.1 / 60))
    assert schedule.due_by_steps(4) and not schedule.due_by_steps(3)
    assert not schedule.due_by_clock()
    time.sleep(0.15)
    assert schedule.due_by_clock()
    schedule.tried()
    schedule.failed()
    time.sleep(0.15)
    # failing: neither the step count nor the clock brings the retry closer than its pause
    assert not (schedule.due_by_steps(4) or schedule.due_by_clock() or schedule.retry_due())
    time.sleep(0.9)
    assert schedule.retry_due()
    retried_s = schedule.tried()
    schedule.in_flight = True  # the retry started; its outcome is not known yet
    assert not schedule.retry_due() and schedule.failures == 1
    schedule.committed(retried_s)
    assert schedule.failures == 0 and schedule.due_by_steps(4) and not schedule.overdue()
