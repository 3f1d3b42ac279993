"""One job per run directory: a second job is refused, writing nothing; a killed job frees it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import LaunchJob, job_env, run_to_end, wait_until

from msjax.errors import MsjaxError
from msjax.run_dir import RunDir
from msjax.run_lock import RunDirLock

ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "train.global_batch=2"]


def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(path.relative_to(root)): (path.lstat().st_size, path.lstat().st_mtime_ns)
        for path in sorted(root.rglob("*"))
    }


def environment(tmp_path: Path) -> dict[str, str]:
    """The variables on top of job_env() for every process of these tests."""
    return {
        "MSJAX_CACHE_DIR": str(tmp_path / "cache"),
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": "1",
    }


def wait_for_holder(run_dir: RunDir, pid: int) -> None:
    """Until the lock file names pid as its holder."""

    def held_by_pid() -> bool:
        try:
            return json.loads(run_dir.lock.read_text())["pid"] == pid
        except (OSError, ValueError, KeyError):
            return False

    wait_until(held_by_pid, f"pid {pid} holding {run_dir.lock}")


def test_lock_is_exclusive_and_released_by_its_holder(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    first = RunDirLock(run_dir)
    first.acquire()
    with pytest.raises(MsjaxError, match=f"pid {os.getpid()} on .*choose another run.dir"):
        RunDirLock(run_dir).acquire()
    first.release()
    with RunDirLock(run_dir) as again:
        assert again.held


HOLD_LOCK = """
import sys, time
from pathlib import Path
from msjax.run_dir import RunDir
from msjax.run_lock import RunDirLock
RunDirLock(RunDir(Path(sys.argv[1]))).acquire()
time.sleep(600)
"""


def refused(command: list[str], train_args: list[str], env: dict[str, str]) -> str:
    """Run a second job; assert exit 2 and one stderr line; return that line."""
    second = run_to_end([sys.executable, "-m", *command, *train_args], 300, **env)
    assert second.returncode == 2, second.stderr
    lines = second.stderr.splitlines()
    assert len(lines) == 1, second.stderr
    return lines[0]


def wait_until_free(run_dir: RunDir) -> None:
    def free() -> bool:
        try:
            with RunDirLock(run_dir) as lock:
                assert lock.held
            return True
        except MsjaxError:
            return False

    wait_until(free, "the killed job's lock released")


@pytest.mark.slow
def test_a_second_job_is_refused_writing_nothing_and_a_killed_holder_frees_the_dir(
    tmp_path: Path,
) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    env = environment(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run_dir.path)], env=job_env(**env)
    )
    try:
        wait_for_holder(run_dir, holder.pid)
        before = tree(tmp_path)
        train_args = [f"run.dir={run_dir.path}", *ONE_DEVICE]
        for command in (["msjax.launch", "--"], ["msjax.train"]):
            line = refused(command, train_args, env)
            assert f"is in use by another job (pid {holder.pid} on" in line
            assert tree(tmp_path) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    wait_until_free(run_dir)


@pytest.mark.slow
def test_the_supervisor_holds_the_lock_for_its_job_until_it_is_killed(tmp_path: Path) -> None:
    """A real supervised job: its launcher (not a worker) holds the lock, a second launch is
    refused, and SIGKILL of the whole job leaves nothing that blocks a rerun."""
    run_dir = RunDir(tmp_path / "run")
    env = environment(tmp_path)
    train_args = [f"run.dir={run_dir.path}", "train.steps=100000", *ONE_DEVICE]
    first = LaunchJob.start(
        run_dir.path,
        ["train.steps=100000", *ONE_DEVICE],
        devices_per_proc=None,
        log_path=tmp_path / "first-launch.log",
        env=env,
        new_session=True,
    )
    try:
        wait_for_holder(run_dir, first.pid)
        line = refused(["msjax.launch", "--"], train_args, env)
        assert f"is in use by another job (pid {first.pid} on" in line
        assert first.running(), "the first job must still be running"
    finally:
        first.send_to_group(signal.SIGKILL)
        first.finish()
    wait_until_free(run_dir)
