"""launch/slurm/train.sbatch on a live Slurm cluster: real sbatch jobs of two nodes, msjax.launch on
each, through preemption, a SIGKILLed worker, a user error, a time limit and a bad node.

The cluster is launch/slurm/local-cluster.sh's (the one up in MSJAX_SLURM_DIR, as .ci/run starts
it, or one started here). Without Slurm installed the tests skip; with MSJAX_REQUIRE_SLURM=1 (CI)
they fail instead. All jobs run side by side and the tests share them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from harness import (
    REPO,
    SBATCH_SCRIPT,
    LaunchJob,
    SlurmJob,
    free_port,
    kill_all,
    read_jsonl,
    run_to_end,
)
from small_runs import QUICK_RUN

from msjax.resilience.heartbeat import HeartbeatRecord
from msjax.run_dir import RunDir

CLUSTER = REPO / "launch" / "slurm" / "local-cluster.sh"
STEPS = 120
SAVE_EVERY = 40
PREEMPT_AT = 10  # steps into the first run
KILL_AFTER = 10  # steps past the resumed step of the second run
# Slurm sends a time limit's signal 30-60 s before it was asked for (it checks every 30 s, and
# signals up to 30 s early): here 60-90 s into the job, past its start-up
TIME_LIMIT_MIN = 3
TIME_LIMIT_SIGNAL_S = 60
ONE_DEVICE_PER_NODE = ["--devices-per-proc", "1"]  # msjax.launch's options on each node
IDLE_TRAINING_FAULT = "slow@step=1,rank=0,percent=2000"


def train_args(cache_dir: Path, steps: int = STEPS) -> list[str]:
    """The trainer's arguments of every job here (the harness adds run.dir)."""
    return [
        *QUICK_RUN,
        "train.eval_every=0",
        f"train.steps={steps}",
        f"checkpoint.every_steps={SAVE_EVERY}",
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "resilience.heartbeat_every_s=0.05",
        "resilience.step_deadline_s=60",
        "resilience.stop_grace_s=5",
        "resilience.restart_backoff_s=0.1",
        f"resilience.compile_cache_dir={cache_dir}",
    ]


