"""A failure that repeats the same way after a restart is the program's, not the machine's: a
real supervised one-process job whose step 3 raises the same exception in every attempt stops
with exit 13 (software fault) after the second, marks no slot and names the exception, its step
and the log that holds its traceback."""

from __future__ import annotations

import json

import pytest
from harness import launch_command, run_to_end
from small_runs import QUICK_RUN

from msjax.resilience import exit_codes
from msjax.resilience.crash_records import read_crashes
from msjax.run_dir import RunDir

RAISE_STEP = 3


@pytest.fixture(scope="module")
def repeated_failure(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("software_fault") / "run"
    overrides = [
        *QUICK_RUN,
        "train.eval_every=0",
        "train.steps=6",
        "checkpoint.every_steps=2",
        "mesh.data=1",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "resilience.heartbeat_every_s=0.05",
        "resilience.restart_backoff_s=0.1",
        "resilience.max_faults_per_slot=2",  # before: the second crash marked the only slot bad
    ]
    flags = [f"--fault=raise@step={RAISE_STEP},rank=0"]
    done = run_to_end(launch_command(run_dir, overrides, launch_flags=flags))
    return done, RunDir(run_dir)


@pytest.mark.slow
def test_the_same_exception_at_the_same_step_twice_stops_with_a_software_fault(repeated_failure):
    done, run = repeated_failure
    assert done.returncode == exit_codes.SOFTWARE_FAULT, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-2:]
    line = next(line for line in last if line.startswith("msjax.launch: stopped after incident"))
    assert f"InjectedError: injected error before step {RAISE_STEP}" in line
    step = read_crashes(run.path, 1, 0.0)[0].step  # updates completed when it raised
    assert step in (RAISE_STEP - 1, RAISE_STEP)  # the step in flight may not be read back yet
    assert f"at step {step} in attempt 0 (rank 0) and again in attempt 1 (rank 0)" in line
    assert f"its traceback is in {run.log(0)}" in line
    assert f"exit code {exit_codes.SOFTWARE_FAULT}" in line
    assert "Traceback" in run.log(0).read_text() and "InjectedError" in run.log(0).read_text()


@pytest.mark.slow
def test_a_repeated_failure_marks_no_slot_and_keeps_the_checkpoints(repeated_failure):
    _, run = repeated_failure
    incidents = [json.loads(line) for line in run.incidents_log.read_text().splitlines()]
    assert [(i["cause"], i["action"]) for i in incidents] == [
        ("crash", "restart"),
        ("software_fault", "stop"),
    ]
    assert all("bad_slot" not in incident for incident in incidents)
    assert not run.bad_slots.exists()
    assert not run.slot_faults.exists() or all(
        json.loads(line)["incident"] == 1 for line in run.slot_faults.read_text().splitlines()
    )
    assert (run.checkpoints / "2").is_dir()  # the last good checkpoint is kept
    first, second = read_crashes(run.path, 0, 0.0), read_crashes(run.path, 1, 0.0)
    assert [(r.signature, r.step) for r in first] == [(r.signature, r.step) for r in second]
    assert first[0].signature.startswith("InjectedError: injected error before step 3 (")
