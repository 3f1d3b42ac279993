"""Hang deadlines under a real `python -m msjax.launch`: a hang in the first step after a save is
judged by the step deadline, and a hang after many fast steps by what the job has measured."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import free_port, job_env, launch_command, run_to_end, wait_until

from msjax.run_dir import RunDir
from tests.small_runs import QUICK_RUN

SAVE_EVERY = 4


def launch(
    run_dir: Path, cache_dir: Path, fault: str, overrides: list[str], max_restarts: int = 0
) -> list[dict]:
    """A 2-process job that ends at its first fault (or after max_restarts); its incidents."""
    flags = [f"--max-restarts={max_restarts}", f"--fault={fault}"]
    args = [
        *QUICK_RUN,
        "train.steps=400",
        "train.eval_every=0",
        f"checkpoint.every_steps={SAVE_EVERY}",
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "resilience.heartbeat_every_s=0.05",
        "resilience.stop_grace_s=2",
        f"resilience.compile_cache_dir={cache_dir}",
        *overrides,
    ]
    done = run_to_end(launch_command(run_dir, args, nprocs=2, launch_flags=flags))
    path = RunDir(run_dir).incidents_log
    assert path.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compile_cache")


@pytest.mark.slow
def test_hang_in_the_first_step_after_a_save_is_found_by_the_step_deadline(tmp_path, cache_dir):
    step_deadline_s = 8.0
    overrides = [
        f"resilience.step_deadline_s={step_deadline_s}",
        "resilience.checkpoint_deadline_s=90",
    ]
    incidents = launch(tmp_path / "run", cache_dir, f"hang@step={2 * SAVE_EVERY},rank=1", overrides)
    incident = incidents[0]
    assert (incident["cause"], incident["phase"]) == ("hang", "step"), incident
    assert incident["detection_latency_s"] < 3 * step_deadline_s, incident


@pytest.mark.slow
def test_hang_after_many_fast_steps_is_found_by_the_measured_step_deadline(tmp_path, cache_dir):
    overrides = [
        "resilience.step_deadline_s=120",
        "resilience.checkpoint_deadline_s=120",
        "resilience.measured_deadline_floor_s=3",
        "resilience.measured_deadline_after_steps=8",
    ]
    # the second hang comes 3 steps into the restart (resumed at checkpoint 12): the steps the
    # first attempt timed count for it
    faults = "hang@step=13,rank=1;hang@step=15,rank=0"
    # the restart after the first attempt's checkpoints is free (it spends no max_restarts): the
    # third attempt, faultless, ends the job at train.steps=20
    incidents = launch(
        tmp_path / "run", cache_dir, faults, [*overrides, "train.steps=20"], max_restarts=1
    )
    assert len(incidents) == 2, incidents
    for incident in incidents:
        assert (incident["cause"], incident["phase"]) == ("hang", "step"), incident
        assert incident["detection_latency_s"] < 30, incident
        assert "measured: max(3 s, 5 x the slowest step" in incident["detail"], incident
        assert "ranks past their deadline: " in incident["detail"], incident
    assert incidents[0]["resumed_from_step"] == 12


def test_heartbeats_time_steps_and_saves_and_the_deadline_follows_them(tmp_path):
    from msjax.config import ResilienceConfig
    from msjax.launch.fault_detection import deadline_s
    from msjax.resilience.heartbeat import Heartbeat, HeartbeatRecord

    resilience = ResilienceConfig(
        heartbeat_every_s=0.5,
        measured_deadline_floor_s=2.0,
        measured_deadline_after_steps=3,
        measured_deadline_after_saves=2,
    )
    heartbeat = Heartbeat(tmp_path, 0, every_s=0.0)
    heartbeat.beat("compile", 0)
    heartbeat.beat("step", 1)
    for step in range(2, 5):
        time.sleep(0.01)
        heartbeat.beat("step", step)
    for _ in range(2):
        heartbeat.beat("checkpoint", 4)
        time.sleep(0.3)
        heartbeat.beat("step")
    heartbeat.beat("drain")
    record = HeartbeatRecord.read(heartbeat.path)
    assert record is not None and record.phase == "drain"
    steps, slowest_step_s = record.timings["step"]
    saves, slowest_save_s = record.timings["checkpoint"]
    assert steps == 3 and 0.01 <= slowest_step_s < 0.2
    assert saves == 2 and 0.3 <= slowest_save_s < 0.6
    assert deadline_s(resilience, "step", [record]) == 2.0  # the floor
    assert deadline_s(resilience, "checkpoint", [record]) == pytest.approx(5 * slowest_save_s + 0.5)
    assert deadline_s(resilience, "drain", [record]) == resilience.checkpoint_deadline_s
    assert deadline_s(resilience, "step", []) == resilience.step_deadline_s
    fewer = ResilienceConfig(measured_deadline_after_steps=4)
    assert deadline_s(fewer, "step", [record]) == fewer.step_deadline_s


def start_voters(script: str) -> list[subprocess.Popen]:
    """Two processes of one jax.distributed job on 127.0.0.1, each running script as its rank."""
    port = str(free_port())
    env = job_env(JAX_NUM_CPU_DEVICES="1")
    return [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]


VOTER = """
import os, sys, time
import jax
rank, port = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
from msjax.parallel.agreement import ProcessVote, VoteTimeout
vote = ProcessVote("test", timeout_s=3.0)
# one round behind: round r's answer comes with round r + 1's cast, the same on both
answers = [vote.agree_behind([10 * r + rank]) for r in range(4)]
print("answers", answers, flush=True)
if rank == 1:
    time.sleep(30)  # never votes again
