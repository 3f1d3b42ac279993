"""Gradient accumulation (`train.grad_accum_steps`): the global batch as K microbatches in one
compiled step gives the loss, gradients and update of one pass over it, on every mesh."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from mesh_runs import fixed_batches, small_config

from msjax.config import Config, load_config
from msjax.observe.metrics import read_metrics
from msjax.parallel.mesh import build_mesh
from msjax.planner.aot import compile_step
from msjax.planner.candidates import parse_mesh
from msjax.planner.planning import estimate_memory
from msjax.resolve import resolve
from msjax.step import TrainProgram, build_program
from msjax.train import train as train_run
from tests.small_runs import QUICK_RUN

GLOBAL_BATCH = 32  # 4 rows per replica on fsdp 8, so K = 4 fits every mesh below


STEPS = 3


TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


# name: (small_config's mesh arguments, pipeline section)
MESHES: dict[str, tuple[dict[str, int], dict[str, Any] | None]] = {
    "data2-fsdp2-tensor2": ({"data": 2, "fsdp": 2, "tensor": 2}, None),
    "fsdp8": ({"data": 1, "fsdp": 8, "tensor": 1}, None),
    "data2-pipe2-tensor2-gpipe-m2": (
        {"data": 2, "fsdp": 1, "tensor": 2, "pipe": 2},
        {"microbatches": 2},
    ),
    "data2-pipe2-tensor2-1f1b-m2": (
        {"data": 2, "fsdp": 1, "tensor": 2, "pipe": 2},
        {"schedule": "1f1b", "microbatches": 2},
    ),
}


def accumulating_config(mesh: str, accum_steps: int) -> Config:
    sizes, pipeline = MESHES[mesh]
    config = small_config(**sizes, pipeline=pipeline)
    train = dataclasses.replace(
        config.train, global_batch=GLOBAL_BATCH, grad_accum_steps=accum_steps
    )
    config = dataclasses.replace(config, train=train)
    return resolve(config, math.prod(config.mesh.axis_sizes().values()), jax.default_backend())


@functools.cache
def program_of(mesh: str, accum_steps: int) -> TrainProgram:
    """The compiled program of one mesh and K (each built once per test session)."""
    config = accumulating_config(mesh, accum_steps)
    device_count = math.prod(config.mesh.axis_sizes().values())
    return build_program(config, build_mesh(config.mesh, jax.devices()[:device_count]))


def train(program: TrainProgram, batches: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """Per-step loss and gradient norm, then the final state in canonical layer order (numpy)."""
    state = program.init_state()
    metrics = []
    for batch in batches:
        state, step_metrics = program.train_step(
            state, jax.device_put(batch, program.batch_sharding)
        )
        metrics.append(step_metrics)
    state = jax.tree.map(np.asarray, program.to_canonical(state))
    return {
        "loss": np.array([float(m["loss"]) for m in metrics]),
        "grad_norm": np.array([float(m["grad_norm"]) for m in metrics]),
        "params": state.params,
        "opt_state": state.opt_state,  # Adam's first moment holds the gradients themselves
    }


@functools.cache
def trained(mesh: str, accum_steps: int) -> dict[str, Any]:
    program = program_of(mesh, accum_steps)
    return train(program, fixed_batches(program.config)[:STEPS])


def assert_same_training(result: dict[str, Any], expected: dict[str, Any]) -> None:
    np.testing.assert_allclose(result["loss"], expected["loss"], **TOLERANCE)
    np.testing.assert_allclose(result["grad_norm"], expected["grad_norm"], **TOLERANCE)
    for key in ("params", "opt_state"):
        for got, want in zip(
            jax.tree.leaves(result[key]), jax.tree.leaves(expected[key]), strict=True
        ):
            np.testing.assert_allclose(got, want, **TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("accum_steps", [2, 4])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_accumulated_step_equals_the_plain_step(mesh: str, accum_steps: int):
    plain = trained(mesh, 1)
    assert plain["loss"][-1] < plain["loss"][0] - 0.05  # the model learns: not a frozen match
    assert_same_training(trained(mesh, accum_steps), plain)


def padded_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Even rows (K = 2's first microbatch) keep 3 to 10 real tokens, all predicting a space;
    odd rows stay whole: the microbatches differ in token count and in mean loss."""
    padded = {key: value.copy() for key, value in batch.items()}
    for row in range(0, len(padded["segment_ids"]), 2):
        real = 3 + row % 8
        padded["targets"][row, :real] = ord(" ")
        padded["segment_ids"][row, real:] = 0
    return padded


