"""A non-finite update is never applied nor saved: the step keeps the state, the run rolls back
past that step, and every checkpoint holds finite values only."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from harness import launch_command, run_to_end

from msjax.checkpoint.manager import Checkpointer, committed_steps
from msjax.config import CheckpointConfig, load_config
from msjax.parallel.mesh import build_mesh
from msjax.resilience.skips import read_skipped_steps
from msjax.resolve import resolve
from msjax.step import build_program
from tests.small_runs import QUICK_RUN

MESH = ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"]  # the vocabulary split over tensor


def batch_of(config, step: int) -> dict[str, np.ndarray]:
    from msjax.data.dataset import build_training_data

    return build_training_data(config, lambda line: None).train.global_batch_at(step)


def test_a_step_whose_gradients_are_nan_keeps_the_state_and_says_so():
    config = load_config(None, [*QUICK_RUN, *MESH, "train.steps=4"])
    config = resolve(config, 4, jax.default_backend())
    program = build_program(config, build_mesh(config.mesh, jax.devices()[:4]))
    state = program.init_state()
    before = jax.device_get(state)
    poisoned = batch_of(config, 0)
    poisoned["inputs"] = poisoned["inputs"].copy()
    poisoned["inputs"][0, 0] = config.model.vocab_size  # past the table: a NaN embedding
    state, metrics = program.train_step(state, jax.device_put(poisoned, program.batch_sharding))
    metrics = jax.device_get(metrics)
    assert not bool(metrics["update_finite"])
    assert not np.isfinite(metrics["grad_norm"])  # the gradients themselves are not finite
    after = jax.device_get(state)
    assert int(after.step) == 1  # counted as a skipped step: the schedule moves on
    for old, new in zip(
        jax.tree.leaves((before.params, before.opt_state)),
        jax.tree.leaves((after.params, after.opt_state)),
        strict=True,
    ):
        if np.ndim(old) > 0:  # moments and parameters as they were; counters move on
            np.testing.assert_array_equal(old, new)

    state, metrics = program.train_step(
        state, jax.device_put(batch_of(config, 1), program.batch_sharding)
    )
    assert bool(jax.device_get(metrics["update_finite"]))
    changed = jax.device_get(state.params)
    assert any(
        not np.array_equal(old, new)
        for old, new in zip(jax.tree.leaves(before.params), jax.tree.leaves(changed), strict=True)
    )


def saved_arrays(checkpoints: Path, step: int) -> list[np.ndarray]:
    checkpointer = Checkpointer(checkpoints, CheckpointConfig(), read_only=True)
    try:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
            checkpointer.array_metadata(step),
        )
        return [
            np.asarray(leaf) for leaf in jax.tree.leaves(checkpointer.restore(step, abstract).state)
        ]
    finally:
        checkpointer.close()


def test_an_injected_nan_gradient_rolls_back_and_no_checkpoint_holds_a_nonfinite_value(tmp_path):
    run_dir = tmp_path / "run"
    bad_step = 4
    overrides = [
        *QUICK_RUN, *MESH, "train.steps=8", "train.eval_every=0", "checkpoint.every_steps=2",
        "checkpoint.max_to_keep=10", "resilience.restart_backoff_s=0.1",
    ]  # fmt: skip
    flags = [f"--fault=bad_token@step={bad_step},rank=0"]
    done = run_to_end(launch_command(run_dir, overrides, devices_per_proc=4, launch_flags=flags))
    assert done.returncode == 0, done.stderr[-4000:]
    output = done.stdout + done.stderr
    assert "the loss of step 4 is nan" in output  # the NaN is computed, not read back so
    assert read_skipped_steps(run_dir) == {bad_step}
    steps = committed_steps(run_dir / "checkpoints")
    assert steps == [2, 4, 6, 8]
    for step in steps:
        assert all(
            np.isfinite(array).all() for array in saved_arrays(run_dir / "checkpoints", step)
        )
