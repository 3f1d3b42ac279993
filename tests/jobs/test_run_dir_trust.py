"""A run directory is msjax's only if msjax wrote it; its links are never followed; what msjax
writes there outside checkpoints survives a full disk (a real tmpfs, filled) with one warning per
file, and a failed write leaves no temporary file behind."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from checkpoint_fault_helpers import mounted_tmpfs
from harness import LaunchJob, job_env, launch_command, train_command, wait_until
from small_runs import QUICK_RUN

from msjax.config import load_config
from msjax.errors import MsjaxError
from msjax.launch.__main__ import main as launch_main
from msjax.launch.workers import WorkerProcess
from msjax.observe.metrics import MetricsWriter
from msjax.resilience import exit_codes
from msjax.resilience.heartbeat import Heartbeat
from msjax.resolve import resolve_run_dir
from msjax.run_dir import RunDir, plan_run_dir, save_config, write_text_atomically
from msjax.run_lock import RunDirLock
from msjax.train import main as train_main

ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
SHORT = [*QUICK_RUN, *ONE_DEVICE, "train.steps=2", "train.eval_every=0"]


def tree(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every path under root (links not followed) with its size, mtime and, for files, bytes."""
    found = {}
    for path in sorted(root.rglob("*")):
        status = path.lstat()
        content = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
        found[str(path.relative_to(root))] = (status.st_size, status.st_mtime_ns, content)
    return found


def one_line_exit_2(capsys: pytest.CaptureFixture[str], code: int, *needles: str) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


# ---- a directory is a run only if msjax wrote it -------------------------------------------------


@pytest.mark.parametrize(
    "own_file",
    [
        "services:\n  web:\n    image: nginx\n",  # another tool's config.yaml
        "",  # an empty one
        None,  # an msjax config the user keeps there, which msjax did not save
    ],
    ids=["another_tools_config", "empty", "a_users_msjax_config"],
)
def test_overwrite_refuses_a_config_yaml_msjax_did_not_write_and_leaves_it_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], own_file: str | None
) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    mine = load_config(None, [*SHORT, f"run.dir={folder}"]).to_yaml()
    (folder / "config.yaml").write_text(mine if own_file is None else own_file)
    (folder / "notes.txt").write_text("my notes\n")
    before = tree(tmp_path)
    code = train_main([*SHORT, f"run.dir={folder}", "run.overwrite=true"])
    one_line_exit_2(capsys, code, f"run.dir={folder} holds a config.yaml that msjax did not write")
    assert tree(tmp_path) == before  # nothing moved aside, nothing written


def test_a_job_config_yaml_msjax_did_not_write_is_not_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "job_config.yaml").write_text("jobs:\n  - build\n  - test\n")
    before = tree(tmp_path)
    code = launch_main(["--nprocs", "1", "--", *SHORT, f"run.dir={folder}"])
    one_line_exit_2(capsys, code, f"run.dir={folder} holds a job_config.yaml that is not an msjax")
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    "content, problem",
    [(None, "is a folder, not the file msjax makes there"), (b"run: caf\xe9\n", "is not UTF-8")],
    ids=["a_folder", "latin1"],
)
def test_a_config_yaml_that_is_a_folder_or_not_utf8_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None, problem: str
) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    if content is None:
        (folder / "config.yaml").mkdir()
    else:
        (folder / "config.yaml").write_bytes(content)
    before = tree(tmp_path)
    for command in ("train", "launch"):
        args = [*SHORT, f"run.dir={folder}"]
        code = train_main(args) if command == "train" else launch_main(["--", *args])
        one_line_exit_2(capsys, code, f"run.dir={folder}: its config.yaml {problem}")
        assert tree(tmp_path) == before


# ---- symbolic links are never followed -----------------------------------------------------------


@pytest.mark.parametrize(
    "command, entry",
    [
        ("train", "job.lock"),
        ("train", "metrics.jsonl"),
        ("train", "heartbeats/stacks-rank0.txt"),
        ("train", "config.json"),
        ("launch", "logs"),  # a folder: the worker logs would land in the link's target
    ],
)
def test_a_run_dir_with_a_symlinked_entry_is_refused_and_the_target_is_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, entry: str
) -> None:
    target_dir = tmp_path / "elsewhere"
    target_dir.mkdir()
    target = target_dir / "precious.txt"
    target.write_text("keep me\n")
    run = tmp_path / "run"
    link = run / entry
    link.parent.mkdir(parents=True)
    link.symlink_to(target_dir if entry == "logs" else target)
    before = tree(tmp_path)
    args = [*SHORT, f"run.dir={run}"]
    code = train_main(args) if command == "train" else launch_main(["--nprocs", "1", "--", *args])
    one_line_exit_2(capsys, code, f"run.dir={run}: {entry} is a symbolic link")
    assert tree(tmp_path) == before
    assert target.read_text() == "keep me\n" and sorted(target_dir.iterdir()) == [target]


