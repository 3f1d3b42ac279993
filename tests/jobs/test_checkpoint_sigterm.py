"""Checkpoints under SIGTERM mid-training (a real `python -m msjax.train` process), and that
checkpoint restored by a real two-process `jax.distributed` job (tests/multiprocess_restore.py)."""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from checkpoint_fault_helpers import (
    COMMIT_MARKER,
    NO_PERIODIC_SAVES,
    SMALL_RUN,
    records_so_far,
    step_records,
    steps_after_last_resume,
    stopped_step,
)
from checkpoint_fault_helpers import start_run as start_run  # a fixture, re-exported for pytest
from harness import REPO, Job, free_port, job_env, kill_all

from msjax.observe.metrics import read_metrics

pytestmark = pytest.mark.slow

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

    first.wait_for(lambda: len(records_so_far(run_dir)) >= 5, "5 step records")
    first_exit_code = first.stop(signal.SIGTERM).exit_code
    stopped_at = stopped_step(first.output)

    # B only has to get a few steps past where the rerun will stop; pause it there so that it
    # does not take the CPUs from the rerun
    reference_steps = stopped_at + 8
    straight.wait_for(
        lambda: len(records_so_far(straight_dir)) >= reference_steps, "the reference steps"
    )
    straight.send(signal.SIGSTOP)

    resumed = start_run(run_dir, overrides)
    resumed.wait_for(
        lambda: len(steps_after_last_resume(records_so_far(run_dir))) >= 3, "3 resumed steps"
    )
    resumed_exit_code = resumed.stop(signal.SIGTERM).exit_code
    resumed_stopped_at = stopped_step(resumed.output)

    straight.send(signal.SIGCONT)
    straight.wait_for(
        lambda: len(records_so_far(straight_dir)) >= resumed_stopped_at, "the reference steps"
    )
    straight.kill()
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
    checkpoints = sigterm_runs.run_dir / "checkpoints"
    step = sigterm_runs.stopped_at
    out = tmp_path_factory.mktemp("two_processes")
    command = [
        sys.executable,
        str(REPO / "tests" / "multiprocess_restore.py"),
        "--num-processes=2",
        "--local-devices=4",
        f"--port={free_port()}",
        f"--checkpoints={checkpoints}",
        f"--step={step}",
        *(f"--mesh={mesh}" for mesh in TWO_PROCESS_MESHES),
        f"--out={out}",
        f"--save-to={out / 'checkpoints'}",
    ]
    env = job_env(JAX_NUM_CPU_DEVICES="4")
    processes = [
        Job([*command, f"--process-id={i}"], out, out / f"process{i}.log", env) for i in range(2)
    ]
    try:
        ended = [process.finish() for process in processes]
    finally:
        kill_all(processes)
    log_text = "\n".join(f"--- {p.log_path.name}\n{p.output}" for p in processes)
    assert [process.exit_code for process in ended] == [0, 0], log_text

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
        # mesh axes data, fsdp, expert (1), pipe (1), tensor
        assert seen["meshes"]["1,2,4"]["mesh_process_ids"] == [[[[[0] * 4]], [[[1] * 4]]]]
        assert (
            seen["meshes"]["4,1,2"]["mesh_process_ids"] == [[[[[0, 0]]]]] * 2 + [[[[[1, 1]]]]] * 2
        )
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
