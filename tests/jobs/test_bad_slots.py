"""A slot that is the named cause of resilience.max_faults_per_slot faults in a row is marked bad,
in the incident log and RUN_DIR/health, by a real supervised job on one node (which excludes it:
tests/jobs/test_shrink.py follows the job on without it)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from harness import LaunchJob, launch_command, read_jsonl, run_to_end
from small_runs import QUICK_RUN

from msjax.run_dir import RunDir

TINY_MOE = Path(__file__).parents[2] / "configs" / "tiny_moe.yaml"


@pytest.mark.slow
def test_a_slot_crashing_twice_in_a_row_is_marked_bad_and_the_job_goes_on(tmp_path):
    """On an expert-parallel mesh: the tiny mixture of experts split over 2 processes (expert 2)
    goes on on the one healthy process, its experts re-planned onto one device."""
    run_dir = tmp_path / "run"
    overrides = [
        "--config",
        str(TINY_MOE),
        *QUICK_RUN,
        "model.moe.expert_mlp_dim=32",
        "train.eval_every=0",
        "train.steps=6",
        "checkpoint.every_steps=2",
        "mesh.data=1",
        "mesh.fsdp=1",
        "mesh.expert=2",
        "mesh.tensor=1",
        "resilience.heartbeat_every_s=0.05",
        "resilience.stop_grace_s=2",
        "resilience.restart_backoff_s=0.1",
        "resilience.max_faults_per_slot=2",
    ]
    flags = ["--fault=crash@step=2,rank=1,times=2"]
    done = run_to_end(launch_command(run_dir, overrides, nprocs=2, launch_flags=flags))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reason = (
        "slot 1 is marked bad: the named cause of 2 faults in a row (incidents 1, 2: crash, "
        "crash; resilience.max_faults_per_slot=2)"
    )
    assert f"{reason}; excluding it (resilience.on_bad_node=exclude)" in done.stdout
    assert "expert 2 x pipe 1 x tensor 1)" in done.stdout  # the job's own mesh
    shrunk = "data 1 x fsdp 1 x pipe 1 x tensor 1 on 1 processes, train.grad_accum_steps=2"
    assert f"no spare left: the job goes on on {shrunk}" in done.stdout
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
    # the shrunk attempt restored the checkpoint written by 2 expert shards and trained to the end
    assert incidents[1]["membership"]["mesh"] == shrunk
    assert incidents[1]["resumed_from_step"] == 2
    assert sorted({r["step"] for r in read_jsonl(run.metrics) if "loss" in r}) == list(range(6))


@pytest.mark.slow
def test_a_crash_looping_slot_passes_its_self_check_but_not_its_training_probe_and_stays_out(
    tmp_path,
):
    """Slot 1 crashes before step 2 in every attempt; excluded, a spare takes its rank. Its
    self-check for re-admission passes (a crash does not show in it), but its training probe
    crashes at the same step: it stays out, its time out doubled, and is never re-admitted."""
    run_dir = tmp_path / "run"
    overrides = [
        *QUICK_RUN,
        "train.eval_every=0",
        "train.steps=100000",  # trains on until the probe's verdict, then SIGTERM
        "checkpoint.every_steps=2",
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "resilience.heartbeat_every_s=0.05",
        "resilience.stop_grace_s=2",
        "resilience.restart_backoff_s=0.1",
        "resilience.max_faults_per_slot=2",
        "resilience.readmit_after_s=1",
    ]
    verdicts = ("failed its training probe for re-admission", "re-admitted")
    job = LaunchJob.start(
        run_dir,
        overrides,
        nprocs=2,
        launch_flags=["--spares=1", "--fault=crash@step=2,rank=1,times=99"],
        log_path=tmp_path / "launch.log",
    )
    try:
        job.wait_for(lambda: any(job.printed(v) for v in verdicts), "a re-admission verdict")
        ended = job.stop(signal.SIGTERM)
    finally:
        job.kill()
    code, output = ended.exit_code, ended.output
    assert code == 143, output[-3000:]
    assert "spare slot 2 takes rank 1, the mesh is unchanged" in output
    assert "re-admitted" not in output, output[-3000:]
    assert "slot 1 passed its self-check for re-admission" in output
    assert (
        "slot 1 failed its training probe for re-admission: its probe of 4 steps ended with exit "
        "code 1 (logs/probe-slot1.log); it stays excluded, checked again after 2 s "
        "(resilience.readmit_after_s=1, doubled each time)"
    ) in output
    run = RunDir(run_dir)
    incidents = [json.loads(line) for line in run.incidents_log.read_text().splitlines()]
    kept_out = incidents[-1]
    assert (kept_out["cause"], kept_out["rank"], kept_out["action"]) == (
        "crash",
        None,
        "stay_excluded",
    )
    assert kept_out["membership"]["slots"]["excluded"] == [1]
    # the probe crashed where the slot did; the job's own record counts the job's crashes only
    probe_firings = [json.loads(line) for line in (run.probe(1, 1) / "faults.jsonl").open()]
    assert [(f["kind"], f["slot"], f["attempt"]) for f in probe_firings][-1] == ("crash", 1, 0)
    job_firings = [json.loads(line) for line in run.faults.read_text().splitlines()]
    assert [f["slot"] for f in job_firings] == [1, 1]
