"""Sharding changes where numbers are computed, never which numbers: every mesh trains alike."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np
import pytest
from mesh_runs import small_config, train_losses

from msjax.parallel.mesh import build_mesh
from msjax.parallel.rules import logical_axis_rules, logical_to_spec
from msjax.resolve import resolve
from msjax.step import build_program


@pytest.fixture(scope="module")
def single_device_losses() -> list[float]:
    return train_losses(small_config(1, 1, 1))


# (data, fsdp, tensor, sequence_parallel); sequence parallelism only means something when
# tensor > 1, so it is paired with each mesh that has a tensor axis.
MESHES = [
    (8, 1, 1, False),
    (2, 2, 2, False),
    (2, 2, 2, True),
    (1, 2, 4, False),
    (1, 2, 4, True),
    (1, 1, 8, False),
    (1, 1, 8, True),
]


def mesh_id(mesh: tuple[int, int, int, bool]) -> str:
    return "x".join(map(str, mesh[:3])) + ("-seqpar" if mesh[3] else "")


@pytest.mark.parametrize("mesh", MESHES, ids=mesh_id)
def test_sharded_training_matches_single_device(
    single_device_losses: list[float], mesh: tuple[int, int, int, bool]
):
    losses = train_losses(small_config(*mesh[:3], sequence_parallel=mesh[3]))
    np.testing.assert_allclose(losses, single_device_losses, rtol=1e-5)


def test_single_device_losses_fall_step_after_step(single_device_losses: list[float]):
    # Guards the comparison above: a frozen model would match on every mesh too.
    assert all(b < a for a, b in itertools.pairwise(single_device_losses[1:]))
    assert single_device_losses[-1] < single_device_losses[0] - 0.1


def test_parameters_and_optimizer_state_are_born_sharded():
    config = resolve(small_config(2, 2, 2), 8, jax.default_backend())
    mesh = build_mesh(config.mesh, jax.devices()[:8])
    program = build_program(config, mesh)
    state = program.init_state()
    gate = state.params["layers"]["mlp"]["gate"]  # [layers, embed, mlp] over (-, fsdp, tensor)
    assert gate.shape == (2, 64, 128)
    assert {shard.data.shape for shard in gate.addressable_shards} == {(2, 32, 64)}
    adam_moments = [
        leaf
        for leaf in jax.tree.leaves(state.opt_state)
        if getattr(leaf, "shape", None) == gate.shape
    ]
    assert adam_moments, "the optimizer keeps per-parameter moments"
    for moment in adam_moments:
        assert moment.sharding == gate.sharding
    embedding = state.params["embedding"]  # [vocab, embed] over (tensor, fsdp)
    assert {shard.data.shape for shard in embedding.addressable_shards} == {(132, 32)}


def test_rules_map_logical_axes_to_mesh_axes():
    config = small_config(2, 2, 2)
    rules = logical_axis_rules(config)
    spec = logical_to_spec(("layers", "embed", "mlp"), rules)
    assert tuple(spec) == (None, "fsdp", "tensor")
    assert tuple(logical_to_spec(("batch", "residual_seq", "act_embed"), rules)) == (
        ("data", "fsdp"),
        None,
        None,
    )
    sequence_parallel = logical_axis_rules(small_config(2, 2, 2, sequence_parallel=True))
    assert sequence_parallel["residual_seq"] == "tensor"


def test_kv_heads_stay_whole_when_tensor_does_not_divide_them():
    config = small_config(1, 1, 8)
    assert config.model.num_kv_heads == 4
    assert logical_axis_rules(config)["kv_heads"] is None
    divisible = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, tensor=2))
    assert logical_axis_rules(divisible)["kv_heads"] == "tensor"