else:
    vote.agree_behind([0])  # round 3, which rank 1 cast
    started = time.monotonic()
    try:
        vote.agree_behind([0])  # round 4, which it never casts
    except VoteTimeout as error:
        print(f"timeout after {time.monotonic() - started:.1f} s: {error}", flush=True)
    # at once: exiting normally waits in jax.distributed's shutdown for rank 1, still asleep
    os._exit(0)
"""


@pytest.mark.slow
def test_votes_one_round_behind_agree_and_a_missing_voter_is_named(tmp_path):
    processes = start_voters(VOTER)
    try:
        output = processes[0].communicate(timeout=120)[0]
    finally:
        for process in processes:
            process.kill()
    assert "answers [None, (1,), (11,), (21,)]" in output, output[-3000:]
    assert "vote test round 4: no vote from rank(s) 1 within 3 s" in output, output[-3000:]
    seconds = float(output.split("timeout after ")[1].split(" s")[0])
    assert 2.5 < seconds < 10, output[-3000:]


SPACED_VOTER = """
import json, sys, time
import jax
rank, port = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
from msjax.parallel.agreement import ProcessVote, VoteSpacing
from msjax.training.decisions import Decision, agree
vote, spacing = ProcessVote("spaced", timeout_s=30.0), VoteSpacing()
stopped_at = None
for step in range(1, 200):
    time.sleep(0.001 if rank == 0 else 0.002)  # steps far shorter than VOTE_SPACING_S
    seen = "SIGTERM" if rank == 1 and step >= 50 else None  # only rank 1 is signalled
    decision, _ = agree(Decision(step=step, stop_by=seen), False, vote, spacing=spacing)
    if decision.stop_by is not None:
        stopped_at = step
        break
print(json.dumps({"stopped_at": stopped_at, "rounds": vote.rounds, "apart": spacing.steps_between}))
"""


def test_short_steps_space_the_vote_s_rounds_and_every_process_acts_at_the_same_step():
    processes = start_voters(SPACED_VOTER)
    try:
        outputs = [process.communicate(timeout=120)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    seen = [json.loads(output.strip().splitlines()[-1]) for output in outputs]
    assert seen[0] == seen[1], outputs  # the same step, the same rounds, the same spacing
    # rank 1's signal, cast at its next round, is acted on by both one round later: at most
    # two spacings of MAX_STEPS_BETWEEN_ROUNDS (16) after it
    assert 50 < seen[0]["stopped_at"] <= 50 + 2 * 16, seen
    assert seen[0]["apart"] > 1, seen  # 1-2 ms steps: rounds several steps apart
    assert seen[0]["rounds"] < seen[0]["stopped_at"] // 2, seen


def test_the_vote_s_spacing_follows_the_time_per_step_and_is_capped():
    from msjax.parallel.agreement import VoteSpacing

    spacing = VoteSpacing(spacing_s=0.001, max_steps=8)
    assert spacing.due(1) and spacing.proposal(1) == 1  # nothing measured yet
    time.sleep(0.01)
    assert spacing.proposal(2) == 1  # a step longer than the spacing: every step
    spacing.agreed(2, 3)
    assert [step for step in range(3, 9) if spacing.due(step)] == [5, 6, 7, 8]
    spacing.agreed(5, None)  # no answer this round: the spacing stays
    assert spacing.next_round_step == 8
    spacing.agreed(8, 40)  # never past the cap, whatever a round says
    assert spacing.steps_between == 8
    fast = VoteSpacing(spacing_s=10.0, max_steps=8)
    fast.proposal(1)
    time.sleep(0.01)
    assert fast.proposal(3) == 8  # 5 ms steps against a 10 s spacing: the cap


IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
    "print('ready', flush=True); time.sleep(600)"
)


def test_a_worker_that_does_not_stop_within_its_grace_is_named_and_killed(tmp_path, capfd):
    from msjax.launch.workers import WorkerProcess, stop_workers

    env = job_env()
    obeys = WorkerProcess(
        0, [sys.executable, "-c", "import time; time.sleep(600)"], env, tmp_path / "0.log", 0, None
    )
    ignores = WorkerProcess(
        1, [sys.executable, "-c", IGNORES_SIGTERM], env, tmp_path / "1.log", 0, None
    )
    wait_until(lambda: "ready" in (tmp_path / "1.log").read_text(), "rank 1 ready")
    seconds, killed = stop_workers([obeys, ignores], grace_s=1.0)
    assert killed == [1]
    assert 1.0 <= seconds < 20
    assert (obeys.exit_code, ignores.exit_code) == (-15, -9)
    line = f"msjax.launch: rank(s) 1 (pid {ignores.pid}) did not stop within 1 s; SIGKILLed"
    assert line in capfd.readouterr().err
