"""Checkpoints under real faults: SIGTERM mid-training, SIGKILL mid-save, another process count.

Every run here is a real `python -m msjax.train` process (or a real two-process `jax.distributed`
job, tests/multiprocess_restore.py) that the test signals or kills while it works.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from msjax.observe.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
SMALL_RUN = [
    "train.steps=400",  # far more than any test lets run: every run here is stopped or shortened
    "train.global_batch=16",
    "data.seq_len=64",
    "data.max_corpus_mib=2",
    "train.eval_every=0",
    "train.peak_tflops=0.5",
]
NO_PERIODIC_SAVES = ["checkpoint.every_steps=1000"]
SAVE_EVERY_STEP = ["checkpoint.every_steps=1"]
START_TIMEOUT_S = 240  # start-up and compilation, on a busy 2-core machine
POLL_S = 0.01
TMP_MARKER = "orbax-checkpoint-tmp"
COMMIT_MARKER = "_CHECKPOINT_METADATA"

pytestmark = pytest.mark.slow


class TrainProcess:
    """One `python -m msjax.train` child; stdout and stderr go to a log file."""

    def __init__(self, run_dir: Path, overrides: list[str], log_path: Path):
        self.run_dir = run_dir
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        env.setdefault("JAX_NUM_CPU_DEVICES", "8")
        with log_path.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "msjax.train", *overrides, f"run.dir={run_dir}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=run_dir.parent,
            )

    @property
    def output(self) -> str:
        return self.log_path.read_text()

    def wait_until(self, condition: Callable[[], bool], what: str) -> None:
        """Poll until condition() holds; fail with the log if the run ends or takes too long."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not condition():
            if self.process.poll() is not None:
                pytest.fail(
                    f"the run ended (exit {self.process.returncode}) before {what}:\n{self.output}"
                )
            if time.monotonic() > deadline:
                self.process.kill()
                pytest.fail(f"no {what} within {START_TIMEOUT_S} s:\n{self.output}")
            time.sleep(POLL_S)

    def stop(self, signum: int) -> int:
        """Send signum and wait for the exit code."""
        self.process.send_signal(signum)
        return self.finish()

    def finish(self) -> int:
        try:
            return self.process.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            pytest.fail(f"the run did not end within {START_TIMEOUT_S} s:\n{self.output}")

    def kill_if_running(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def start_run() -> Iterator[Callable[[Path, list[str]], TrainProcess]]:
    """Starts training runs; kills any still running when the module's tests are done."""
    started: list[TrainProcess] = []

    def start(run_dir: Path, overrides: list[str]) -> TrainProcess:
        log_path = run_dir.parent / f"{run_dir.name}-{len(started)}.log"
        started.append(TrainProcess(run_dir, overrides, log_path))
        return started[-1]

    yield start
    for run in started:
        run.kill_if_running()


def records_so_far(run_dir: Path) -> list[dict[str, Any]]:
    """The complete lines of metrics.jsonl while a run may be writing it."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


def steps_after_last_resume(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Step records after the last resume event (none while no run has resumed yet)."""
    resumes = [i for i, record in enumerate(records) if record.get("event") == "resume"]
    if not resumes:
        return []
    return [record for record in records[resumes[-1] + 1 :] if "loss" in record]


def step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [record for record in records if "loss" in record]


def committed_on_disk(checkpoints: Path) -> list[int]:
    """Steps whose final directory exists with Orbax's metadata file in it."""
    if not checkpoints.is_dir():
        return []
    return sorted(
        int(entry.name)
        for entry in checkpoints.iterdir()
        if entry.name.isdigit() and (entry / COMMIT_MARKER).exists()
    )


def unfinished_on_disk(checkpoints: Path) -> list[str]:
    """Step entries a save started and never finalized: Orbax's tmp dirs, or no metadata file."""
    if not checkpoints.is_dir():
        return []
    return sorted(
        entry.name
        for entry in checkpoints.iterdir()
        if entry.name.split(".")[0].isdigit()
        and (TMP_MARKER in entry.name or not (entry / COMMIT_MARKER).exists())
    )


def stopped_step(output: str) -> int:
    match = re.search(r"stopped by SIGTERM after step (\d+)", output)
    assert match, output
    return int(match.group(1))


# --- SIGTERM during training -------------------------------------------------------------------


@dataclass(frozen=True)
class SigtermRuns:
    run_dir: Path
    first_exit_code: int
    first_output: str
    stopped_at: int  # N: the step the first run saved when SIGTERM came
    resumed_exit_code: int
    resumed_output: str
    resumed_stopped_at: int  # M: the rerun was stopped by SIGTERM too
    records: list[dict[str, Any]]  # metrics.jsonl of the interrupted run, both parts
    straight_records: list[dict[str, Any]]  # the same config, never interrupted


@pytest.fixture(scope="module")
def sigterm_runs(tmp_path_factory: pytest.TempPathFactory, start_run) -> SigtermRuns:
    """Run A is stopped by SIGTERM after >= 5 steps and rerun (and stopped again 3 steps later);
    run B, the same config, trains straight through alongside as the reference."""
    base = tmp_path_factory.mktemp("sigterm")
    run_dir, straight_dir = base / "interrupted", base / "straight"
    overrides = [*SMALL_RUN, *NO_PERIODIC_SAVES]
    first = start_run(run_dir, overrides)
    straight = start_run(straight_dir, overrides)

    first.wait_until(lambda: len(records_so_far(run_dir)) >= 5, "5 step records")
    first_exit_code = first.stop(signal.SIGTERM)
    stopped_at = stopped_step(first.output)

    # B only has to get a few steps past where the rerun will stop; pause it there so that it
    # does not take the CPUs from the rerun
    reference_steps = stopped_at + 8
    straight.wait_until(
        lambda: len(records_so_far(straight_dir)) >= reference_steps, "the reference steps"
    )
    straight.process.send_signal(signal.SIGSTOP)

    resumed = start_run(run_dir, overrides)
    resumed.wait_until(
        lambda: len(steps_after_last_resume(records_so_far(run_dir))) >= 3, "3 resumed steps"
    )
    resumed_exit_code = resumed.stop(signal.SIGTERM)
    resumed_stopped_at = stopped_step(resumed.output)

    straight.process.send_signal(signal.SIGCONT)
    straight.wait_until(
        lambda: len(records_so_far(straight_dir)) >= resumed_stopped_at, "the reference steps"
    )
    straight.kill_if_running()
    return SigtermRuns(
        run_dir=run_dir,
        first_exit_code=first_exit_code,
        first_output=first.output,
        stopped_at=stopped_at,
        resumed_exit_code=resumed_exit_code,
        resumed_output=resumed.output,
        resumed_stopped_at=resumed_stopped_at,
        records=read_metrics(run_dir / "metrics.jsonl"),
        straight_records=read_metrics(straight_dir / "metrics.jsonl"),
    )


def test_sigterm_finishes_the_current_step_saves_it_and_exits_zero(sigterm_runs):
    runs = sigterm_runs
    step = runs.stopped_at
    assert runs.first_exit_code == 0, runs.first_output
    assert step >= 5
    checkpoint = runs.run_dir / "checkpoints" / str(step)
    assert f"stopped by SIGTERM after step {step}; checkpoint in {checkpoint}" in runs.first_output
    assert (checkpoint / COMMIT_MARKER).exists()
    events = [i for i, record in enumerate(runs.records) if "event" in record]
    first_part = runs.records[: events[0]] if events else runs.records
    assert [record["step"] for record in first_part if "loss" in record] == list(range(step))


def test_rerun_after_sigterm_resumes_at_the_saved_step(sigterm_runs):
    runs = sigterm_runs
    step = runs.stopped_at
    checkpoint = runs.run_dir / "checkpoints" / str(step)
    assert f"resumed from {checkpoint} (step {step})" in runs.resumed_output
    resume_events = [record for record in runs.records if record.get("event") == "resume"]
    assert resume_events == [{"step": step, "event": "resume", "checkpoint": str(checkpoint)}]
    resumed_steps = [record["step"] for record in steps_after_last_resume(runs.records)]
    assert resumed_steps == list(range(step, runs.resumed_stopped_at))
    assert runs.resumed_exit_code == 0, runs.resumed_output


def test_losses_across_a_sigterm_and_resume_equal_an_uninterrupted_run(sigterm_runs):
    runs = sigterm_runs
    interrupted = step_records(runs.records)
    straight = step_records(runs.straight_records)[: len(interrupted)]
    assert [record["step"] for record in interrupted] == list(range(runs.resumed_stopped_at))
    assert [record["step"] for record in straight] == list(range(runs.resumed_stopped_at))
    for key in ("loss", "grad_norm", "lr"):
        np.testing.assert_allclose(
            [record[key] for record in interrupted],
            [record[key] for record in straight],
            rtol=1e-6,
            err_msg=key,
        )


# --- SIGKILL during an asynchronous save --------------------------------------------------------


@dataclass(frozen=True)
class KilledRound:
    """What one SIGKILL left on disk, and what the next run of the command printed."""

    newest_committed: int
    unfinished: list[str]
    next_output: str


@dataclass(frozen=True)
class KilledRuns:
    checkpoints: Path
    rounds: list[KilledRound]
    final_exit_code: int
    final_steps: int
    records: list[dict[str, Any]]


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory: pytest.TempPathFactory, start_run) -> KilledRuns:
    """A run saving every step, SIGKILLed twice: once while a save is being written (an Orbax
    tmp dir already holds _CHECKPOINT_METADATA), once just after a save was finalized; then
    run to the end."""
    run_dir = tmp_path_factory.mktemp("sigkill") / "run"
    checkpoints = run_dir / "checkpoints"
    overrides = [*SMALL_RUN, *SAVE_EVERY_STEP]

    def newest() -> int:
        return max(committed_on_disk(checkpoints), default=-1)

    def save_under_way() -> bool:
        # Orbax writes _CHECKPOINT_METADATA into its tmp dir first, then the arrays, then renames
        return any(
            TMP_MARKER in entry.name and (entry / COMMIT_MARKER).exists()
            for entry in checkpoints.iterdir()
        )

    run = start_run(run_dir, overrides)
    run.wait_until(lambda: newest() >= 4 and save_under_way(), "4 saves and one under way")
    run.stop(signal.SIGKILL)
    after_kill = [(newest(), unfinished_on_disk(checkpoints))]

    run = start_run(run_dir, overrides)
    resumed_at = after_kill[0][0]
    run.wait_until(lambda: newest() >= resumed_at + 2, "2 saves after resuming")
    run.stop(signal.SIGKILL)
    outputs = [run.output]
    after_kill.append((newest(), unfinished_on_disk(checkpoints)))

    final_steps = after_kill[1][0] + 2
    run = start_run(run_dir, [*overrides, f"train.steps={final_steps}"])
    final_exit_code = run.finish()
    outputs.append(run.output)
    return KilledRuns(
        checkpoints=checkpoints,
        rounds=[
            KilledRound(step, unfinished, output)
            for (step, unfinished), output in zip(after_kill, outputs, strict=True)
        ],
        final_exit_code=final_exit_code,
        final_steps=final_steps,
        records=read_metrics(run_dir / "metrics.jsonl"),
    )


