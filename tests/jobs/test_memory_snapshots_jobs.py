"""In-memory snapshots under a worker's death: a 4-process msjax.launch job snapshotting every
step and waiting for a snapshot still being written rather than skipping the next
(checkpoint.memory_when_busy=wait), one worker SIGKILLed from outside at a step drawn from a fixed
seed, restarts from memory on every process (0 bytes read from the checkpoint directory, at most
one step lost, no snapshot skipped, bitwise on the uninterrupted 4-process run's losses); a
2-process job restores a process whose node lost its memory (the fault injector's memory_loss)
from the copy its buddy holds, refuses a snapshot with a flipped byte (snapshot_bitflip) and goes
to the disk; no job leaves a snapshot behind."""

from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import Finished, LaunchJob, launch_command, run_to_end
from small_runs import QUICK_RUN

from msjax.checkpoint.snapshots import SHARED_MEMORY, run_snapshots_dir
from msjax.resilience.heartbeat import HeartbeatRecord
from msjax.run_dir import RunDir

pytestmark = pytest.mark.skipif(
    not SHARED_MEMORY.is_dir(), reason="in-memory snapshots need /dev/shm"
)

CRASH_STEP = 5  # rank 1 dies before this step runs: its state then has 5 updates
OVERRIDES = [
    *QUICK_RUN,
    "train.eval_every=0",
    "train.steps=8",
    "checkpoint.every_steps=3",  # a disk save at step 3, none newer before the crash
    "checkpoint.memory_every_steps=1",
    "mesh.data=2",
    "mesh.fsdp=1",
    "mesh.tensor=1",
    "resilience.heartbeat_every_s=0.05",
    "resilience.stop_grace_s=2",
]
DAMAGED = [f"--fault=snapshot_bitflip@step={CRASH_STEP},rank=1"]
# rank 1's snapshots, and the copies it holds for rank 0, are deleted; then it is killed
NODE_LOSS = [f"--fault=memory_loss@step={CRASH_STEP},rank=1"]

# The 4-process job killed from outside: data 2 x fsdp 2, one device per process
KILL_PROCESSES, KILL_STEPS, KILL_SAVE_EVERY = 4, 10, 5  # disk saves at step 5 and at the end
KILL_SEED = 20261205  # fixed: every run kills the same rank at the same step
_draw = random.Random(KILL_SEED)
KILLED_RANK = _draw.randrange(KILL_PROCESSES)
# at least two steps past the disk save (a snapshot one step behind the kill is still newer than
# it) and two before the end (the kill lands before the run's last save)
KILL_STEP = _draw.randint(KILL_SAVE_EVERY + 2, KILL_STEPS - 2)
KILLED = f"(seed {KILL_SEED}: rank {KILLED_RANK} SIGKILLed once its heartbeat showed {KILL_STEP})"
KILL_OVERRIDES = [
    *QUICK_RUN,
    "train.eval_every=0",
    f"train.steps={KILL_STEPS}",
    f"checkpoint.every_steps={KILL_SAVE_EVERY}",
    "checkpoint.memory_every_steps=1",
    "checkpoint.memory_when_busy=wait",  # no snapshot skipped: at most one step lost per fault
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=1",
    "resilience.heartbeat_every_s=0.05",
    "resilience.stop_grace_s=2",
    "resilience.restart_backoff_s=0.1",
]


@dataclass(frozen=True)
class Ended:
    """A finished job: its exit code, its launcher's output and its workers' logs."""

    run_dir: Path
    exit_code: int
    output: str
    processes: int = 2

    def worker_logs(self) -> str:
        run = RunDir(self.run_dir)
        return "".join(run.log(rank).read_text() for rank in range(self.processes))

    def losses(self) -> dict[int, float]:
        return Finished(self.run_dir, self.exit_code, self.output).losses()


def run_job(
    run_dir: Path, flags: list[str], backoff_s: float, extra: tuple[str, ...] = ()
) -> Ended:
    overrides = [*OVERRIDES, f"resilience.restart_backoff_s={backoff_s}", *extra]
    done = run_to_end(launch_command(run_dir, overrides, nprocs=2, launch_flags=flags))
    return Ended(run_dir, done.returncode, done.stdout + done.stderr)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Ended:
    """The same job, never interrupted."""
    return run_job(tmp_path_factory.mktemp("reference") / "run", [], 0.1)


@pytest.fixture(scope="module")
def killed_reference(tmp_path_factory: pytest.TempPathFactory) -> Ended:
    """The 4-process job, never interrupted."""
    run_dir = tmp_path_factory.mktemp("killed_reference") / "run"
    command = launch_command(run_dir, KILL_OVERRIDES, nprocs=KILL_PROCESSES)
    done = run_to_end(command)
    return Ended(run_dir, done.returncode, done.stdout + done.stderr, KILL_PROCESSES)


