"""A launcher killed outright (SIGKILL) mid-run, then a second launch of the same run dir: the
killed launch's record, written at its start and kept current, counts its time up to its last
update, so goodput spans both launches and never exceeds 100%."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import LaunchJob, wait_until
from small_runs import QUICK_RUN

from msjax.checkpoint.commits import committed_steps
from msjax.launch.launches import RUNNING, read_launches
from msjax.observe.goodput import read_records
from msjax.resilience import exit_codes
from msjax.run_dir import RunDir

STEPS = 6
TRAIN_ARGS = [
    *QUICK_RUN,
    "mesh.data=1",
    "mesh.fsdp=1",
    "mesh.tensor=1",
    f"train.steps={STEPS}",
    "train.eval_every=0",
    "checkpoint.every_steps=2",
    "resilience.heartbeat_every_s=0.1",
    "resilience.step_deadline_s=300",  # the injected hang outlasts the wait for the kill
    "resilience.launch_record_every_s=0.2",
]


@dataclass
class TwoLaunches:
    run_dir: RunDir
    seen_before_kill: dict  # launch 1's record that was read just before its SIGKILL
    committed_at_kill: int  # the newest checkpoint launch 1 committed
    second_code: int
    second_output: str


def gone(pid: int) -> bool:
    """Whether the process has exited (a zombie no one reaps counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status


@pytest.fixture(scope="module")
def two_launches(tmp_path_factory: pytest.TempPathFactory) -> TwoLaunches:
    base = tmp_path_factory.mktemp("killed_launcher")
    run_dir = RunDir(base / "run")
    # rank 0 stops making progress before step 4 (once over the run): it stays there until killed
    first = LaunchJob.start(
        run_dir.path,
        TRAIN_ARGS,
        launch_flags=["--fault=hang@step=4,rank=0"],
        log_path=base / "first.log",
    )
    try:

        def stepped_past_a_checkpoint() -> dict | None:
            launches = read_launches(run_dir)
            attempts = launches[-1]["attempts"] if launches else []
            if attempts and attempts[0]["max_step"] >= 3 and committed_steps(run_dir.checkpoints):
                return launches[-1]
            return None

        seen = first.wait_for(stepped_past_a_checkpoint, "launch 1 at step 3")
        assert first.running(), "launch 1 ended before its record showed it running"
        worker = first.heartbeat(0)
        first.send(signal.SIGKILL)
        first.process.wait()
        assert worker is not None
        wait_until(lambda: gone(worker.pid), "launch 1's worker gone")
    finally:
        first.kill()
    committed_at_kill = committed_steps(run_dir.checkpoints)[-1]
    second = LaunchJob.start(run_dir.path, TRAIN_ARGS, log_path=base / "second.log")
    try:
        ended = second.finish()
    finally:
        second.kill()
    return TwoLaunches(run_dir, seen, committed_at_kill, ended.exit_code, ended.output)


@pytest.mark.slow
def test_the_second_launch_finishes_and_goodput_spans_both_launches(two_launches):
    job = two_launches
    assert job.second_code == exit_codes.OK, job.second_output[-4000:]
    goodput = json.loads(job.run_dir.goodput.read_text())
    assert goodput["launches"] == 2, goodput
    assert 0 < goodput["effective_training_time_ratio"] <= 1.0, goodput
    first, second = read_launches(job.run_dir)
    assert goodput["wall_s"] == pytest.approx(
        second["ended_unix_s"] - first["started_unix_s"], abs=1e-3
    )
    # the line a scheduler's script reads to tell a run that committed a newer checkpoint
    newest = committed_steps(job.run_dir.checkpoints)[-1]
    assert newest > job.committed_at_kill
    assert (
        f"msjax.launch: checkpoints: newest committed step {newest} (step "
        f"{job.committed_at_kill} at this launch's start)"
    ) in job.second_output


@pytest.mark.slow
def test_the_killed_launch_counts_its_time_up_to_its_last_record(two_launches):
    job = two_launches
    first, second = read_launches(job.run_dir)
    assert first["outcome"] == RUNNING
    # its last record was written after the one read before the kill, and holds its attempt
    assert first["ended_unix_s"] >= job.seen_before_kill["ended_unix_s"]
    assert first["attempts"][0]["max_step"] >= 3
    goodput = json.loads(job.run_dir.goodput.read_text())
    # only the time after its last record is the scheduler's (here: the test's) between launches
    scheduler_s = second["started_unix_s"] - first["ended_unix_s"]
    assert goodput["breakdown_s"]["scheduler_s"] == pytest.approx(scheduler_s, abs=1e-3)


@pytest.mark.slow
def test_the_second_launch_opens_a_requeue_incident_naming_the_killed_launch(two_launches):
    incidents = read_records(two_launches.run_dir.incidents_log)
    requeues = [incident for incident in incidents if incident["cause"] == "requeue"]
    assert len(requeues) == 1, incidents
    assert requeues[0]["detail"].startswith("launch 1 was killed (its last record, running) on ")