def test_rerun_after_sigkill_resumes_from_the_newest_committed_step(killed_runs):
    assert killed_runs.rounds[0].newest_committed >= 4
    for round_ in killed_runs.rounds:
        step = round_.newest_committed
        checkpoint = killed_runs.checkpoints / str(step)
        assert f"resumed from {checkpoint} (step {step})" in round_.next_output


def test_rerun_after_sigkill_mid_save_warns_about_each_unfinished_step(killed_runs):
    # the first kill waited for a save in flight, so it almost surely left one behind
    assert any(round_.unfinished for round_ in killed_runs.rounds)
    for round_ in killed_runs.rounds:
        for name in round_.unfinished:
            assert f"skipped checkpoint {killed_runs.checkpoints / name}" in round_.next_output, (
                f"{name} was left unfinished by SIGKILL, but the rerun did not say it skipped "
                f"it:\n{round_.next_output}"
            )


def test_run_killed_twice_mid_save_still_finishes_with_every_step_trained_and_saved(killed_runs):
    runs = killed_runs
    output = runs.rounds[-1].next_output
    assert runs.final_exit_code == 0, output
    assert "checkpoint save at step" not in output
    assert runs.final_steps in committed_on_disk(runs.checkpoints)
    resumed_from = runs.rounds[-1].newest_committed
    final_part = [record["step"] for record in steps_after_last_resume(runs.records)]
    assert final_part == list(range(resumed_from, runs.final_steps))


