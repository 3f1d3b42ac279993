"""Restores that lose no progress: a read error is not damage (exit 7, the step stays where it is),
checkpoint.resume_from applies to a run's first start only and never swaps a named damaged step
for an older one, model.init_from never re-initializes over checkpoints that do not restore, and
processes that list different checkpoints all stop, naming the odd one.

Read errors come from real file-system paths that fail for root too: a symlink to /proc/self/mem
(reading at offset 0 is EIO) and to /proc/sys/vm/compact_memory (write-only: EACCES on open).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import Job, distributed_env, job_env, launch_command, run_to_end, train_command

from msjax.checkpoint.manager import META_FILE, Checkpointer, committed_steps
from msjax.checkpoint.read_errors import CheckpointUnreadable, is_read_failure
from msjax.config import CheckpointConfig
from msjax.hf.export import export_checkpoint
from msjax.launch.workers import free_port
from msjax.observe.metrics import read_metrics
from msjax.resilience import exit_codes
from tests.small_runs import QUICK_RUN

EIO_PATH = Path("/proc/self/mem")  # read(2) at offset 0 (never mapped) fails with EIO
EACCES_PATH = Path("/proc/sys/vm/compact_memory")  # mode 0200: open for reading is EACCES
needs_proc_faults = pytest.mark.skipif(
    not (EIO_PATH.exists() and EACCES_PATH.exists()), reason="needs Linux /proc"
)


def small_state(seed: int) -> dict[str, jax.Array]:
    values = np.random.default_rng(seed).standard_normal((16, 64)).astype(np.float32)
    return {"weights": jnp.asarray(values), "step": jnp.int32(seed)}


def abstract_of(state: dict[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def replace_with_link(path: Path, target: Path) -> Path:
    """Put a symlink to target where path was; returns where the file went."""
    kept = path.with_name(path.name + ".kept")
    path.rename(kept)
    path.symlink_to(target)
    return kept


def put_back(path: Path, kept: Path) -> None:
    path.unlink()
    kept.rename(path)


def garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(byte ^ 0xFF for byte in data[middle : middle + 64])
    path.write_bytes(data)


def raised_by(action: Callable[[], object]) -> BaseException:
    try:
        action()
    except BaseException as error:  # the error itself is what is classified
        return error
    raise AssertionError("nothing was raised")


@needs_proc_faults
def test_what_counts_as_a_failed_read_and_what_as_damage(tmp_path: Path):
    (tmp_path / "a_dir").mkdir()
    failed_reads = {
        "EIO": raised_by(EIO_PATH.read_bytes),
        "EACCES": raised_by(EACCES_PATH.read_bytes),
        "EISDIR": raised_by((tmp_path / "a_dir").read_bytes),
        "out of memory": raised_by(lambda: np.empty(2**62, np.uint8)),
    }
    (tmp_path / "a_file").write_text("x")
    missing = {
        "ENOENT": raised_by((tmp_path / "missing").read_bytes),
        "ENOTDIR": raised_by((tmp_path / "a_file" / "y").read_bytes),
    }
    assert {name: is_read_failure(error) for name, error in failed_reads.items()} == dict.fromkeys(
        failed_reads, True
    )
    assert {name: is_read_failure(error) for name, error in missing.items()} == dict.fromkeys(
        missing, False
    )
    # wrapped, as Orbax wraps TensorStore's error: the cause decides
    try:
        try:
            EACCES_PATH.read_bytes()
        except OSError as error:
            raise RuntimeError("Encountered error while reading array index") from error
    except RuntimeError as wrapped:
        assert is_read_failure(wrapped)
    assert not is_read_failure(ValueError("OUT_OF_RANGE: Requested byte range is not valid"))


@pytest.fixture
def two_steps(tmp_path: Path) -> tuple[Checkpointer, dict[str, jax.Array]]:
    checkpointer = Checkpointer(tmp_path, CheckpointConfig())
    checkpointer.save(1, small_state(1), {"note": "first"})
    checkpointer.save(2, small_state(2), {"note": "second"})
    checkpointer.wait()
    yield checkpointer, small_state(2)
    checkpointer.close()


@needs_proc_faults
def test_an_io_error_on_the_newest_record_ends_the_restore_and_moves_nothing(two_steps, tmp_path):
    checkpointer, state = two_steps
    record = tmp_path / "2" / "meta" / META_FILE
    kept = replace_with_link(record, EIO_PATH)
    lines: list[str] = []
    with pytest.raises(CheckpointUnreadable, match="Input/output error") as raised:
        checkpointer.restore_newest_valid(abstract_of(state), lines.append)
    assert f"checkpoint {tmp_path}/2 looks whole but could not be read by process 0" in str(
        raised.value
    )
    assert "left in place" in str(raised.value)
    # not taken for damage: nothing moved aside, no fall back to the older step 1
    assert committed_steps(tmp_path) == [1, 2]
    assert not (tmp_path / "damaged").exists()
    assert lines == [] and checkpointer.skipped == []
    put_back(record, kept)
    restored = checkpointer.restore_newest_valid(abstract_of(state), lines.append)
    assert restored.step == 2 and restored.meta["note"] == "second"


@needs_proc_faults
def test_a_permission_error_on_an_array_file_is_not_damage_but_garbled_bytes_are(
    two_steps, tmp_path
):
    checkpointer, state = two_steps
    array_file = largest_file(tmp_path / "2" / "state")
    kept = replace_with_link(array_file, EACCES_PATH)
    lines: list[str] = []
    with pytest.raises(CheckpointUnreadable, match="Permission denied") as raised:
        checkpointer.restore_newest_valid(abstract_of(state), lines.append)
    assert "is damaged" not in str(raised.value) and lines == []
    assert committed_steps(tmp_path) == [1, 2] and not (tmp_path / "damaged").exists()
    put_back(array_file, kept)
    restored = checkpointer.restore(2, abstract_of(state))
    np.testing.assert_array_equal(
        np.asarray(restored.state["weights"]), np.asarray(state["weights"])
    )
    # the same file garbled is damage: moved aside, and the older step restores
    garble(array_file)
    restored = checkpointer.restore_newest_valid(abstract_of(state), lines.append)
    assert restored.step == 1
    assert len(lines) == 1 and f"{tmp_path}/2 is corrupted" in lines[0]
    assert committed_steps(tmp_path) == [1] and (tmp_path / "damaged" / "2").is_dir()


# --- whole runs: python -m msjax.train ---------------------------------------------------------


def train(run_dir: Path, *overrides: str, devices: int = 2) -> subprocess.CompletedProcess:
    command = train_command(run_dir, [
        *QUICK_RUN, "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", "train.eval_every=0",
        "checkpoint.every_steps=2", "checkpoint.max_to_keep=2", *overrides,
    ])  # fmt: skip
    return run_to_end(command, JAX_NUM_CPU_DEVICES=str(devices))


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("msjax.train:")]


@dataclass(frozen=True)
class SourceRun:
    run_dir: Path  # finished at step 4, with checkpoints 2 and 4; step 4 is damaged
    hf_dir: Path  # its step 4, exported to Hugging Face while it was whole


@pytest.fixture(scope="module")
def source_run(tmp_path_factory: pytest.TempPathFactory) -> SourceRun:
    base = tmp_path_factory.mktemp("source")
    run_dir = base / "run"
    first = train(run_dir, "train.steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    assert committed_steps(run_dir / "checkpoints") == [2, 4]
    export_checkpoint(str(run_dir), base / "hf")
    garble(largest_file(run_dir / "checkpoints" / "4" / "state"))
    return SourceRun(run_dir, base / "hf")


@pytest.mark.slow
def test_a_named_resume_step_that_is_damaged_is_refused_not_replaced_by_an_older_one(
    source_run: SourceRun, tmp_path: Path
):
    source, checkpoints = source_run.run_dir, source_run.run_dir / "checkpoints"
    named = train(tmp_path / "named", "train.steps=6", f"checkpoint.resume_from={source}/4")
    assert named.returncode == 2, named.stdout[-2000:] + named.stderr[-2000:]
    errors = error_lines(named)
    assert len(errors) == 1 and "Traceback" not in named.stderr, named.stderr
    assert f"checkpoint.resume_from={source}/4:" in errors[0]
    assert f"{checkpoints}/4 is corrupted" in errors[0]
    assert "an older step is not taken in its place" in errors[0]
    assert "resumed from" not in named.stdout
    assert committed_steps(tmp_path / "named" / "checkpoints") == []
    assert committed_steps(checkpoints) == [2, 4]  # a source is only read, never moved


@pytest.mark.slow
def test_resume_from_applies_to_a_runs_first_start_only(source_run: SourceRun, tmp_path: Path):
    source, checkpoints = source_run.run_dir, source_run.run_dir / "checkpoints"
    run_dir = tmp_path / "resumed"
    # PATH alone: its newest valid step (2; 4 is damaged) starts the run
    first = train(run_dir, "train.steps=4", f"checkpoint.resume_from={source}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"resumed from {checkpoints}/2 (step 2)" in first.stdout
    assert committed_steps(run_dir / "checkpoints") == [4]
    # a rerun (or a supervisor's restart) goes on from the run's own step 4, not the source's 2
    rerun = train(run_dir, "train.steps=6", f"checkpoint.resume_from={source}")
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/4 (step 4)" in rerun.stdout
    assert "applies to a run's first start only" in rerun.stdout
    assert committed_steps(run_dir / "checkpoints") == [4, 6]
    resumes = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("event") == "resume"]
    assert [r["step"] for r in resumes] == [2, 4]


@pytest.mark.slow
def test_init_from_never_reimports_over_checkpoints_that_do_not_restore(
    source_run: SourceRun, tmp_path: Path
):
    imported = tmp_path / "imported"
    init_from = f"model.init_from=hf:{source_run.hf_dir}"
    started = train(imported, init_from, "train.steps=2")
    assert started.returncode == 0, started.stderr[-3000:]
    assert "initialized from the Hugging Face weights" in started.stdout
    garble(largest_file(imported / "checkpoints" / "2" / "state"))
    records_before = len(read_metrics(imported / "metrics.jsonl"))
    refused = train(imported, init_from, "train.steps=4")
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert "initialized from the Hugging Face weights" not in refused.stdout
    errors = error_lines(refused)
    assert len(errors) == 1 and "none of the 1 checkpoints" in errors[0], refused.stderr
    assert (imported / "checkpoints" / "damaged" / "2").is_dir()
    assert len(read_metrics(imported / "metrics.jsonl")) == records_before


# --- a two-process job -------------------------------------------------------------------------

JOB = [
    *QUICK_RUN, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=1", "train.eval_every=0",
    "checkpoint.every_steps=2", "resilience.max_restarts=0",
]  # fmt: skip


def launch(run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    command = launch_command(run_dir, [*JOB, f"train.steps={steps}"], nprocs=2, devices_per_proc=2)
    return run_to_end(command)


def can_unshare_mounts() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return probe.returncode == 0


def start_worker(
    rank: int, port: int, run_dir: Path, log: Path, rank_1_mount: str, mount_point: Path
) -> Job:
    """One worker of a two-process job started by hand; rank 1 in a mount namespace of its own
    where `mount ... "$0"` (at mount_point) changes what that node sees."""
    env = job_env(JAX_NUM_CPU_DEVICES="2", **distributed_env(f"127.0.0.1:{port}", 2, rank))
    command = train_command(run_dir, [*JOB, "train.steps=6"])
    if rank == 1:
        script = f'{rank_1_mount} && exec "$@"'
        command = ["unshare", "-m", "sh", "-c", script, str(mount_point), *command]
    return Job(command, run_dir, log, env)


def run_job_by_hand(
    run_dir: Path, rank_1_mount: str, mount_point: Path, logs: Path
) -> tuple[list[int], list[str]]:
    """Both workers' exit codes and output."""
    port = free_port()
    paths = [logs / f"{mount_point.name}-worker{rank}.log" for rank in (0, 1)]
    workers = [
        start_worker(rank, port, run_dir, paths[rank], rank_1_mount, mount_point) for rank in (0, 1)
    ]
    ended = [worker.finish() for worker in workers]
    return [worker.exit_code for worker in ended], [worker.output for worker in ended]


