"""A waiting worker (msjax.launch.spare) takes its rank only from the supervisor, over a pipe the
supervisor holds: an assignment file planted in the run dir by someone else (here a link to a
forged one) is never read or run, and the job's secret handed with the rank is never on disk."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from harness import job_env

from msjax.launch.workers import WorkerProcess
from msjax.parallel.agreement import JOB_SECRET
from msjax.run_dir import RunDir

SLOT = 5
WAIT_S = 300.0  # a bound for a loaded machine; the test waits on the spare's own lines


def wait_for_line(log: Path, text: str, worker: WorkerProcess) -> str:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        output = log.read_text() if log.exists() else ""
        if text in output or worker.poll() is not None:
            return output
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in {log} within {WAIT_S:g} s")


@pytest.mark.slow
def test_a_spare_takes_its_rank_from_the_supervisors_pipe_never_from_a_planted_file(tmp_path):
    run = RunDir(tmp_path / "run")
    forged = tmp_path / "elsewhere.json"  # another user's file, linked from the run dir
    forged.write_text(json.dumps({"rank": 7, "env": {}, "args": ["--print-config"]}))
    planted = run.path / "spares" / f"slot{SLOT}.json"
    planted.parent.mkdir(parents=True)
    planted.symlink_to(forged)
    secret = os.urandom(16).hex()
    env = job_env()
    command = [sys.executable, "-m", "msjax.launch.spare", str(run.path), str(SLOT)]
    spare = WorkerProcess(-1, command, env, run.spare_log(SLOT), 0, echo=None)
    try:
        waited = wait_for_line(run.spare_log(SLOT), "waiting for a rank", spare)
        assert spare.poll() is None, waited  # the planted file did not start it as rank 7
        spare.assign(3, run.log(3), 0, echo=None)
        spare.hand_over(3, {JOB_SECRET: secret}, ["--print-config", "train.steps=77"])
        assert spare.wait(WAIT_S)
    finally:
        spare.signal(9)
        spare.close()
    assert spare.exit_code == 0
    output = run.log(3).read_text()
    assert f"slot {SLOT} takes rank 3" in output and "steps: 77" in output
    assert "takes rank 7" not in output + run.spare_log(SLOT).read_text()
    assert planted.is_symlink() and json.loads(forged.read_text())["rank"] == 7  # left alone
    on_disk = [path for path in run.path.rglob("*") if path.is_file() and not path.is_symlink()]
    assert all(secret not in path.read_text(errors="replace") for path in on_disk)
