"""In-memory snapshots under a worker's crash: a 2-process msjax.launch job snapshotting every
step restarts from memory (losing at most one step, bitwise on the uninterrupted run's losses),
restores a process whose node lost its memory (the fault injector's memory_loss) from the copy
its buddy holds, refuses a snapshot with a flipped byte (snapshot_bitflip) and goes to the disk,
and leaves no snapshot behind."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import Finished, launch_command, run_to_end
from small_runs import QUICK_RUN

from msjax.checkpoint.snapshots import SHARED_MEMORY, run_snapshots_dir
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
CRASH = [f"--fault=crash@step={CRASH_STEP},rank=1"]
DAMAGED = [f"--fault=snapshot_bitflip@step={CRASH_STEP},rank=1"]
# rank 1's snapshots, and the copies it holds for rank 0, are deleted; then it is killed
NODE_LOSS = [f"--fault=memory_loss@step={CRASH_STEP},rank=1"]


@dataclass(frozen=True)
class Ended:
    """A finished job: its exit code, its launcher's output and its workers' logs."""

    run_dir: Path
    exit_code: int
    output: str

    def worker_logs(self) -> str:
        run = RunDir(self.run_dir)
        return "".join(run.log(rank).read_text() for rank in (0, 1))

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
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Ended:
    """Rank 1 crashes before step CRASH_STEP; the restart finds the snapshots whole."""
    return run_job(tmp_path_factory.mktemp("crashed") / "run", CRASH, 0.1)


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


def test_a_restart_after_a_crash_restores_from_memory_losing_at_most_one_step(crashed: Ended):
    assert crashed.exit_code == 0, crashed.output[-3000:]
    logs = crashed.worker_logs()
    restored = [line for line in logs.splitlines() if "from memory:" in line]
    assert len(restored) == 2, logs[-3000:]  # one line per process
    step = int(restored[0].split("restored step ")[1].split()[0])
    assert CRASH_STEP - 1 <= step <= CRASH_STEP  # snapshots every step: at most one lost
    assert all("0 bytes read from the checkpoint directory" in line for line in restored)
    assert "from disk" not in logs
    (incident,) = Finished(crashed.run_dir, 0, "").incidents()
    assert (incident["cause"], incident["rank"]) == ("crash", 1)
    assert (incident["resumed_from"], incident["resumed_from_step"]) == ("memory", step)
    # the launcher saw the fault at the step of the heartbeat it read last
    assert incident["steps_lost"] == max(incident["step"] - step, 0) <= 1
    assert "memory_not_used" not in incident


def test_a_run_restored_from_memory_ends_with_the_uninterrupted_runs_losses(
    crashed: Ended, reference: Ended
):
    assert reference.exit_code == 0, reference.output[-3000:]
    expected, actual = reference.losses(), crashed.losses()
    assert sorted(actual) == sorted(expected) == list(range(8))
    assert actual == expected  # bitwise: JSON keeps every bit of a float


def test_the_launcher_removes_the_snapshots_when_the_job_ends(crashed: Ended):
    assert not run_snapshots_dir(crashed.run_dir, SHARED_MEMORY).exists()


def test_every_step_records_the_snapshots_stall_and_bytes(crashed: Ended):
    records = [
        r for r in Finished(crashed.run_dir, 0, "").metrics() if "memory_snapshot_bytes" in r
    ]
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
