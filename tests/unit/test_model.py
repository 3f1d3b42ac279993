"""The decoder against a plain-jnp reference: blocks, packing, parameter count, remat, constrain.

The reference forward here is written from the paper formulas, not from the model code; it
reads the NNX model's parameters (layers stacked along a leading axis) and nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from msjax.config import ModelConfig
from msjax.models.transformer import MLP, Transformer
from msjax.models.transformer import (
    _saves_all_but_relayouts as STACKED_WEIGHTS_POLICY,  # _matmul_with_stacked_weights's
)
from msjax.observe.flops import count_params
from msjax.parallel.context import constrain
from msjax.resolve import resolve_model

TINY = ModelConfig(
    vocab_size=64, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2, mlp_dim=64
)
# Larger weights than the 0.02 default, so that every branch moves the logits visibly.
LOUD = dataclasses.replace(TINY, init_std=0.2)


def normal(shape: tuple[int, ...], seed: int) -> jax.Array:
    # NumPy draws: a jax.random draw of each new shape costs a compile.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def random_tokens(batch: int, seq: int, vocab: int = TINY.vocab_size, seed: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, seq)), jnp.int32)


def build(config: ModelConfig, seed: int = 0) -> Transformer:
    # Parameters carry logical axis names; without eager sharding they need no mesh. The ops run
    # what a run on this backend would resolve `auto` to.
    with nnx.use_eager_sharding(False):
        return Transformer(resolve_model(config, jax.default_backend()), nnx.Rngs(params=seed))


@nnx.jit
def forward(model: Transformer, tokens, positions=None, segment_ids=None) -> jax.Array:
    return model(tokens, positions, segment_ids)  # [batch, seq, vocab]


def params_of(model: Transformer) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def load_params(model: Transformer, params: dict) -> None:
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)


def build_with_random_norm_scales(config: ModelConfig) -> Transformer:
    """A model whose norm scales are not all ones, so that a norm in the wrong place shows."""
    model = build(config)

    def scramble(path, leaf):
        if path[-1].key != "scale":
            return leaf
        return 1.0 + 0.5 * normal(leaf.shape, seed=zlib.crc32(jax.tree_util.keystr(path).encode()))

    load_params(model, jax.tree_util.tree_map_with_path(scramble, params_of(model)))
    return model


# ---- the plain reference ----------------------------------------------------------------------


def reference_rms_norm(x, scale, eps):
    return x / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + eps) * scale


def reference_rope(x, positions, theta):
    """Half-split RoPE as complex rotation: feature i pairs with i + head_dim/2."""
    half = x.shape[-1] // 2
    frequencies = 1.0 / theta ** (np.arange(half) * 2.0 / x.shape[-1])  # [half]
    angles = positions[:, :, None, None] * frequencies  # [batch, seq, 1, half]
    pairs = (x[..., :half] + 1j * x[..., half:]) * jnp.exp(1j * angles)
    return jnp.concatenate([pairs.real, pairs.imag], axis=-1).astype(x.dtype)


def reference_mask(seq, window=None, segment_ids=None):
    """[batch or 1, seq, seq] booleans, written out element by element."""
    batch = 1 if segment_ids is None else segment_ids.shape[0]
    mask = np.zeros((batch, seq, seq), bool)
    for b in range(batch):
        for i in range(seq):
            for j in range(seq):
                visible = j <= i and (window is None or i - j < window)
                if segment_ids is not None:
                    visible = visible and segment_ids[b, i] == segment_ids[b, j]
                mask[b, i, j] = visible
    return mask


def reference_attention(query, key, value, mask):
    """Multi-head attention with kv heads repeated group-major: query head h reads h // group."""
    group = query.shape[2] // key.shape[2]
    key = jnp.repeat(key, group, axis=2)  # [batch, seq, heads, head_dim]
    value = jnp.repeat(value, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(query.shape[-1])
    scores = jnp.where(mask[:, None], scores, -jnp.inf)  # [batch, heads, q, k]
    weights = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = weights / weights.sum(axis=-1, keepdims=True)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, value)