def only_rows(batch: dict[str, np.ndarray], first: int) -> dict[str, np.ndarray]:
    """The batch with every row but first, first + 2, ... turned into padding."""
    masked = {key: value.copy() for key, value in batch.items()}
    masked["segment_ids"][[row for row in range(len(batch["segment_ids"])) if row % 2 != first]] = 0
    return masked


@pytest.mark.slow
def test_a_padded_batch_is_weighted_by_its_real_tokens_across_microbatches():
    mesh = "data2-fsdp2-tensor2"
    plain_program = program_of(mesh, 1)
    batches = fixed_batches(plain_program.config)[:STEPS]
    padded = [*batches[:-1], padded_batch(batches[-1])]
    plain = train(plain_program, padded)
    assert_same_training(train(program_of(mesh, 2), padded), plain)
    # Averaging the two microbatches' own means would weigh a short row's token as much as
    # several of a whole row's: a different loss, beyond the tolerance above.
    microbatch_means = [
        train(plain_program, [*batches[:-1], only_rows(padded[-1], first)])["loss"][-1]
        for first in (0, 1)
    ]
    assert abs(np.mean(microbatch_means) - plain["loss"][-1]) > 1e-2


@pytest.mark.slow
def test_the_planner_counts_one_microbatch_and_a_gradient_accumulator_as_xla_does():
    mesh = parse_mesh("2,2,2")
    model, xla = {}, {}
    for accum_steps in (1, 2):
        config = load_config(
            "configs/tiny.yaml", ["train.global_batch=16", f"train.grad_accum_steps={accum_steps}"]
        )
        model[accum_steps] = estimate_memory(config, mesh, platform="cpu")
        xla[accum_steps] = compile_step(config, mesh).memory.total_bytes
        assert model[accum_steps].total_bytes / xla[accum_steps] == pytest.approx(1.0, abs=0.10)
    # the saving, activations of half the batch less a float32 gradient accumulator, as XLA's
    saved = model[1].total_bytes - model[2].total_bytes
    assert saved / (xla[1] - xla[2]) == pytest.approx(1.0, abs=0.10)
    assert model[2].gradients_bytes == 2 * model[1].gradients_bytes
    assert model[2].batch_bytes == model[1].batch_bytes  # the whole batch is still an input


@pytest.mark.slow
def test_a_run_resumed_with_more_microbatches_trains_as_the_uninterrupted_run(tmp_path: Path):
    # what a shrunk mesh does to keep the global batch: the same run, from its checkpoint, in two
    # passes per step (tiny's mesh: 8 / (data 2 x fsdp 2) = 2 rows per replica)
    run = [*QUICK_RUN, "train.eval_every=0", "checkpoint.every_steps=2", "optim.schedule=constant"]

    def losses(run_dir: Path, *overrides: str) -> list[tuple[int, float]]:
        """(step, loss) of every step the run dir's attempts trained, in order."""
        config = load_config(None, [*run, f"run.dir={run_dir}", *overrides])
        train_run(config, progress_stream=open(os.devnull, "w"))  # noqa: SIM115
        records = read_metrics(run_dir / "metrics.jsonl")
        return [(record["step"], record["loss"]) for record in records if "loss" in record]

    uninterrupted = losses(tmp_path / "whole", "train.steps=4")
    losses(tmp_path / "resumed", "train.steps=2")
    resumed = losses(tmp_path / "resumed", "train.steps=4", "train.grad_accum_steps=2")
    assert [step for step, _ in resumed] == [0, 1, 2, 3]  # went on from step 2's checkpoint
    np.testing.assert_allclose(
        [loss for _, loss in resumed], [loss for _, loss in uninterrupted], **TOLERANCE
    )