@pytest.mark.slow
@needs_proc_faults
@pytest.mark.skipif(not can_unshare_mounts(), reason="needs a mount namespace (unshare -m)")
def test_processes_that_list_other_checkpoints_or_cannot_read_one_all_stop_and_move_nothing(
    tmp_path: Path,
):
    run_dir = tmp_path / "run"
    first = launch(run_dir, 4)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    assert committed_steps(checkpoints) == [2, 4]
    records_before = len(read_metrics(run_dir / "metrics.jsonl"))

    # rank 1's node sees no checkpoints (an empty mount): every process stops, naming it; none
    # starts afresh
    codes, outputs = run_job_by_hand(
        run_dir, 'mount -t tmpfs msjax-test "$0"', checkpoints, tmp_path
    )
    assert codes == [exit_codes.CHECKPOINT_UNREADABLE] * 2, "\n".join(outputs)[-5000:]
    for output in outputs:
        assert "resumed from" not in output and "Traceback" not in output, output[-3000:]
    stops = [line for line in outputs[0].splitlines() if "list different checkpoints" in line]
    assert len(stops) == 1, outputs[0][-3000:]
    assert (
        f"in {checkpoints}: process 1: no committed step; process 0: 2 committed steps "
        "(newest 4)" in stops[0]
    )
    assert committed_steps(checkpoints) == [2, 4] and not (checkpoints / "damaged").exists()
    assert len(read_metrics(run_dir / "metrics.jsonl")) == records_before

    # on rank 1's node alone, a file of step 4 fails with EACCES: rank 0, which read its part,
    # names rank 1; both exit 7 and the step stays
    array_file = largest_file(checkpoints / "4" / "state" / "ocdbt.process_1")
    codes, outputs = run_job_by_hand(
        run_dir, f'mount --bind {EACCES_PATH} "$0"', array_file, tmp_path
    )
    assert codes == [exit_codes.CHECKPOINT_UNREADABLE] * 2, "\n".join(outputs)[-5000:]
    stops = [line for line in outputs[0].splitlines() if "looks whole" in line]
    assert len(stops) == 1, outputs[0][-3000:]
    assert f"checkpoint {checkpoints}/4 looks whole but could not be read by process 1;" in stops[0]
    assert "left in place" in stops[0] and "resumed from" not in outputs[0]
    assert committed_steps(checkpoints) == [2, 4] and not (checkpoints / "damaged").exists()
    assert len(read_metrics(run_dir / "metrics.jsonl")) == records_before

    # the same file unreadable on every node, under the supervisor: its incident says why, it
    # counts as a retryable crash (restarts spent: 4), and the step still stays
    kept = replace_with_link(array_file, EACCES_PATH)
    unreadable = launch(run_dir, 6)
    output = unreadable.stdout + unreadable.stderr
    put_back(array_file, kept)
    assert unreadable.returncode == exit_codes.RESTARTS_EXHAUSTED, output[-5000:]
    assert "exit code 7 (a checkpoint that looks whole could not be read" in output
    rank_logs = "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("rank*.log")))
    assert f"checkpoint {checkpoints}/4 looks whole but could not be read by processes" in (
        rank_logs
    )
    assert committed_steps(checkpoints) == [2, 4] and not (checkpoints / "damaged").exists()
    assert len(read_metrics(run_dir / "metrics.jsonl")) == records_before
