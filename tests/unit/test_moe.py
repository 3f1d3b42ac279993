"""The mixture of experts: router and losses by hand, the grouped block against its dense
reference, capacity drops, bias balancing, and in-process training on one device and a mesh."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from mesh_runs import fixed_batches

from msjax.config import ModelConfig, load_config
from msjax.models.moe import (
    MoeMLP,
    balanced_bias,
    expert_capacity,
    kept_choices,
    route,
)
from msjax.parallel.mesh import build_mesh
from msjax.resolve import resolve, resolve_model
from msjax.step import build_program

SMALL_MOE = {
    "model.embed_dim=16",
    "model.mlp_dim=8",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.moe.num_experts=4",
    "model.init_std=0.5",  # outputs of order 1, so that 1e-5 means something
}


def moe_model_config(*overrides: str) -> ModelConfig:
    return resolve_model(load_config(None, [*sorted(SMALL_MOE), *overrides]).model, "cpu")


def moe_block(*overrides: str) -> MoeMLP:
    with nnx.use_eager_sharding(False):
        return MoeMLP(moe_model_config(*overrides), nnx.Rngs(0))


def test_router_on_equal_logits_gives_uniform_weights_and_the_textbook_losses():
    routing = route(jnp.zeros((6, 4)), k=2, normalize=False)
    np.testing.assert_allclose(routing.weights, 0.25)  # softmax of equal logits, not renormalised
    # P_e = 1/4 for every expert whatever f_e is: 4 * sum_e f_e / 4 = 1
    np.testing.assert_allclose(routing.load_balance_loss, 1.0, rtol=1e-6)
    np.testing.assert_allclose(routing.z_loss, math.log(4) ** 2, rtol=1e-6)  # logsumexp = ln 4
    assert float(routing.tokens_per_expert.sum()) == 12  # 6 tokens x 2 choices


def test_router_top_k_weights_and_losses_match_a_hand_computation():
    logits = jnp.array([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    routing = route(logits, k=2, normalize=True)
    e = math.e
    first = np.array([e**2, e, 1.0]) / (e**2 + e + 1)  # token 0's softmax
    second = np.array([1.0, 1.0, e**3]) / (e**3 + 2)  # token 1's softmax
    np.testing.assert_array_equal(routing.experts[0], [0, 1])
    assert int(routing.experts[1, 0]) == 2
    np.testing.assert_allclose(routing.weights[0], first[:2] / first[:2].sum(), rtol=1e-6)
    np.testing.assert_allclose(routing.weights[1].sum(), 1.0, rtol=1e-6)
    # choices: expert 0 twice or once (token 1's tie), 1, 2: f from the returned counts
    counts = np.asarray(routing.tokens_per_expert)
    assert counts.sum() == 4 and counts[2] == 1
    mean_probs = (first + second) / 2
    np.testing.assert_allclose(
        routing.load_balance_loss, 3 * np.sum(counts / 4 * mean_probs), rtol=1e-6
    )
    lse = [math.log(e**2 + e + 1), math.log(e**3 + 2)]
    np.testing.assert_allclose(routing.z_loss, (lse[0] ** 2 + lse[1] ** 2) / 2, rtol=1e-6)


def test_bias_steers_the_choice_but_not_the_weights():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))
    routing = route(logits, k=1, normalize=False, bias=jnp.array([0.0, 0.0, 0.4]))
    assert int(routing.experts[0, 0]) == 2
    np.testing.assert_allclose(routing.weights[0, 0], 0.2, rtol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "blocks"])
@pytest.mark.parametrize("extra", [(), ("model.moe.shared_experts=1",)])
def test_dropless_block_equals_the_dense_reference_forward_and_gradients(extra, impl):
    block = moe_block("model.moe.experts_per_token=2", f"model.moe.matmul_impl={impl}", *extra)
    x = jax.random.normal(jax.random.key(1), (2, 7, 16))
    graphdef, params = nnx.split(block)

    def loss(params, x, reference):
        module = nnx.merge(graphdef, params)
        out, stats = module.dense_reference(x) if reference else module(x)
        return jnp.sum(out * jnp.cos(x)) + stats.load_balance_loss + stats.z_loss

    out, stats = block(x)
    expected, _ = block.dense_reference(x)
    assert float(jnp.abs(expected).max()) > 0.1  # not trivially small
    np.testing.assert_allclose(out, expected, atol=1e-5)
    assert float(stats.dropped_share) == 0.0
    grads = jax.grad(loss, argnums=(0, 1))(params, x, False)
    reference_grads = jax.grad(loss, argnums=(0, 1))(params, x, True)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(reference_grads), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("impl", ["pallas", "blocks"])
def test_each_grouped_matmul_runs_the_same_block(impl):
    x = jax.random.normal(jax.random.key(2), (1, 9, 16))
    out, _ = moe_block(f"model.moe.matmul_impl={impl}")(x)
    expected, _ = moe_block("model.moe.matmul_impl=xla")(x)
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_capacity_keeps_the_earliest_tokens_of_an_overloaded_expert():
    # 8 tokens, k=1, 4 experts, factor 1: capacity ceil(8 / 4) = 2; six choose expert 0
    assert expert_capacity(1.0, 8, 1, 4) == 2
    assert expert_capacity(0.0, 8, 1, 4) is None
    experts = jnp.array([[0], [0], [1], [0], [0], [2], [0], [0]])
    kept = kept_choices(experts, 4, capacity=2)
    np.testing.assert_array_equal(kept[:, 0], [1, 1, 1, 0, 0, 1, 0, 0])


@pytest.mark.parametrize("impl", ["xla", "blocks"])
def test_capacity_drops_in_the_block_zero_the_dropped_tokens_and_count_them(impl):
    block = moe_block(
        "model.moe.experts_per_token=1",
        "model.moe.capacity_factor=1.0",
        f"model.moe.matmul_impl={impl}",
    )
    # every token prefers expert 0: the router's column 0 follows x's first feature, which is
    # made large and positive
    block.router.weight[...] = jnp.zeros((16, 4)).at[0, 0].set(10.0)
    x = jax.random.normal(jax.random.key(3), (1, 8, 16)).at[:, :, 0].set(1.0)
    out, stats = block(x)
    expected, _ = block.dense_reference(x)
    np.testing.assert_allclose(out, expected, atol=1e-5)
    np.testing.assert_allclose(stats.dropped_share, 6 / 8)  # capacity 2 of 8 on expert 0
    assert float(jnp.abs(out[0, :2]).min()) > 0.0
    np.testing.assert_array_equal(out[0, 2:], 0.0)  # no shared expert: dropped gives zeros


def test_bias_update_moves_toward_the_under_loaded_experts():
    bias = balanced_bias(jnp.zeros(4), jnp.array([10.0, 2.0, 4.0, 0.0]), rate=0.1)
    np.testing.assert_allclose(bias, [-0.1, 0.1, 0.0, 0.1])  # mean 4


def moe_training_config(data: int, fsdp: int, accum_steps: int = 1, **moe):
    """configs/tiny_moe.yaml (1 dense and 3 MoE layers of 8 experts, top-2, 1 shared) on a
    data x fsdp mesh, with a short sequence and batch so that a step takes moments."""
    overrides = [
        f"mesh.data={data}",
        f"mesh.fsdp={fsdp}",
        "mesh.tensor=1",
        "data.seq_len=32",
        "train.global_batch=8",
        f"train.grad_accum_steps={accum_steps}",
        "optim.learning_rate=1e-2",
        "optim.warmup_steps=2",
        *(f"model.moe.{key}={value}" for key, value in moe.items()),
    ]
    config = load_config("configs/tiny_moe.yaml", overrides)
    return resolve(config, data * fsdp, jax.default_backend())


@functools.cache
def trained_moe(data: int, fsdp: int, accum_steps: int = 1, **moe) -> tuple[list[dict], dict]:
    config = moe_training_config(data, fsdp, accum_steps, **moe)
    program = build_program(config, build_mesh(config.mesh, jax.devices()[: data * fsdp]))
    state = program.init_state()
    metrics = []
    for batch in fixed_batches(config)[:3]:
        state, step = program.train_step(state, jax.device_put(batch, program.batch_sharding))
        metrics.append(jax.tree.map(np.asarray, step))
    return metrics, jax.tree.map(np.asarray, state.params)


@pytest.mark.slow  # two compiles of the 4-layer model; the fast tier checks the layer on meshes
def test_tiny_moe_trains_the_same_on_one_device_and_on_data2_fsdp2():
    single, single_params = trained_moe(1, 1)
    meshed, meshed_params = trained_moe(2, 2)
    losses = [float(m["loss"]) for m in single]
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, [float(m["loss"]) for m in meshed], rtol=1e-5, atol=1e-5)
    for step in single:
        assert float(step["moe_aux_loss"]) > 0.0
        assert float(step["moe_load_balance_loss"]) >= 1.0 - 1e-5  # 1 when perfectly balanced
        tokens = step["moe_tokens_per_expert"]
        assert tokens.shape == (8,) and tokens.sum() == 3 * 2 * 8 * 32  # MoE layers x k x tokens
        assert float(step["moe_max_load_imbalance"]) >= float(step["moe_mean_load_imbalance"])
    meshed_leaves, single_leaves = jax.tree.leaves(meshed_params), jax.tree.leaves(single_params)
    for got, want in zip(meshed_leaves, single_leaves, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bias_balancing_moves_the_routing_bias_from_the_load_in_training():
    metrics, params = trained_moe(1, 1, bias_balancing=True, bias_update_rate=0.01)
    bias = params["moe_layers"]["mlp"]["router"]["bias"]  # [moe layers, experts]
    load = sum(m["moe_tokens_per_expert"] for m in metrics)
    assert np.abs(bias).max() > 0.0
    # over the run, the least loaded expert's bias rose above the most loaded one's
    assert bias.sum(axis=0)[np.argmin(load)] > bias.sum(axis=0)[np.argmax(load)]


@pytest.mark.slow  # two compiles of the 4-layer model (tests/unit/test_grad_accum.py's kind)
def test_accumulated_moe_step_equals_the_plain_step():
    """Microbatches sum the token-weighted z-loss and the token counts to the whole batch's (the
    load-balancing loss, a product of batch means, is each microbatch's own: weight 0 here)."""
    plain, plain_params = trained_moe(1, 1, load_balance_loss_weight=0.0)
    accumulated, params = trained_moe(1, 1, 2, load_balance_loss_weight=0.0)
    for key in ("loss", "moe_aux_loss", "moe_router_z_loss", "moe_tokens_per_expert"):
        got = [step[key] for step in accumulated]
        np.testing.assert_allclose(got, [step[key] for step in plain], rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(plain_params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_tiny_moe_trains_the_same_with_the_blocked_grouped_matmul():
    """The padded row blocks run the routed work alone and give ragged_dot's loss trace."""
    reference, reference_params = trained_moe(1, 1, matmul_impl="xla")
    blocks, params = trained_moe(1, 1)  # auto: blocks on CPU
    losses = [float(step["loss"]) for step in reference]
    assert losses[-1] < losses[0]
    np.testing.assert_allclose([float(step["loss"]) for step in blocks], losses, atol=1e-5)
    # Adam's steps magnify float reassociation (the dense layer's gate/up matmul is one dot):
    # one weight in 33,792 has moved 1.6e-5 apart after the run
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference_params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=5e-5)