def reached(job: LaunchJob, rank: int, step: int) -> HeartbeatRecord | None:
    """An event: rank's heartbeat shows it training at `step` or past it in attempt 0."""
    record = job.heartbeat(rank)
    if record is None or (record.attempt, record.phase) != (0, "step"):
        return None
    return record if record.step >= step else None


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Ended:
    """The 4-process job, rank KILLED_RANK SIGKILLed from outside (os.kill, no injected fault:
    nothing waits for its snapshot being written) once its heartbeat shows step KILL_STEP."""
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    job = LaunchJob.start(run_dir, KILL_OVERRIDES, nprocs=KILL_PROCESSES)
    try:
        beat = job.wait_for(
            lambda: reached(job, KILLED_RANK, KILL_STEP),
            f"rank {KILLED_RANK} training at step {KILL_STEP} in attempt 0 {KILLED}",
        )
        os.kill(beat.pid, signal.SIGKILL)
    except BaseException:
        job.stop(signal.SIGTERM)  # the launcher stops its workers
        raise
    done = job.finish()
    return Ended(run_dir, done.exit_code, done.output, KILL_PROCESSES)


@pytest.fixture(scope="module")
def node_lost(tmp_path_factory: pytest.TempPathFactory) -> Ended:
    """Rank 1's node loses its memory (its snapshots gone, the process killed) before step
    CRASH_STEP; rank 0 holds the copies of rank 1's snapshots."""
    return run_job(tmp_path_factory.mktemp("node_lost") / "run", NODE_LOSS, 0.1)


def restored_lines(ended: Ended, rank: int) -> list[str]:
    """The lines of rank's log that say it restored from memory."""
    log = RunDir(ended.run_dir).log(rank).read_text()
    return [line for line in log.splitlines() if "from memory:" in line]


def test_a_process_whose_node_lost_its_memory_restores_from_its_buddys_copy(node_lost: Ended):
    assert node_lost.exit_code == 0, node_lost.output[-3000:]
    logs = node_lost.worker_logs()
    assert "a copy of each goes to process 0" in RunDir(node_lost.run_dir).log(1).read_text()
    (own,), (copy,) = restored_lines(node_lost, 0), restored_lines(node_lost, 1)
    assert "bytes of this process's snapshot" in own, logs[-3000:]
    assert "bytes of the copy its buddy held" in copy and "process 0's copy of step" in copy
    step = int(copy.split("restored step ")[1].split()[0])
    assert CRASH_STEP - 1 <= step <= CRASH_STEP  # the buddy's copy is at most one step behind
    assert all("0 bytes read from the checkpoint directory" in line for line in (own, copy))
    assert "from disk" not in logs
    (incident,) = Finished(node_lost.run_dir, 0, "").incidents()
    assert incident["rank"] == 1
    assert (incident["resumed_from"], incident["resumed_from_step"]) == ("memory", step)
    assert incident["steps_lost"] <= 1
    by_rank = incident["restored_by_rank"]
    assert [by_rank[rank]["source"] for rank in ("0", "1")] == ["own", "buddy"]
    sizes = [by_rank[rank]["bytes"] for rank in ("0", "1")]
    assert sizes[0] == sizes[1] > 0  # the same shards each, read from memory
    assert all(by_rank[rank]["seconds"] >= 0 for rank in ("0", "1"))


def test_a_run_restored_from_a_buddys_copy_ends_with_the_uninterrupted_runs_losses(
    node_lost: Ended, reference: Ended
):
    assert reference.exit_code == 0, reference.output[-3000:]
    assert node_lost.losses() == reference.losses()  # bitwise
    assert not run_snapshots_dir(node_lost.run_dir, SHARED_MEMORY).exists()


def snapshots_started_before(ended: Ended, step: int) -> list[int]:
    """The steps, up to `step`, whose snapshot the first attempt started (not skipped for one
    still being written), as process 0 recorded them: the first record of each step in
    metrics.jsonl is the first attempt's."""
    first: dict[int, dict] = {}
    for record in Finished(ended.run_dir, 0, "").metrics():
        if "memory_snapshot_bytes" in record:
            first.setdefault(record["step"], record)
    return sorted(s for s, r in first.items() if r["memory_snapshot_bytes"] > 0 and s <= step)


def snapshots_skipped(ended: Ended) -> list[int]:
    """Every memory_snapshots_skipped count process 0 recorded, over all its attempts."""
    records = Finished(ended.run_dir, 0, "").metrics()
    return [r["memory_snapshots_skipped"] for r in records if "memory_snapshots_skipped" in r]