def reference_logits(config, params, tokens, positions=None, segment_ids=None):
    """The whole decoder in plain jnp: embed, blocks, final norm, unembed."""
    batch, seq = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    mask = reference_mask(seq, config.attention_window, segment_ids)
    eps = config.norm_eps

    def attention(x, layer):
        query = jnp.einsum("bse,ehd->bshd", x, layer["attention"]["query"])
        key = jnp.einsum("bse,ehd->bshd", x, layer["attention"]["key"])
        value = jnp.einsum("bse,ehd->bshd", x, layer["attention"]["value"])
        query = reference_rope(query, positions, config.rope_theta)
        key = reference_rope(key, positions, config.rope_theta)
        attended = reference_attention(query, key, value, mask)
        return jnp.einsum("bshd,hde->bse", attended, layer["attention"]["out"])

    def mlp(x, layer):
        gate = x @ layer["mlp"]["gate"]
        up = x @ layer["mlp"]["up"]
        return (gate * jax.nn.sigmoid(gate) * up) @ layer["mlp"]["down"]

    x = params["embedding"][tokens]  # [batch, seq, embed]
    for index in range(config.num_layers):
        layer = jax.tree.map(lambda stacked, i=index: stacked[i], params["layers"])
        if config.parallel_block:
            normed = reference_rms_norm(x, layer["attention_norm"]["scale"], eps)
            x = x + attention(normed, layer) + mlp(normed, layer)
        else:
            x = x + attention(reference_rms_norm(x, layer["attention_norm"]["scale"], eps), layer)
            x = x + mlp(reference_rms_norm(x, layer["mlp_norm"]["scale"], eps), layer)
    x = reference_rms_norm(x, params["final_norm"]["scale"], eps)
    unembedding = params["embedding"].T if config.tied_embeddings else params["unembedding"]
    return x @ unembedding  # [batch, seq, vocab]


# ---- 1. blocks against the reference ----------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        LOUD,
        dataclasses.replace(LOUD, parallel_block=True),
        dataclasses.replace(LOUD, parallel_block=True, tied_embeddings=True, attention_window=3),
    ],
    ids=["sequential", "parallel", "parallel-tied-window"],
)
def test_model_logits_equal_plain_reference_forward(config):
    model = build_with_random_norm_scales(config)
    tokens = random_tokens(2, 8)
    logits = forward(model, tokens)
    expected = reference_logits(config, params_of(model), tokens)
    assert logits.shape == (2, 8, config.vocab_size)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=1e-5)


def test_parallel_block_has_one_norm_per_layer_and_no_mlp_norm():
    sequential = params_of(build(TINY))["layers"]
    parallel = params_of(build(dataclasses.replace(TINY, parallel_block=True)))["layers"]
    assert set(sequential) == {"attention_norm", "attention", "mlp_norm", "mlp"}
    assert set(parallel) == {"attention_norm", "attention", "mlp"}
    assert parallel["attention_norm"]["scale"].shape == (TINY.num_layers, TINY.embed_dim)


def test_parallel_and_sequential_blocks_differ_with_the_same_shared_parameters():
    sequential_model = build_with_random_norm_scales(LOUD)
    parallel_config = dataclasses.replace(LOUD, parallel_block=True)
    parallel_model = build(parallel_config)
    shared = params_of(sequential_model)
    del shared["layers"]["mlp_norm"]
    load_params(parallel_model, shared)
    jax.tree.map(np.testing.assert_array_equal, params_of(parallel_model), shared)

    tokens = random_tokens(2, 8)
    sequential_logits = forward(sequential_model, tokens)
    parallel_logits = forward(parallel_model, tokens)
    # The MLP reads LN(x) in the parallel block, LN(x + Attn(LN(x))) in the sequential one.
    assert float(jnp.max(jnp.abs(sequential_logits - parallel_logits))) > 1e-2
    np.testing.assert_allclose(
        parallel_logits, reference_logits(parallel_config, shared, tokens), atol=1e-5, rtol=1e-5
    )


# ---- 2. packed documents ----------------------------------------------------------------------

SEGMENTS = jnp.array([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 2, 2, 2]])  # [batch, seq]


def test_packed_second_document_matches_running_it_alone():
    model = build_with_random_norm_scales(LOUD)
    first, second = random_tokens(1, 3, seed=2), random_tokens(1, 5, seed=3)
    packed = jnp.concatenate([first, second], axis=1)  # [1, 8]
    positions = jnp.array([[0, 1, 2, 0, 1, 2, 3, 4]])
    segment_ids = jnp.array([[1, 1, 1, 2, 2, 2, 2, 2]])
    logits = forward(model, packed, positions, segment_ids)
    alone = forward(model, second)
    np.testing.assert_allclose(logits[:, 3:], alone, atol=1e-5, rtol=1e-5)

    other_first = (first + 17) % LOUD.vocab_size
    repacked = forward(
        model, jnp.concatenate([other_first, second], axis=1), positions, segment_ids
    )
    np.testing.assert_allclose(repacked[:, 3:], logits[:, 3:], atol=1e-6, rtol=0)
    assert not np.allclose(repacked[:, :3], logits[:, :3])


def test_packed_model_logits_equal_reference_with_segments_and_restarted_positions():
    model = build_with_random_norm_scales(LOUD)
    tokens = random_tokens(2, 8)
    positions = jnp.array([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 0, 1, 2]])
    logits = forward(model, tokens, positions, SEGMENTS)
    expected = reference_logits(LOUD, params_of(model), tokens, positions, np.asarray(SEGMENTS))
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=1e-5)