# --- restore in another number of processes -----------------------------------------------------

TWO_PROCESS_MESHES = ("1,2,4", "4,1,2")  # data,fsdp,tensor over 2 processes x 4 devices


def restore_in_this_process(checkpoints: Path, step: int) -> tuple[dict[str, np.ndarray], dict]:
    """Parameters as numpy (restored onto this process's 8 devices, mesh 2,2,2) and the meta."""
    import dataclasses

    import jax

    from msjax.checkpoint.fingerprint import leaf_name
    from msjax.checkpoint.manager import Checkpointer
    from msjax.config import CheckpointConfig, config_from_dict
    from msjax.parallel.mesh import build_mesh
    from msjax.resolve import check_device_count
    from msjax.step import build_program

    reader = Checkpointer(checkpoints, CheckpointConfig(), read_only=True)
    saved = config_from_dict(reader.metadata(step)["config"])
    mesh = dataclasses.replace(saved.mesh, data=2, fsdp=2, tensor=2)
    config = check_device_count(dataclasses.replace(saved, mesh=mesh), jax.device_count())
    program = build_program(config, build_mesh(config.mesh))
    restored = reader.restore(step, program.abstract_state())
    reader.close()
    params = jax.tree_util.tree_flatten_with_path(restored.state.params)[0]
    return {leaf_name(path): np.asarray(leaf) for path, leaf in params}, restored.meta


