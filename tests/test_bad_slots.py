"""A slot that is the named cause of resilience.max_faults_per_slot faults in a row is marked bad,
in the incident log and RUN_DIR/health, by a real supervised job on one node (where, for now, it
stays in the job and the job restarts as on any fault)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from small_runs import QUICK_RUN

from msjax.run_dir import RunDir

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_slot_crashing_twice_in_a_row_is_marked_bad_and_the_job_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "msjax.launch",
        "--nprocs=2",
        "--devices-per-proc=1",
        "--fault=crash@step=2,rank=1,times=2",
        "--",
        *QUICK_RUN,
        "train.eval_every=0",
        "train.steps=6",
        "checkpoint.every_steps=2",
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "resilience.heartbeat_every_s=0.05",
        "resilience.stop_grace_s=2",
        "resilience.restart_backoff_s=0.1",
        "resilience.max_faults_per_slot=2",
        f"run.dir={run_dir}",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reason = (
        "slot 1 is marked bad: the named cause of 2 faults in a row (incidents 1, 2: crash, "
        "crash; resilience.max_faults_per_slot=2)"
    )
    assert f"{reason}; it stays in the job: leaving a slot out on one node is not done yet" in (
        done.stdout
    )
    run = RunDir(run_dir)
    incidents = [json.loads(line) for line in run.incidents_log.read_text().splitlines()]
    assert [(i["cause"], i["rank"], i["action"]) for i in incidents] == [
        ("crash", 1, "restart"),
        ("crash", 1, "restart"),
    ]
    assert "bad_slot" not in incidents[0]
    marked = incidents[1]["bad_slot"]
    assert (marked["slot"], marked["rank"], marked["incidents"], marked["reason"]) == (
        "1",
        1,
        [1, 2],
        reason,
    )
    slots = json.loads(run.bad_slots.read_text())["slots"]
    assert [(slot["slot"], slot["on_bad_node"], slot["incidents"]) for slot in slots] == [
        ("1", "exclude", [1, 2])
    ]
    faults = [json.loads(line) for line in run.slot_faults.read_text().splitlines()]
    assert [(fault["slot"], fault["incident"]) for fault in faults] == [("1", 1), ("1", 2)]