# ---- 3. parameter count -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        TINY,
        dataclasses.replace(TINY, tied_embeddings=True),
        dataclasses.replace(TINY, num_kv_heads=4),
        dataclasses.replace(TINY, num_kv_heads=1, head_dim=12, num_layers=3),
        dataclasses.replace(TINY, parallel_block=True),
        dataclasses.replace(TINY, parallel_block=True, tied_embeddings=True),
        dataclasses.replace(TINY, qk_norm=True, head_dim=12),
    ],
    ids=["untied-gqa", "tied", "mha", "mqa-head-dim", "parallel", "parallel-tied", "qk-norm"],
)
def test_built_model_has_exactly_count_params_parameters(config):
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(params=0)))
    built = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert built == count_params(config).total


# ---- 4. remat ----------------------------------------------------------------------------------


@functools.cache
def loss_and_grads(config: ModelConfig):
    graphdef, params = nnx.split(build(config), nnx.Param)
    tokens = random_tokens(2, 9)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def loss(params):
        logits = nnx.merge(graphdef, params)(inputs)
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))

    return jax.jit(jax.value_and_grad(loss))(params)


def checkpoint_policies(config: ModelConfig) -> list:
    """The policy of every checkpoint (remat) in the traced forward, nested jaxprs included, but
    the one that stacks the MLP's gate and up weights again in the backward pass."""
    graphdef, params = nnx.split(build(config), nnx.Param)
    trace = jax.make_jaxpr(lambda p, t: nnx.merge(graphdef, p)(t))
    jaxpr = trace(params, jnp.zeros((1, 8), jnp.int32)).jaxpr

    def walk(jaxpr, inside_scan: bool):
        for eqn in jaxpr.eqns:
            stacking = eqn.params.get("policy") is STACKED_WEIGHTS_POLICY
            if eqn.primitive.name in ("checkpoint", "remat2") and not stacking:
                yield eqn.params["policy"], inside_scan
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(sub, "eqns"):
                        yield from walk(sub, inside_scan or eqn.primitive.name == "scan")
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        yield from walk(sub.jaxpr, inside_scan or eqn.primitive.name == "scan")

    return list(walk(jaxpr, False))


@pytest.mark.parametrize("remat", ["full", "dots", "attention"])
def test_remat_gives_the_same_loss_and_gradients_as_no_remat(remat):
    config = dataclasses.replace(TINY, init_std=0.1)
    loss, grads = loss_and_grads(config)
    remat_loss, remat_grads = loss_and_grads(dataclasses.replace(config, remat=remat))
    assert float(remat_loss) == pytest.approx(float(loss), abs=1e-6)
    assert float(loss) > 1.0  # a real cross-entropy over 64 classes, not a constant
    for grad, remat_grad in zip(jax.tree.leaves(grads), jax.tree.leaves(remat_grads), strict=True):
        assert float(jnp.max(jnp.abs(grad))) > 0
        np.testing.assert_allclose(remat_grad, grad, atol=1e-6, rtol=1e-6)


def test_remat_setting_checkpoints_the_scanned_layer_with_its_policy():
    assert checkpoint_policies(TINY) == []
    assert checkpoint_policies(dataclasses.replace(TINY, remat="full")) == [(None, True)]
    [(policy, inside_scan)] = checkpoint_policies(dataclasses.replace(TINY, remat="dots"))
    assert policy is jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    assert inside_scan


def dot_shapes(jaxpr) -> list[tuple[int, ...]]:
    """The output shape of every dot in a jaxpr, nested jaxprs included, in order."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            shapes.append(tuple(eqn.outvars[0].aval.shape))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    shapes += dot_shapes(inner)
    return shapes


def test_gate_and_up_are_one_matmul_where_the_weights_are_whole():
    with nnx.use_eager_sharding(False):
        mlp = MLP(TINY, nnx.Rngs(0))
    x = jnp.ones((1, 8, TINY.embed_dim))  # [batch, seq, embed]
    forward = jax.make_jaxpr(lambda x: mlp(x))(x).jaxpr
    assert dot_shapes(forward) == [(1, 8, 2, TINY.mlp_dim), (1, 8, TINY.embed_dim)]


# ---- 5. constrain ------------------------------------------------------------------------------


def test_constrain_without_placement_returns_its_input_unchanged():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    assert constrain(x, ("batch", "seq", "act_embed")) is x
    traced = jax.jit(lambda y: constrain(y, ("batch", None, "act_embed")) * 2)(x)
    np.testing.assert_array_equal(traced, x * 2)


@pytest.mark.parametrize("axes", [("batch", "seq"), ("batch", "seq", "act_embed", "heads"), ()])
def test_constrain_rejects_a_wrong_number_of_axes(axes):
    x = jnp.zeros((2, 3, 4))
    with pytest.raises(ValueError, match=r"\(2, 3, 4\)"):
        constrain(x, axes)