def test_a_restart_after_a_worker_is_killed_restores_the_newest_whole_snapshot_from_memory(
    killed: Ended,
):
    assert killed.exit_code == 0, f"{KILLED}\n{killed.output[-3000:]}"
    logs = killed.worker_logs()
    restored = [line for line in logs.splitlines() if "from memory:" in line]
    assert len(restored) == KILL_PROCESSES, f"{KILLED}\n{logs[-3000:]}"  # one per process
    steps = {int(line.split("restored step ")[1].split()[0]) for line in restored}
    assert len(steps) == 1, (KILLED, restored)  # every process restores the same step
    (step,) = steps
    assert step > KILL_SAVE_EVERY  # newer than the newest disk save, which it is preferred to
    assert all("bytes of this process's snapshot" in line for line in restored), restored
    assert all("0 bytes read from the checkpoint directory" in line for line in restored)
    assert "from disk" not in logs, KILLED
    (incident,) = Finished(killed.run_dir, 0, "").incidents()
    assert (incident["cause"], incident["rank"]) == ("crash", KILLED_RANK), (KILLED, incident)
    # (where rank 0 is the one killed, the detail adds that it hosted the coordinator)
    assert incident["detail"].startswith("killed by SIGKILL"), (KILLED, incident)
    assert incident["step"] >= KILL_STEP, (KILLED, incident)
    assert (incident["resumed_from"], incident["resumed_from_step"]) == ("memory", step)
    # the launcher saw the fault at the newest step any heartbeat it read showed
    assert incident["steps_lost"] == max(incident["step"] - step, 0), (KILLED, incident)
    # A snapshot starts only once every process has written the one before whole (waited for,
    # never skipped), so the restore holds the snapshot of the kill's step, or of the one before
    # it where that was still being written when the kill came: at most one step lost.
    started = snapshots_started_before(killed, incident["step"])
    assert step in started[-2:], (KILLED, incident, started)
    assert incident["step"] - 1 <= step, (KILLED, incident)
    assert incident["steps_lost"] <= 1, (KILLED, incident)
    skipped = snapshots_skipped(killed)
    assert skipped and set(skipped) == {0}, (KILLED, skipped)
    assert "memory_not_used" not in incident, (KILLED, incident)
    by_rank = incident["restored_by_rank"]
    assert sorted(by_rank) == [str(rank) for rank in range(KILL_PROCESSES)], by_rank
    assert {by_rank[rank]["source"] for rank in by_rank} == {"own"}, (KILLED, by_rank)
    sizes = {by_rank[rank]["bytes"] for rank in by_rank}
    assert len(sizes) == 1 and min(sizes) > 0, by_rank  # half the state each (fsdp 2), from memory


def test_a_run_restored_from_memory_after_a_kill_ends_with_the_uninterrupted_runs_losses(
    killed: Ended, killed_reference: Ended
):
    assert killed_reference.exit_code == 0, killed_reference.output[-3000:]
    expected, actual = killed_reference.losses(), killed.losses()
    assert sorted(actual) == sorted(expected) == list(range(KILL_STEPS)), KILLED
    assert actual == expected, KILLED  # bitwise: JSON keeps every bit of a float


def test_the_launcher_removes_the_snapshots_when_the_job_ends(
    killed: Ended, killed_reference: Ended
):
    assert not run_snapshots_dir(killed.run_dir, SHARED_MEMORY).exists(), KILLED
    assert not run_snapshots_dir(killed_reference.run_dir, SHARED_MEMORY).exists()


def test_every_step_records_the_snapshots_stall_and_bytes(killed: Ended):
    records = [r for r in Finished(killed.run_dir, 0, "").metrics() if "memory_snapshot_bytes" in r]
    taken = [r for r in records if r["memory_snapshot_bytes"] > 0]
    assert taken and all(r["memory_snapshot_stall_s"] >= 0 for r in records)
    assert len({r["memory_snapshot_bytes"] for r in taken}) == 1  # the same shards every time
    assert {r["step"] for r in records} >= {1, 2, 3}


def test_a_snapshot_with_a_flipped_byte_is_refused_and_every_process_restores_from_disk(
    tmp_path: Path, reference: Ended
):
    # rank 1 flips a byte in each of its whole snapshots, then crashes before step CRASH_STEP;
    # with no copies on a buddy to fall back on
    run_dir = tmp_path / "run"
    job = run_job(run_dir, DAMAGED, 0.1, ("checkpoint.memory_buddy=false",))
    ended = Finished(run_dir, job.exit_code, job.output)
    assert ended.exit_code == 0, ended.output[-3000:]
    logs = "".join(RunDir(run_dir).log(rank).read_text() for rank in (0, 1))
    assert "does not match its sha256" in logs, logs[-3000:]
    assert logs.count("every process restores from the checkpoint directory") == 2
    assert "restored step 3 from disk" in logs
    assert "from memory:" not in logs
    (incident,) = ended.incidents()
    assert (incident["resumed_from"], incident["resumed_from_step"]) == ("disk", 3)
    reasons = incident["memory_not_used"]
    assert "rank 0: the snapshot of step " in reasons, reasons
    assert "rank 1: the snapshot of step " in reasons
    assert "0.bin does not match its sha256" in reasons.split("rank 1: ")[1]
    assert ended.losses() == reference.losses()  # the disk checkpoint continues bitwise too