def require_slurm(reason: str) -> None:
    if os.environ.get("MSJAX_REQUIRE_SLURM") == "1":
        pytest.fail(f"MSJAX_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The variables that point Slurm commands at the cluster: the one in MSJAX_SLURM_DIR if it
    is up, else a private one started (and stopped) here."""
    missing = [
        tool for tool in ("sbatch", "slurmctld", "slurmd", "munged") if not shutil.which(tool)
    ]
    if missing:
        require_slurm(
            f"Slurm is not installed ({', '.join(missing)} missing; "
            "apt-get install slurm-wlm munge)"
        )
    given = os.environ.get("MSJAX_SLURM_DIR")
    if given and subprocess.run([CLUSTER, "status", given], capture_output=True).returncode == 0:
        cluster_dir, started = Path(given), False
    else:
        cluster_dir, started = tmp_path_factory.mktemp("slurm-cluster"), True
        up = subprocess.run([CLUSTER, "up", str(cluster_dir)], capture_output=True, text=True)
        if up.returncode != 0:
            require_slurm(f"the local Slurm cluster did not start: {up.stderr.strip()[-500:]}")
    try:
        yield {"SLURM_CONF": str(cluster_dir / "slurm.conf"), "MSJAX_PYTHON": sys.executable}
    finally:
        if started:
            subprocess.run([CLUSTER, "down", str(cluster_dir)], capture_output=True)


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's last recorded loss (a step redone after a restart counts as redone)."""
    return {
        record["step"]: record["loss"]
        for record in read_jsonl(RunDir(run_dir).metrics)
        if "loss" in record and "step_time_s" in record
    }


def training(job: SlurmJob, rank: int, past_step: int, not_pid: int | None = None) -> int | None:
    """The pid of rank's worker once it trains past `past_step` (a worker other than not_pid)."""
    record = job.heartbeat(rank)
    if record is None or record.phase != "step" or record.step < past_step:
        return None
    return None if record.pid == not_pid else record.pid


def trained_past_its_start(
    job: SlurmJob, rank: int, steps: int, not_pid: int | None
) -> HeartbeatRecord | None:
    """rank's heartbeat once a worker other than not_pid trains `steps` past its resumed step."""
    record = job.heartbeat(rank)
    if record is None or record.pid == not_pid or record.phase != "step":
        return None
    if record.start_step is None or record.step < record.start_step + steps:
        return None
    return record


def training_in_second_run(job: SlurmJob, rank: int) -> HeartbeatRecord | None:
    """rank's heartbeat once the job's second run (its first requeue) trains."""
    launches = job.launches()
    if len(launches) < 2:
        return None  # the first run still trains or saves (its record is kept current)
    record = job.heartbeat(rank)
    if record is None or record.phase != "step":
        return None
    return record if record.unix_s >= launches[1]["started_unix_s"] else None


@dataclass
class Timeline:
    """When the test acted on a job and what it saw (time.time())."""

    events: dict[str, float] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class Runs:
    jobs: dict[str, SlurmJob]
    hand: Path
    hand_codes: list[int]
    hand_output: str
    timelines: dict[str, Timeline]
    wall_s: dict[str, float]
    bad_node_file: Path  # names the node the bad-node job's fault stayed with


def preempt_then_kill_a_worker(job: SlurmJob, timeline: Timeline) -> None:
    """Preempt the first run once it trains past PREEMPT_AT; in the requeued run, SIGKILL rank
    1's worker KILL_AFTER steps past its resumed step; the job then goes on to its end."""
    first_rank0 = job.wait_for(
        lambda: training(job, 0, PREEMPT_AT), f"rank 0 of the first run training past {PREEMPT_AT}"
    )
    rank1 = job.heartbeat(1)
    timeline.facts["first_pids"] = (first_rank0, rank1.pid if rank1 else None)
    timeline.events["preempted"] = time.time()
    job.signal("--signal=TERM")
    record = job.wait_for(
        lambda: trained_past_its_start(job, 1, KILL_AFTER, timeline.facts["first_pids"][1]),
        f"a new rank 1 worker training {KILL_AFTER} steps past its resumed step",
    )
    timeline.events["killed"] = time.time()
    timeline.facts["killed_at_step"] = record.step
    os.kill(record.pid, signal.SIGKILL)


def cancel_once_requeued_after_its_time_limit(job: SlurmJob, timeline: Timeline) -> None:
    """Once the run after the time limit's requeue trains, cancel the job (it would train on)."""
    record = job.wait_for(
        lambda: training_in_second_run(job, 0), "the run after the time limit's requeue training"
    )
    timeline.facts["resumed_from_step"] = record.start_step
    timeline.events["cancelled"] = time.time()
    job.kill()


BAD_NODE_STEPS = 40
BAD_NODE_CRASH_AT = 3


def submit_bad_node_job(base: Path, env: dict[str, str], cache: Path) -> tuple[SlurmJob, Path]:
    """A 2-node job whose first node rank 1 crashes at every start, whatever rank it runs
    then (a requeue may place it first): the fault stays with that node (a broken machine),
    through MSJAX_PYTHON, a wrapper that sets MSJAX_FAULT there. Returns the job and the file
    naming that node."""
    bad_file = base / "bad-node"
    wrapper = base / "python-on-a-broken-node"
    wrapper.write_text(
        "#!/bin/bash\n"
        f'bad_file="{bad_file}"\n'
        'if [ "${SLURM_NODEID:-}" = 1 ] && [ -n "${SLURM_STEP_ID:-}" ] && [ ! -e "$bad_file" ]; '
        'then echo "$SLURMD_NODENAME" > "$bad_file"; fi\n'
        'if [ -n "${SLURM_STEP_ID:-}" ] && '
        '[ "$(cat "$bad_file" 2>/dev/null)" = "$SLURMD_NODENAME" ]; '
        f'then export MSJAX_FAULT="crash@step={BAD_NODE_CRASH_AT},rank=$SLURM_NODEID,times=99"; '
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    job = SlurmJob.submit(
        "bad_node",
        base,
        [*train_args(cache, steps=BAD_NODE_STEPS), "resilience.max_faults_per_slot=2"],
        launch_flags=ONE_DEVICE_PER_NODE,
        env={**env, "MSJAX_PYTHON": str(wrapper)},
    )
    return job, bad_file


def submit_jobs(base: Path, env: dict[str, str], cache: Path) -> dict[str, SlurmJob]:
    """The clean, faults, user-error and time-limit jobs, submitted side by side."""

    def submit(
        name: str,
        overrides: list[str],
        sbatch_flags: list[str] = (),
        launch_flags: list[str] = (),
    ) -> SlurmJob:
        return SlurmJob.submit(
            name,
            base,
            overrides,
            launch_flags=[*ONE_DEVICE_PER_NODE, *launch_flags],
            sbatch_flags=sbatch_flags,
            env=env,
        )

    return {
        "clean": submit("clean", train_args(cache)),
        "faults": submit("faults", train_args(cache)),
        # a config mistake: every node's launcher exits 2 before starting a worker
        "user_error": submit("user_error", [*train_args(cache), "train.steps=-3"]),
        "time_limit": submit(
            "time_limit",
            [*train_args(cache, steps=1_000_000), "checkpoint.every_steps=1000000"],
            [f"--time={TIME_LIMIT_MIN}", f"--signal=TERM@{TIME_LIMIT_SIGNAL_S}"],
            # it trains until Slurm's signal, minutes away: rank 0 sleeps 20 times its step's
            # work after each step (rank 1 waits on it), so those minutes leave the CPU idle
            [f"--fault={IDLE_TRAINING_FAULT}"],
        ),
    }


def launch_by_hand(hand: Path, cache: Path) -> list[LaunchJob]:
    """The same job as "clean" launched by hand, without Slurm: msjax.launch on each node."""
    coordinator = f"127.0.0.1:{free_port()}"
    return [
        LaunchJob.start(
            hand,
            train_args(cache),
            launch_flags=["--nnodes=2", f"--node-rank={node_rank}", f"--coordinator={coordinator}"],
            log_path=hand.parent / f"hand-{node_rank}.log",
        )
        for node_rank in (0, 1)
    ]


@pytest.fixture(scope="module")
def runs(slurm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    base = tmp_path_factory.mktemp("slurm-jobs")
    cache = base / "compile-cache"
    jobs: dict[str, SlurmJob] = {}
    by_hand: list[LaunchJob] = []
    try:
        jobs |= submit_jobs(base, slurm_env, cache)
        jobs["bad_node"], bad_node_file = submit_bad_node_job(base, slurm_env, cache)
        by_hand += launch_by_hand(base / "hand", cache)
        timelines = {"faults": Timeline(), "time_limit": Timeline()}
        preempt_then_kill_a_worker(jobs["faults"], timelines["faults"])
        cancel_once_requeued_after_its_time_limit(jobs["time_limit"], timelines["time_limit"])
        for job in jobs.values():
            job.finish()
        hand_finished = [launcher.finish() for launcher in by_hand]
        yield Runs(
            jobs=jobs,
            hand=base / "hand",
            hand_codes=[finished.exit_code for finished in hand_finished],
            hand_output="".join(finished.output for finished in hand_finished),
            timelines=timelines,
            wall_s={name: job.wall_s for name, job in jobs.items()},
            bad_node_file=bad_node_file,
        )
    finally:
        kill_all([*jobs.values(), *by_hand])


@pytest.mark.slow
@pytest.mark.slurm
def test_two_node_job_trains_to_the_end_with_the_losses_of_the_same_job_launched_by_hand(runs):
    job = runs.jobs["clean"]
    assert job.final["JobState"] == "COMPLETED" and job.final["ExitCode"] == "0:0", job.output
    output = job.output
    # every choice the script made is in the job's output
    assert "msjax: nodes n[1-2] (2)" in output or "msjax: nodes n[2-3] (2)" in output, output
    assert "coordinator 127.0.0.1:" in output and "at its NodeAddr" in output
    assert "launcher options: --devices-per-proc 1" in output
    # each node's launcher names its own rank
    assert "1 workers (rank 0 of 2)" in output and "1 workers (rank 1 of 2)" in output
    assert runs.hand_codes == [0, 0], runs.hand_output[-3000:]
    by_slurm, by_hand = losses(job.run_dir), losses(runs.hand)
    assert sorted(by_slurm) == list(range(STEPS))
    assert by_slurm == by_hand


@pytest.mark.slow
@pytest.mark.slurm
def test_preempted_job_saves_on_both_nodes_requeues_itself_and_resumes(runs):
    job = runs.jobs["faults"]
    first, second, *_ = job.launches()  # node 0's launcher sessions: one per run of the job
    assert first["outcome"] == "stopped by SIGTERM"
    saved = first["attempts"][-1]["max_step"]
    assert PREEMPT_AT <= saved < STEPS
    # both nodes' workers saved the same step and stopped, and the requeued run resumed there
    for rank in (0, 1):
        log = RunDir(job.run_dir).log(rank).read_text()
        assert log.count("stopped by SIGTERM after step") == 1
        assert f"stopped by SIGTERM after step {saved}; checkpoint in" in log
        assert f"resumed from {job.run_dir / 'checkpoints' / str(saved)} (step {saved})" in log
    assert second["attempts"][0]["start_step"] == saved
    assert second["slurm_restart_count"] == 1 and second["slurm_job_id"] == job.job_id
    assert "msjax: exit code 143; requeueing" in job.output


@pytest.mark.slow
@pytest.mark.slurm
def test_sigkilled_worker_ends_the_run_by_exit_code_and_the_requeued_job_finishes_bitwise(runs):
    job = runs.jobs["faults"]
    assert job.final["JobState"] == "COMPLETED" and job.final["ExitCode"] == "0:0", job.output
    launches = job.launches()
    killed_s = runs.timelines["faults"].events["killed"]
    killed = max(n for n, launch in enumerate(launches) if launch["started_unix_s"] < killed_s)
    second, third = launches[killed], launches[killed + 1]
    # Node 1's launcher exits 5 (a multi-node job restarts as a whole), srun ends the step: node
    # 0's launcher is asked to stop, or saw the fault first and exits 5 too
    assert second["outcome"] in (
        "stopping on SIGTERM",
        "stopped by SIGTERM",
        "stopped: a multi-node job restarts as a whole; the scheduler resumes it",
    ), second["outcome"]
    run_after = f"run {killed + 2} (requeues so far"
    assert re.search(r"msjax: exit code (5|137|143); requeueing", job.output.split(run_after)[0])
    assert third["slurm_restart_count"] == killed + 1
    assert third["attempts"][0]["start_step"] <= runs.timelines["faults"].facts["killed_at_step"]
    assert launches[-1]["outcome"] == "done"
    clean = losses(runs.jobs["clean"].run_dir)
    after_faults = losses(job.run_dir)
    assert after_faults[STEPS - 1] == clean[STEPS - 1]  # bitwise: floats compared exactly
    assert after_faults == clean


@pytest.mark.slow
@pytest.mark.slurm
def test_one_record_across_requeues(runs):
    job = runs.jobs["faults"]
    run_dir = RunDir(job.run_dir)
    launches = job.launches()
    goodput = json.loads(run_dir.goodput.read_text())
    # a preemption and a SIGKILL: three launches (more if Slurm stops a run of the job again)
    assert goodput["launches"] == len(launches) >= 3 and goodput["outcome"] == "done"
    assert goodput["attempts"] == sum(len(launch["attempts"]) for launch in launches)
    assert goodput["wall_s"] == pytest.approx(
        launches[-1]["ended_unix_s"] - launches[0]["started_unix_s"], abs=0.01
    )
    gaps = [b["started_unix_s"] - a["ended_unix_s"] for a, b in pairwise(launches)]
    assert goodput["breakdown_s"]["scheduler_s"] == pytest.approx(sum(gaps), abs=0.01)
    assert all(gap > 1 for gap in gaps)  # Slurm's requeue and start time, counted as lost
    incidents = [json.loads(line) for line in run_dir.incidents_log.read_text().splitlines()]
    requeues = [incident for incident in incidents if incident["cause"] == "requeue"]
    assert [incident["launch"] for incident in requeues] == list(range(2, len(launches) + 1))
    assert requeues[0]["resumed_from_step"] == launches[0]["attempts"][-1]["max_step"]
    assert requeues[0]["steps_lost"] == 0  # the preemption saved the step it stopped after
    assert requeues[0]["scheduler_s"] == pytest.approx(gaps[0], abs=0.01)
    assert requeues[0]["restart_s"] > requeues[0]["scheduler_s"]
    assert any(i["cause"] == "crash" and i["rank"] == 1 for i in incidents)
    report = run_to_end([sys.executable, "-m", "msjax.report", str(job.run_dir)])
    assert report.returncode == 0, report.stderr
    assert "launches: 3" in report.stdout
    for launch in launches:
        run_number = launch["slurm_restart_count"] + 1
        assert f"Slurm job {job.job_id} run {run_number}" in " ".join(report.stdout.split())
        assert f"attempt 0 on {launch['nodes']}: steps {launch['attempts'][0]['start_step']}-" in (
            report.stdout
        )
    requeue = requeues[0]
    preempted = runs.timelines["faults"].events["preempted"]
    first_step_after = requeue["detected_unix_s"] + requeue["restart_s"]
    print(
        f"\nfigures: scancel -> first step after the requeue {first_step_after - preempted:.1f} s: "
        f"signal delivery {requeue['fault_unix_s'] - preempted:.1f} s, msjax saving and stopping "
        f"{requeue['stop_s']:.1f} s, Slurm requeue and start {requeue['scheduler_s']:.1f} s, "
        f"msjax start-up to the first step {requeue['restart_s'] - requeue['scheduler_s']:.1f} s; "
        f"effective training time {100 * goodput['effective_training_time_ratio']:.1f}% of "
        f"{goodput['wall_s']:.0f} s ({goodput['breakdown_s']}); wall s per job {runs.wall_s}"
    )


@pytest.mark.slow
@pytest.mark.slurm
def test_user_error_is_not_requeued_and_its_one_line_is_in_the_job_output(runs):
    job = runs.jobs["user_error"]
    assert job.final["JobState"] == "FAILED" and job.final["ExitCode"] == "2:0", job.output
    assert job.final["Restarts"] == "0"
    output = job.output
    errors = [line for line in output.splitlines() if line.startswith("msjax.launch: error")]
    assert errors and all("train.steps" in line for line in errors), output
    assert "Traceback" not in output
    assert "msjax: exit code 2 is not worth a retry; not requeued" in output


@pytest.mark.slow
@pytest.mark.slurm
def test_time_limit_signal_saves_before_the_limit_and_requeues(runs):
    job = runs.jobs["time_limit"]
    first = job.launches()[0]
    assert first["outcome"] == "stopped by SIGTERM"
    saved = first["attempts"][-1]["max_step"]
    assert saved > 0 and (job.run_dir / "checkpoints" / str(saved)).is_dir()
    assert "msjax: exit code 143; requeueing" in job.output
    assert "DUE TO TIME LIMIT" not in job.output  # saved and left before Slurm's kill
    assert runs.timelines["time_limit"].facts["resumed_from_step"] == saved
    assert first["ended_unix_s"] - first["started_unix_s"] < TIME_LIMIT_MIN * 60


def sbatch_with_stand_ins(
    tmp_path: Path,
    args: list[str],
    srun_output: str,
    srun_code: int,
    failing: str = "",
    env: dict[str, str] | None = None,
    submit_dir: Path | None = None,
):
    """train.sbatch run by bash with stand-ins for srun (its output and code given) and
    scontrol (KillWait 6 s; its `failing` command, e.g. "update", fails as Slurm's does);
    returns the script's exit code, the srun command line, the script's output and whether it
    requeued the job. Each call is a fresh job's first run (its requeue count in a folder of its
    own) unless the caller keeps the count across calls in submit_dir."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    (bin_dir / "srun").write_text(
        f'#!/bin/sh\necho "srun $*" >> {calls}\nprintf "{srun_output}"\nexit {srun_code}\n'
    )
    failure = (
        f'  {failing}\\ *) echo "{failing}: Job is no longer pending execution" >&2; exit 1;;\n'
        if failing
        else ""
    )
    (bin_dir / "scontrol").write_text(
        f'#!/bin/sh\necho "scontrol $*" >> {calls}\ncase "$*" in\n'
        '  "show config") echo "KillWait                = 6 sec";;\n'
        f"{failure}esac\n"
    )
    for stand_in in bin_dir.iterdir():
        stand_in.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "42",
        # the job's requeue count: a fresh job's unless the caller keeps one across calls
        "SLURM_SUBMIT_DIR": str(submit_dir or tempfile.mkdtemp(dir=tmp_path)),
        **(env or {}),
    }
    done = subprocess.run(
        ["bash", str(SBATCH_SCRIPT), *args], env=env, capture_output=True, text=True
    )
    lines = calls.read_text().splitlines()
    srun = next(line for line in lines if line.startswith("srun "))
    requeued = "scontrol requeue 42" in lines or "scontrol requeuehold 42" in lines
    return done.returncode, srun, done.stdout + done.stderr, requeued


def test_sbatch_script_splits_launcher_options_from_trainer_arguments_at_the_double_dash(tmp_path):
    _, srun, output, _ = sbatch_with_stand_ins(
        tmp_path, ["--devices-per-proc", "2", "--", "--config", "c.yaml", "train.steps=5"], "", 0
    )
    assert srun.endswith("--nprocs 1 --devices-per-proc 2 -- --config c.yaml train.steps=5"), srun
    assert "msjax: launcher options: --devices-per-proc 2" in output
    assert "msjax: trainer arguments: --config c.yaml train.steps=5" in output
    # without a --, every argument is the trainer's (today's submissions keep working)
    _, srun, _, _ = sbatch_with_stand_ins(tmp_path, ["--config", "c.yaml"], "", 0)
    assert srun.endswith("--nprocs 1 -- --config c.yaml"), srun
    # GPUs are the allocation's: the script asks for none (a CPU cluster refuses a GPU request)
    script = SBATCH_SCRIPT.read_text().splitlines()
    directives = [line for line in script if line.startswith("#SBATCH")]
    assert directives and not [line for line in directives if "gpu" in line.lower()]


def test_sbatch_script_does_not_requeue_a_user_error_of_one_node_behind_srun_s_143(tmp_path):
    """Node 0's launcher exits 2; srun stops node 1's (143) and reports the highest code."""
    per_node = (
        "msjax: node 0 (n1): msjax.launch exit code 2\\n"
        "msjax: node 1 (n2): msjax.launch exit code 143\\n"
    )
    code, _, output, requeued = sbatch_with_stand_ins(
        tmp_path, ["--config", "c.yaml"], per_node, 143
    )
    assert (code, requeued) == (2, False), output
    assert "msjax: exit code 2 is not worth a retry; not requeued" in output
    code, _, output, requeued = sbatch_with_stand_ins(
        tmp_path, ["--config", "c.yaml"], per_node.replace("code 2", "code 5"), 143
    )
    assert (code, requeued) == (143, True), output


def test_sbatch_script_requeues_the_job_without_a_node_whose_launcher_exits_bad_node(tmp_path):
    """Node 1's launcher exits 9 (its slot is bad), its last line naming its node; srun stops
    node 0's (143)."""
    per_node = (
        "msjax.launch: stopped after incident 2 (crash of rank 1): node n2 is marked bad: the "
        "named cause of 2 faults in a row; requeue the job without node n2; exit code 9\\n"
        "msjax: node 0 (n1): msjax.launch exit code 143\\n"
        "msjax: node 1 (n2): msjax.launch exit code 9\\n"
    )
    code, _, output, requeued = sbatch_with_stand_ins(
        tmp_path, ["--config", "c.yaml"], per_node, 143
    )
    calls = (tmp_path / "calls").read_text().splitlines()
    assert (code, requeued) == (9, True), output
    # requeued held, so that it cannot start again before the exclusion applies, then released
    exclude = "scontrol update JobId=42 ExcNodeList=n2"
    hold, update = calls.index("scontrol requeuehold 42"), calls.index(exclude)
    assert hold < update < calls.index("scontrol release 42") and calls.count(exclude) == 1
    assert "scontrol requeue 42" not in calls
    assert "bad node(s) n2; requeueing without them" in output
    assert "job 42 requeued and held; ExcNodeList=n2 set" in output
    # an update Slurm refuses is retried within its share of KillWait; the job is released
    # all the same, and the output says the node may be used again
    started_s = time.monotonic()
    code, _, output, requeued = sbatch_with_stand_ins(
        tmp_path, ["--config", "c.yaml"], per_node, 143, failing="update"
    )
    calls = (tmp_path / "calls").read_text().splitlines()
    assert (code, requeued) == (9, True) and time.monotonic() - started_s < 6, output
    assert calls.count(exclude) >= 2 and calls[-1] == "scontrol release 42", calls
    assert (
        "could not exclude n2 (scontrol update: update: Job is no longer pending execution): "
        "the rerun may use them again" in output
    )
    # a requeue Slurm refuses leaves the job alone, and says so
    code, _, output, _ = sbatch_with_stand_ins(
        tmp_path, ["--config", "c.yaml"], per_node, 143, failing="requeuehold"
    )
    calls = (tmp_path / "calls").read_text().splitlines()
    assert code == 9 and not [call for call in calls if "update" in call or "release" in call]
    assert "could not requeue job 42 (scontrol requeuehold: requeuehold: Job is no longer" in output
    # a node that is not bad (exit 5) is requeued onto the same nodes, as before
    code, _, _, requeued = sbatch_with_stand_ins(
        tmp_path, ["--config", "c.yaml"], per_node.replace("code 9", "code 5"), 143
    )
    calls = (tmp_path / "calls").read_text().splitlines()
    assert (code, requeued) == (143, True)
    assert not [call for call in calls if "ExcNodeList" in call]
    # an exit 9 whose launcher named no node (or another one) excludes nothing
    unnamed = per_node.split("\\n", 1)[1]
    code, _, output, requeued = sbatch_with_stand_ins(
        tmp_path, ["--config", "c.yaml"], unnamed, 143
    )
    calls = (tmp_path / "calls").read_text().splitlines()
    assert (code, requeued) == (143, True), output
    assert not [call for call in calls if "ExcNodeList" in call]
    assert "msjax: node n2 exited 9 without naming itself; not excluded" in output


def preempted_run(newest: str, started: str) -> str:
    """What srun prints for a run of the job that both launchers end by 143."""
    line = f"msjax.launch: checkpoints: newest committed step {newest} (step {started} at this "
    line += "launch's start)\\n"
    return f"{line}{line}msjax: node 0 (n1): msjax.launch exit code 143\\n"


def test_sbatch_script_counts_no_requeue_for_a_run_that_committed_a_newer_checkpoint(tmp_path):
    """Preempted (or at its time limit) after saving, on its 6th run, past MAX_REQUEUES=3: the
    job is requeued, and the requeue budget stays whole."""
    for run, (newest, started) in enumerate([("20", "none"), ("40", "20"), ("60", "40")]):
        code, _, output, requeued = sbatch_with_stand_ins(
            tmp_path,
            ["--config", "c.yaml"],
            preempted_run(newest, started),
            143,
            env={"SLURM_RESTART_COUNT": str(5 + run)},
            submit_dir=tmp_path,
        )
        assert (code, requeued) == (143, True), output
        assert f"this run committed checkpoint {newest} (it started from {started})" in output
        assert (tmp_path / "msjax-42.requeues").read_text() == "0\n"


def test_sbatch_script_gives_up_after_max_requeues_runs_in_a_row_without_a_newer_checkpoint(
    tmp_path,
):
    outcomes = []
    for newest, started in [("20", "none"), ("20", "20"), ("20", "20"), ("none", "20")]:
        code, _, output, requeued = sbatch_with_stand_ins(
            tmp_path,
            ["--config", "c.yaml"],
            preempted_run(newest, started),
            143,
            env={"MAX_REQUEUES": "2"},
            submit_dir=tmp_path,
        )
        outcomes.append((code, requeued, (tmp_path / "msjax-42.requeues").read_text()))
    assert outcomes == [
        (143, True, "0\n"),  # progress: free
        (143, True, "1\n"),
        (143, True, "2\n"),
        (143, False, "3\n"),  # a launcher that named no checkpoint made none
    ], output
    assert "after 2 requeues in a row that committed no newer checkpoint; giving up" in output
    # a job that finishes leaves no count behind
    sbatch_with_stand_ins(
        tmp_path, ["--config", "c.yaml"], preempted_run("80", "20"), 0, submit_dir=tmp_path
    )
    assert not (tmp_path / "msjax-42.requeues").exists()


def test_sbatch_script_requeues_an_infrastructure_failure(tmp_path):
    per_node = "msjax: node 0 (n1): msjax.launch exit code 14\\n"
    code, _, output, requeued = sbatch_with_stand_ins(
        tmp_path, ["--config", "c.yaml"], per_node, 14
    )
    assert (code, requeued) == (14, True), output


@pytest.mark.slow
@pytest.mark.slurm
def test_a_bad_node_is_excluded_by_requeue_and_the_job_finishes_on_the_spare(runs):
    job, bad = runs.jobs["bad_node"], runs.bad_node_file.read_text().strip()
    assert job.final["JobState"] == "COMPLETED" and job.final["ExitCode"] == "0:0", job.output
    output = job.output
    # the first crash of that node is one fault (a multi-node job restarts as a whole: exit 5),
    # the second in a row marks its slot bad: its launcher exits 9, its last line names it (the
    # requeued run may have placed it first, as node 0, when another job held the first node)
    exits = re.findall(rf"msjax: node (\d) \({bad}\): msjax.launch exit code (\d+)", output)
    assert [code for _, code in exits] == ["5", "9"], output
    assert exits[0][0] == "1", output
    rank_when_marked = int(exits[1][0])
    stopped = [line for line in output.splitlines() if "exit code 9;" in line]
    named = f"node {bad} is marked bad: the named cause of 2 faults in a row"
    assert stopped and named in stopped[0], output
    assert f"bad node(s) {bad}; requeueing without them" in output
    assert f"requeued and held; ExcNodeList={bad} set" in output, output
    assert f"job {job.job_id} released" in output, output
    # the requeued job ran without it, on the cluster's spare node
    assert job.final["ExcNodeList"] == bad
    nodes = subprocess.run(
        ["scontrol", "show", "hostnames", job.final["NodeList"]],
        env=job.env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert len(nodes) == 2 and bad not in nodes, nodes
    run_dir = RunDir(job.run_dir)
    assert sorted(losses(job.run_dir)) == list(range(BAD_NODE_STEPS))
    # the incident log names the excluded node, and so does the run's health record
    incidents = read_jsonl(run_dir.incidents_log)
    marked = [i for i in incidents if i.get("bad_slot")]
    assert [i["bad_slot"]["node"] for i in marked] == [bad], incidents
    assert (marked[0]["action"], marked[0]["rank"], marked[0]["cause"]) == (
        "stop",
        rank_when_marked,
        "crash",
    )
    bad_slots = json.loads(run_dir.bad_slots.read_text())["slots"]
    assert [(slot["slot"], slot["on_bad_node"]) for slot in bad_slots] == [(bad, "exclude")]
    launches = job.launches()
    assert launches[-1]["outcome"] == "done" and len(launches) == 3
    goodput = json.loads(run_dir.goodput.read_text())
    print(
        f"\nfigures: bad-node job {runs.wall_s['bad_node']:.0f} s wall, 3 runs, effective training "
        f"time {100 * goodput['effective_training_time_ratio']:.1f}% ({goodput['breakdown_s']})"
    )
