"""The `xla` attention path by query blocks (msjax.ops.causal_blocks): the square reference's
values and gradients under every mask, only the blocks' key spans computed (counted in the
compiled dots), and no [seq, seq] tensor in a compiled training step."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax.config import load_config
from msjax.observe.compiled_flops import compiled_flops
from msjax.ops.attention import attention
from msjax.ops.causal_blocks import blocked_attention, blocked_keys_per_query
from msjax.planner.aot import compile_step
from msjax.planner.candidates import parse_mesh
from pallas_kernels.attention_reference import dot_product_attention

SEQ = 64


def random_qkv(heads: int = 4, kv_heads: int = 2, batch: int = 2, seed: int = 3):
    keys = jax.random.split(jax.random.key(seed), 4)
    query = jax.random.normal(keys[0], (batch, SEQ, heads, 8))  # [batch, seq, heads, head_dim]
    key = jax.random.normal(keys[1], (batch, SEQ, kv_heads, 8))  # [batch, seq, kv_heads, dim]
    value = jax.random.normal(keys[2], (batch, SEQ, kv_heads, 8))
    # packed rows: a new document where a coin falls, [batch, seq]
    segments = jnp.cumsum(jax.random.bernoulli(keys[3], 0.1, (batch, SEQ)), axis=1)
    return query, key, value, segments


@pytest.mark.parametrize("block", [16, 24, 64])  # 24: a last block shorter than the others
@pytest.mark.parametrize("window", [None, 5, 20])
@pytest.mark.parametrize("packed", [False, True])
def test_blocks_give_the_square_references_values_and_gradients(block, window, packed):
    query, key, value, segments = random_qkv()
    segment_ids = segments if packed else None

    def loss(function, query, key, value):
        out = function(query, key, value, window=window, segment_ids=segment_ids)
        return (out * jnp.cos(out)).sum()

    blocked = jax.value_and_grad(
        lambda *qkv: loss(lambda *a, **k: blocked_attention(*a, **k, block=block), *qkv),
        argnums=(0, 1, 2),
    )(query, key, value)
    square = jax.value_and_grad(lambda *qkv: loss(dot_product_attention, *qkv), argnums=(0, 1, 2))(
        query, key, value
    )
    np.testing.assert_allclose(blocked[0], square[0], rtol=1e-5)
    for got, expected in zip(blocked[1], square[1], strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def compiled_text(function, *args) -> str:
    return jax.jit(function).lower(*args).compile().as_text()


def test_the_xla_impl_runs_the_blocks():
    # one head per kv head: XLA may merge a group's heads into the query axis of the scores
    query, key, value, _ = random_qkv(heads=2, kv_heads=2)
    xla = lambda q, k, v: attention(q, k, v, impl="xla")  # noqa: E731
    assert "64,64]" in compiled_text(xla, query, key, value)  # one block: the square
    query, key, value = (x.repeat(4, axis=1) for x in (query, key, value))  # seq 256: 2 blocks
    text = compiled_text(xla, query, key, value)
    assert "128,128]" in text and "128,256]" in text
    assert "256,256]" not in text


@pytest.mark.parametrize(
    ("seq", "window", "block", "keys"),
    [
        (512, None, 128, 320.0),  # (128 + 256 + 384 + 512) / 4: 10/16 of the square
        (128, None, 128, 128.0),  # one block: the square
        (512, 100, 128, 202.25),  # keys from each block's first query's window on
        (64, None, 24, (24 * 24 + 24 * 48 + 16 * 64) / 64),
        (4096, None, None, 256 * 17 / 2),  # 16 blocks of 256: longer sequences, longer blocks
    ],
)
def test_keys_per_query_are_the_blocks_spans(seq, window, block, keys):
    assert blocked_keys_per_query(seq, window, block) == keys


def test_compiled_attention_dots_are_the_blocks_share_of_the_square():
    batch, seq, heads, head_dim = 2, 512, 4, 16
    shape = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.float32)
    counted = compiled_flops(compiled_text(blocked_attention, shape, shape, shape)).total
    # scores and values: 2 x 2 x batch x heads x head_dim per (query, key) pair the blocks span
    assert counted == 4 * batch * heads * head_dim * seq * blocked_keys_per_query(seq, None)
    assert counted == 4 * batch * heads * head_dim * seq * seq * 10 / 16


def test_a_compiled_training_step_holds_no_seq_by_seq_tensor():
    config = load_config(
        "configs/tiny.yaml", ["train.global_batch=4", "data.seq_len=512", "model.remat=none"]
    )
    step = compile_step(config, parse_mesh("1,1,1"))
    text = step.compiled.as_text()
    assert "512,128]" in text  # the first block's scores
    assert not re.search(r"\[[\d,]*512,512\]", text)  # no square scores, mask or bias
