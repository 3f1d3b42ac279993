"""A waiting worker (msjax.launch.spare) takes its rank only from the supervisor, over a pipe the
supervisor holds: an assignment file planted in the run dir by someone else (here a link to a
forged one) is never read or run, and the job's secret handed with the rank is never on disk."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from harness import SAFETY_TIMEOUT_S, job_env, wait_until

from msjax.launch.workers import WorkerProcess
from msjax.parallel.agreement import JOB_SECRET
from msjax.run_dir import RunDir

SLOT = 5


def waiting_or_ended(log: Path, spare: WorkerProcess) -> str | None:
    """The spare's output once it says it waits for a rank, or once it has ended."""
    output = log.read_text() if log.exists() else ""
    if "waiting for a rank" in output or spare.poll() is not None:
        return output or "(the spare wrote nothing)"
    return None


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
        waited = wait_until(
            lambda: waiting_or_ended(run.spare_log(SLOT), spare), "the spare's 'waiting for a rank'"
        )
        assert spare.poll() is None, waited  # the planted file did not start it as rank 7
        spare.assign(3, run.log(3), 0, echo=None)
        spare.hand_over(3, {JOB_SECRET: secret}, ["--print-config", "train.steps=77"])
        assert spare.wait(SAFETY_TIMEOUT_S)
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