def test_files_opened_after_the_check_do_not_follow_a_link_planted_later(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A link that appears while the run goes on: the lock is refused, the stacks file, the
    metrics and a worker's log are not opened through it (one warning each), and the target
    keeps its bytes."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    run_dir = RunDir(tmp_path / "run")
    run_dir.heartbeats.mkdir(parents=True)
    run_dir.log(0).parent.mkdir()
    for path in (run_dir.lock, run_dir.metrics, run_dir.stacks(0), run_dir.log(0)):
        path.symlink_to(target)
    with pytest.raises(MsjaxError, match=r"cannot open its lock file job.lock \(a symbolic link\)"):
        RunDirLock(run_dir).acquire()
    heartbeat = Heartbeat(run_dir.path, rank=0, every_s=0.0)
    heartbeat.dump_stacks_on_sigusr1(run_dir.path)
    heartbeat.close()
    metrics = MetricsWriter(run_dir.metrics)
    metrics.write({"step": 0, "loss": 1.0})
    metrics.write({"step": 1, "loss": 1.0})
    metrics.close()
    worker = WorkerProcess(0, [sys.executable, "-c", "print('hello')"], job_env(),
                           run_dir.log(0), attempt=0, echo=None)  # fmt: skip
    assert worker.wait(timeout_s=60)
    worker.close()
    assert target.read_text() == "keep me\n"
    err = capsys.readouterr().err
    for path in (run_dir.metrics, run_dir.stacks(0), run_dir.log(0)):
        assert err.count(f"cannot write {path} ") == 1, err


# ---- temporary files: removed on failure, never "foreign" ----------------------------------------

KILLED_WRITER = """
import sys
from pathlib import Path
from msjax.run_dir import write_text_atomically
write_text_atomically(Path(sys.argv[1]), "x" * 200_000_000)
"""


def test_a_temporary_file_left_by_a_killed_writer_does_not_make_the_run_dir_foreign(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    env = job_env()
    for _ in range(3):  # the writer must be caught between creating and renaming its file
        writer = subprocess.Popen(
            [sys.executable, "-c", KILLED_WRITER, str(run / "config.json")], env=env
        )
        deadline = time.monotonic() + 60
        while not list(run.iterdir()) and time.monotonic() < deadline and writer.poll() is None:
            time.sleep(0.001)
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=60)
        left = [path.name for path in run.iterdir()]
        if left and "config.json" not in left:
            break
        for path in run.iterdir():
            path.unlink()
    assert len(left) == 1 and left[0].startswith(".config.json"), left
    config = resolve_run_dir(load_config(None, [*SHORT, f"run.dir={run}"]))
    plan = plan_run_dir(config)
    assert not plan.continues_run and not plan.set_aside  # a new run there, not a refusal
    save_config(config, RunDir(run))  # what msjax saves is its run, leftovers or not
    assert plan_run_dir(config).continues_run


# ---- a full disk: a small tmpfs, filled for real -------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs mounted for the test (root only), unmounted after it."""
    with mounted_tmpfs(tmp_path / "disk", 16) as mount:
        yield mount


def fill(disk: Path) -> None:
    """Write a filler file until the file system says it is full."""
    chunk = b"\0" * (1 << 16)
    with contextlib.suppress(OSError), (disk / "filler").open("ab", buffering=0) as filler:
        while True:
            filler.write(chunk)
    with pytest.raises(OSError) as full:
        (disk / "probe").write_bytes(chunk)
    assert full.value.errno == errno.ENOSPC
    (disk / "probe").unlink(missing_ok=True)


@contextlib.contextmanager
def kept_full(disk: Path) -> Iterator[None]:
    """Fill the disk, and take back every page a writer frees while the block runs (a cut-back
    append frees one), as the other writers of a shared full disk would."""
    fill(disk)
    stop = threading.Event()

    def top_up() -> None:
        with (disk / "filler").open("ab", buffering=0) as filler:
            while not stop.wait(0.002):
                with contextlib.suppress(OSError):
                    filler.write(b"\0" * 4096)

    keeper = threading.Thread(target=top_up, daemon=True)
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        keeper.join()


def test_a_failed_atomic_write_removes_its_temporary_file_and_is_one_line(
    small_disk: Path,
) -> None:
    (small_disk / "run").mkdir()
    fill(small_disk)
    target = small_disk / "run" / "config.json"
    with pytest.raises(OSError) as failed:
        write_text_atomically(target, "y" * 100_000)
    assert failed.value.errno == errno.ENOSPC
    message = str(failed.value)
    assert "\n" not in message and f"cannot write {target}" in message, message
    assert list((small_disk / "run").iterdir()) == []


LIMITED_WRITER = """
import resource, signal, sys
from pathlib import Path
from msjax.run_dir import write_text_atomically
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    write_text_atomically(Path(sys.argv[1]), "y" * 100_000)
except OSError as error:
    print(error.errno, error, sep="|")
"""


def test_a_write_past_the_file_size_limit_removes_its_temporary_file_and_is_one_line(
    tmp_path: Path,
) -> None:
    """The same without root: RLIMIT_FSIZE (ulimit -f) makes the write fail with EFBIG."""
    target = tmp_path / "run" / "config.json"
    target.parent.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", LIMITED_WRITER, str(target)],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    number, message = done.stdout.rstrip("\n").split("|")
    assert int(number) == errno.EFBIG and f"cannot write {target}" in message, done.stdout
    assert list(target.parent.iterdir()) == []


def worker_env(tmp_path: Path) -> dict[str, str]:
    return job_env(
        MSJAX_CACHE_DIR=str(tmp_path / "cache"),  # the corpus cache is not on the small disk
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES="1",
    )


def warnings_per_file(output: str) -> Counter[str]:
    return Counter(
        line.split("cannot write ", 1)[1].split(" (", 1)[0]
        for line in output.splitlines()
        if "msjax: warning: cannot write " in line
    )


def read_beat(run_dir: RunDir) -> dict:
    """Rank 0's heartbeat, waiting out a read that caught it torn (rewritten in place)."""
    for _ in range(100):
        with contextlib.suppress(OSError, ValueError):
            return json.loads(run_dir.heartbeat(0).read_text())
        time.sleep(0.01)
    return {}


def hit_the_full_disk_and_trained_on(output: str, run_dir: RunDir, step_at_fill: int) -> bool:
    """Whether the worker's metrics and heartbeat writes hit the full disk (a warning each in the
    output) and its heartbeat has since shown a step after step_at_fill."""
    warned = set(warnings_per_file(output))
    if not {str(run_dir.metrics), str(run_dir.heartbeat(0))} <= warned:
        return False
    return read_beat(run_dir).get("step", -1) > step_at_fill


def metrics_lines(run_dir: RunDir) -> int:
    try:
        return run_dir.metrics.read_text().count("\n")
    except OSError:
        return 0


@pytest.mark.slow
def test_training_on_a_disk_that_fills_up_goes_on_and_exits_0(
    small_disk: Path, tmp_path: Path
) -> None:
    """Metrics, rank timing, the flight recorder and the heartbeat drop (or rewrite in place)
    their writes with one warning per file; the run reaches train.steps and exits 0."""
    run_dir = RunDir(small_disk / "run")
    steps = 50  # all but the first on the full disk: dozens of writes of each file to drop
    args = [*QUICK_RUN, *ONE_DEVICE, f"train.steps={steps}", "train.eval_every=0"]
    args += [f"run.dir={run_dir.path}", "checkpoint.enabled=false"]
    args += ["observe.straggler_window_steps=2", "resilience.heartbeat_every_s=0.01"]
    with (tmp_path / "out.txt").open("w+") as out:
        job = subprocess.Popen(
            train_command(None, args),
            env=worker_env(tmp_path),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            # polled often: the disk must fill between two steps
            step_0 = lambda: metrics_lines(run_dir) >= 1 or job.poll() is not None  # noqa: E731
            wait_until(step_0, "step 0", poll_s=0.005)
            job.send_signal(signal.SIGSTOP)  # the disk fills between two steps
            lines_before = metrics_lines(run_dir)
            with kept_full(small_disk):
                job.send_signal(signal.SIGCONT)
                code = job.wait(timeout=600)
        finally:
            job.kill()
        out.seek(0)
        output = out.read()
    assert code == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert f"step {steps}/{steps}" in output  # every step ran
    warned = warnings_per_file(output)
    assert max(warned.values()) == 1, warned  # one warning per file
    assert str(run_dir.metrics) in warned, output[-3000:]
    assert {str(run_dir.ranks), str(run_dir.flight_record(0)), str(run_dir.heartbeat(0))} <= set(
        warned
    ), warned
    records = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    assert lines_before <= len(records) < steps  # the later records were dropped, whole
    assert read_beat(run_dir)["phase"] == "done"  # rewritten in place


@pytest.mark.slow
def test_the_supervisor_on_a_full_disk_records_its_incident_as_it_can_and_keeps_its_exit_code(
    small_disk: Path, tmp_path: Path
) -> None:
    """A worker killed after the disk filled: the supervisor's incident files and goodput are
    dropped with one warning each, and the job ends as any spent restart budget does (exit 4),
    without a traceback; the worker trained on after the disk filled."""
    run_dir = RunDir(small_disk / "run")
    args = [*QUICK_RUN, *ONE_DEVICE, "train.steps=1000000", "train.eval_every=0"]
    args += ["checkpoint.enabled=false"]
    job = LaunchJob.start(
        run_dir.path,
        args,
        devices_per_proc=None,
        launch_flags=["--max-restarts=0"],
        log_path=tmp_path / "out.txt",  # not on the small disk
        env=worker_env(tmp_path),
        new_session=True,
    )
    try:
        stepping = lambda: read_beat(run_dir).get("phase") == "step"  # noqa: E731
        first_steps = lambda: stepping() and read_beat(run_dir)["step"] > 0  # noqa: E731
        wait_until(first_steps, "the first steps", poll_s=0.005)
        with kept_full(small_disk):
            step_at_fill = read_beat(run_dir)["step"]
            job.wait_for(
                lambda: hit_the_full_disk_and_trained_on(job.output, run_dir, step_at_fill),
                "the worker's warnings for its metrics and heartbeat, and a step after them",
            )
            beat = read_beat(run_dir)
            os.kill(beat["pid"], signal.SIGKILL)
            code = job.finish(timeout_s=300).exit_code
    finally:
        with contextlib.suppress(ProcessLookupError):
            job.send_to_group(signal.SIGKILL)
        job.kill()
    output = job.output
    assert code == 4, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert beat["step"] > step_at_fill  # training went on after the disk filled
    warned = warnings_per_file(output)
    assert max(warned.values()) == 1, warned
    written_by_the_worker = {run_dir.metrics, run_dir.heartbeat(0)}
    written_by_the_supervisor = {run_dir.incidents_log, run_dir.goodput}
    assert {str(path) for path in written_by_the_worker | written_by_the_supervisor} <= set(warned)
    assert run_dir.incident(1).is_dir()  # the incident's folder, its files dropped as they came


def test_a_run_record_that_cannot_be_written_is_one_line_and_retryable(
    small_disk: Path, tmp_path: Path
) -> None:
    """The resolved config on a disk already full: one line naming the file, the infrastructure's
    exit 14 (the supervisor's, or the scheduler's, retry), no traceback, no temporary file left;
    a launcher whose own record cannot be written exits 14 alike."""
    run = small_disk / "run"
    run.mkdir()
    fill(small_disk)
    args = [*SHORT, f"run.dir={run}", "resilience.compile_cache=false"]
    done = subprocess.run(
        train_command(None, args),
        env=worker_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == exit_codes.INFRASTRUCTURE, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1].startswith(
        f"msjax.train: [Errno 28] cannot write {RunDir(run).config_json}: No space left"
    ), done.stderr[-3000:]
    assert not [path for path in run.rglob(".*") if "tmp" in path.name]
    launched = subprocess.run(
        launch_command(None, args, devices_per_proc=None),
        env=worker_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert launched.returncode == exit_codes.INFRASTRUCTURE, launched.stderr[-3000:]
    assert "Traceback" not in launched.stderr, launched.stderr[-3000:]
    assert launched.stderr.splitlines()[-1].startswith(
        f"msjax.launch: [Errno 28] cannot write {RunDir(run).job_config}: No space left"
    ), launched.stderr[-3000:]


def test_only_node_0_writes_job_config_yaml(tmp_path: Path) -> None:
    """A launcher of node 1 hands its workers a node-local copy of the job's config and leaves
    the run dir's job_config.yaml to node 0 (here there is no node 0: it never appears)."""
    run_dir = RunDir(tmp_path / "run")
    node_1 = ["--nnodes", "2", "--node-rank", "1", "--coordinator", "127.0.0.1:9"]
    args = [*QUICK_RUN, "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", "train.steps=2"]
    args += [f"run.dir={run_dir.path}", "resilience.checkpoint_deadline_s=2"]
    launcher = subprocess.Popen(
        launch_command(None, args, devices_per_proc=None, launch_flags=node_1),
        env=worker_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert launcher.stdout is not None
        first = launcher.stdout.readline()
        while first.startswith("msjax.launch: warning:"):  # e.g. no job secret on several nodes
            first = launcher.stdout.readline()
        assert "attempt 0" in first, first
        pid = int(first.rsplit("pids ", 1)[1].split()[0])
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        worker_config = Path(command[command.index(b"--config") + 1].decode())
        assert worker_config.parent != run_dir.path and worker_config.is_file()
        assert load_config(worker_config).run.dir == str(run_dir.path)
        assert not run_dir.job_config.exists()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=120) == 143
        assert not worker_config.exists()  # removed with the launcher
        assert not run_dir.job_config.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=60)
