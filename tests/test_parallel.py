"""Sharding changes where numbers are computed, never which numbers: every mesh trains alike."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import jax
import numpy as np
import pytest

from msjax.config import Config, config_from_dict
from msjax.data.packing import pack_rows
from msjax.data.tokenizer import ByteTokenizer
from msjax.parallel.mesh import build_mesh
from msjax.parallel.rules import logical_axis_rules, logical_to_spec
from msjax.resolve import resolve
from msjax.step import build_program

STEPS = 5


def small_config(data: int, fsdp: int, tensor: int, sequence_parallel: bool = False) -> Config:
    return config_from_dict(
        {
            "model": {
                "vocab_size": 264,
                "num_layers": 2,
                "embed_dim": 64,
                "num_heads": 8,
                "num_kv_heads": 4,
                "mlp_dim": 128,
            },
            "mesh": {
                "data": data,
                "fsdp": fsdp,
                "tensor": tensor,
                "sequence_parallel": sequence_parallel,
            },
            "data": {"seq_len": 32},
            "optim": {"learning_rate": 1e-2, "warmup_steps": 2},
            "train": {"steps": STEPS, "global_batch": 16},
        }
    )


def fixed_batches(config: Config) -> list[dict[str, np.ndarray]]:
    text = Path(__file__).read_bytes() * 4  # learnable, unlike random tokens
    tokens = ByteTokenizer().encode(text)  # one document, no EOS: one segment per row
    seq_len, rows = config.data.seq_len, config.train.global_batch
    windows = [tokens[i * seq_len : (i + 1) * seq_len + 1] for i in range(STEPS * rows)]
    return [
        pack_rows(windows[step * rows : (step + 1) * rows], seq_len, ByteTokenizer.eos_id, False)
        for step in range(STEPS)
    ]


def train_losses(config: Config) -> list[float]:
    sizes = config.mesh.axis_sizes()
    device_count = sizes["data"] * sizes["fsdp"] * sizes["tensor"]
    config = resolve(config, device_count, jax.default_backend())  # as a run does: impls chosen
    mesh = build_mesh(config.mesh, jax.devices()[:device_count])
    program = build_program(config, mesh)
    state = program.init_state()
    losses = []
    for batch in fixed_batches(config):
        state, metrics = program.train_step(state, jax.device_put(batch, program.batch_sharding))
        losses.append(float(metrics["loss"]))
    return losses


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
