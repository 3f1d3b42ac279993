"""The `xla` attention path: query blocks see only the keys they may; the reference's values."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax.config import load_config
from msjax.observe.compiled_flops import compiled_flops
from msjax.ops.attention import attention
from msjax.planner.aot import compile_step
from msjax.planner.candidates import MeshShape
from pallas_kernels.attention_reference import dot_product_attention
from pallas_kernels.blocked_attention import blocked_attention

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 512, 4, 2, 16


def inputs(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 3)
    query = jax.random.normal(keys[0], (BATCH, SEQ, HEADS, HEAD_DIM))
    key = jax.random.normal(keys[1], (BATCH, SEQ, KV_HEADS, HEAD_DIM))
    value = jax.random.normal(keys[2], (BATCH, SEQ, KV_HEADS, HEAD_DIM))
    return query, key, value


def packed_segments() -> jax.Array:
    """Row 0: documents of 100, 300 and 112 tokens; row 1: one document."""
    row0 = np.repeat([1, 2, 3], [100, 300, 112])
    return jnp.asarray(np.stack([row0, np.ones(SEQ, int)]), jnp.int32)


@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("packed", [False, True])
def test_blocked_attention_and_its_gradients_equal_the_reference(window, packed):
    query, key, value = inputs()
    segments = packed_segments() if packed else None
    cotangent = jax.random.normal(jax.random.key(9), query.shape)

    def loss(fn, *qkv):
        out = fn(*qkv, window=window, segment_ids=segments)
        return jnp.sum(out * cotangent), out

    (_, reference), grads_ref = jax.value_and_grad(
        lambda *a: loss(dot_product_attention, *a), argnums=(0, 1, 2), has_aux=True
    )(query, key, value)
    (_, blocked), grads = jax.value_and_grad(
        lambda *a: loss(blocked_attention, *a), argnums=(0, 1, 2), has_aux=True
    )(query, key, value)
    np.testing.assert_allclose(blocked, reference, atol=2e-5, rtol=2e-5)
    for got, want in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)


def attention_dot_flops(fn) -> float:
    compiled = jax.jit(lambda q, k, v: fn(q, k, v)).lower(*inputs()).compile()
    return compiled_flops(compiled.as_text()).total


def test_attention_dots_do_the_causal_share_of_the_square():
    # 4 blocks of 128 queries see 1, 2, 3, 4 blocks of keys: 10 of 16 query x key tiles
    blocked = attention_dot_flops(lambda q, k, v: attention(q, k, v, impl="xla"))
    square = 2 * 2 * BATCH * HEADS * SEQ * SEQ * HEAD_DIM  # scores and weighted values
    assert attention_dot_flops(dot_product_attention) == square
    assert blocked == pytest.approx(square * 10 / 16, rel=1e-9)


def test_the_compiled_train_step_holds_no_sequence_by_sequence_mask():
    one_device = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
    shape = ["data.seq_len=384", "train.global_batch=2", "model.attention_impl=xla"]
    config = load_config(None, [*shape, *one_device])
    step = compile_step(config, MeshShape(1, 1, 1))
    text = step.compiled.as_text()
    # [batch, kv_heads, group, seq, seq] and its [batch, kv_heads, group x seq, seq] bitcast
    seq_by_seq = re.compile(r"(pred|f32)\[2,4,(2,384|768),384\]")
    assert not seq_by_seq.findall(text), seq_by_seq.findall(text)[:5]