@dataclass(frozen=True)
class TwoProcessRestore:
    step: int
    saved_meta: dict[str, Any]
    saved_params: dict[str, np.ndarray]  # restored in this (the pytest) process
    seen: list[dict[str, Any]]  # per process: tests/multiprocess_restore.py's report
    gathered: dict[tuple[str, int], dict[str, np.ndarray]]  # (mesh, process) -> params
    resaved: Path  # the checkpoints dir the two processes saved into


@pytest.fixture(scope="module")
def two_process_restore(sigterm_runs, tmp_path_factory) -> TwoProcessRestore:
    """The 1-process, 8-device checkpoint of the SIGTERM run restored by a 2-process job."""
    import portpicker

    checkpoints = sigterm_runs.run_dir / "checkpoints"
    step = sigterm_runs.stopped_at
    out = tmp_path_factory.mktemp("two_processes")
    port = portpicker.pick_unused_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_NUM_CPU_DEVICES": "4"}
    command = [
        sys.executable,
        str(REPO / "tests" / "multiprocess_restore.py"),
        "--num-processes=2",
        "--local-devices=4",
        f"--port={port}",
        f"--checkpoints={checkpoints}",
        f"--step={step}",
        *(f"--mesh={mesh}" for mesh in TWO_PROCESS_MESHES),
        f"--out={out}",
        f"--save-to={out / 'checkpoints'}",
    ]
    logs = [out / f"process{i}.log" for i in range(2)]
    processes = []
    for i, log_path in enumerate(logs):
        with log_path.open("w") as log:
            processes.append(
                subprocess.Popen(
                    [*command, f"--process-id={i}"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=out,
                )
            )
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        for process in processes:
            process.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    log_text = "\n".join(f"--- {path.name}\n{path.read_text()}" for path in logs)
    assert [process.returncode for process in processes] == [0, 0], log_text

    saved_params, saved_meta = restore_in_this_process(checkpoints, step)
    gathered = {}
    for mesh in TWO_PROCESS_MESHES:
        for i in range(2):
            with np.load(out / f"params-{mesh}-process{i}.npz") as arrays:
                gathered[mesh, i] = dict(arrays)
    return TwoProcessRestore(
        step=step,
        saved_meta=saved_meta,
        saved_params=saved_params,
        seen=[json.loads((out / f"process{i}.json").read_text()) for i in range(2)],
        gathered=gathered,
        resaved=out / "checkpoints",
    )


def test_two_process_job_sees_eight_devices_four_of_them_its_own(two_process_restore):
    for i, seen in enumerate(two_process_restore.seen):
        assert (seen["process_index"], seen["process_count"]) == (i, 2)
        assert (seen["device_count"], seen["local_device_count"]) == (8, 4)


def test_one_process_checkpoint_restores_in_two_processes_with_every_array_unchanged(
    two_process_restore,
):
    restore = two_process_restore
    expected = restore.saved_meta["fingerprints"]
    for seen in restore.seen:
        for mesh in TWO_PROCESS_MESHES:
            assert seen["meshes"][mesh]["restored_step"] == restore.step
            assert seen["meshes"][mesh]["fingerprints"] == expected, mesh


def test_one_process_checkpoint_restores_in_two_processes_with_equal_parameter_values(
    two_process_restore,
):
    restore = two_process_restore
    for (mesh, process), params in restore.gathered.items():
        assert sorted(params) == sorted(restore.saved_params), (mesh, process)
        for name, value in restore.saved_params.items():
            np.testing.assert_array_equal(params[name], value, err_msg=f"{name} {mesh} {process}")


def test_each_process_holds_only_the_shards_of_its_own_devices(two_process_restore):
    for seen in two_process_restore.seen:
        # mesh 1,2,4: the fsdp axis runs across the two processes; mesh 4,1,2: the data axis does,
        # and parameters are not split over data
        assert seen["meshes"]["1,2,4"]["mesh_process_ids"] == [[[0] * 4, [1] * 4]]
        assert seen["meshes"]["4,1,2"]["mesh_process_ids"] == [[[0, 0]]] * 2 + [[[1, 1]]] * 2
        split = seen["meshes"]["1,2,4"]["arrays"]
        replicated = seen["meshes"]["4,1,2"]["arrays"]
        for name, array in split.items():
            assert array["shard_shapes_match"], name
            if "fsdp" in array["spec"]:
                assert 2 * array["local_bytes"] == array["full_bytes"], (name, array)
        for name, array in replicated.items():
            assert array["shard_shapes_match"], name
            if name.startswith("params/"):
                assert array["local_bytes"] == array["full_bytes"], (name, array)
        total = sum(array["full_bytes"] for array in split.values())
        local = sum(array["local_bytes"] for array in split.values())
        assert local < 0.6 * total  # everything but the scalars and the unsplit norms is halved


def test_checkpoint_saved_by_two_processes_restores_in_one_process(two_process_restore):
    restore = two_process_restore
    params, meta = restore_in_this_process(restore.resaved, restore.step)
    assert meta["fingerprints"] == restore.saved_meta["fingerprints"]
    assert meta["config"]["mesh"]["data"] == 4  # saved from the last mesh, 4,1,2
    assert sorted(params) == sorted(restore.saved_params)
    for name, value in restore.saved_params.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)
