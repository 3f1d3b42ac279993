"""Attention on its own, against the plain references of test_model.py: sliding window, document
masks of packed rows, grouped-query heads and RoPE."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model import (
    SEGMENTS,
    normal,
    random_tokens,
    reference_attention,
    reference_mask,
    reference_rope,
)

from msjax.models.attention import rotary_embedding
from pallas_kernels.attention_reference import attention_mask, dot_product_attention


def random_qkv(
    heads: int, kv_heads: int, batch: int = 2, seq: int = 8, seed: int = 7
) -> tuple[jax.Array, jax.Array, jax.Array]:
    query = normal((batch, seq, heads, 8), seed)  # [batch, seq, heads, head_dim]
    key = normal((batch, seq, kv_heads, 8), seed + 1)  # [batch, seq, kv_heads, head_dim]
    value = normal((batch, seq, kv_heads, 8), seed + 2)
    return query, key, value


# ---- 1. sliding window ------------------------------------------------------------------------


@pytest.mark.parametrize("window", [8, 9, 100])
def test_window_at_least_seq_len_equals_full_causal_attention(window):
    query, key, value = random_qkv(4, 2)
    full = dot_product_attention(query, key, value)
    windowed = dot_product_attention(query, key, value, window=window)
    np.testing.assert_array_equal(windowed, full)


def test_sliding_window_gives_zero_weight_to_the_key_just_outside_it():
    window, seq = 3, 8
    query, key, value = random_qkv(4, 2, seq=seq)
    attend = jax.jit(lambda v: dot_product_attention(query, key, v, window=window))
    base = attend(value)
    for i in range(window, seq):
        outside = attend(value.at[:, i - window].add(100.0))
        inside = attend(value.at[:, i - window + 1].add(100.0))
        np.testing.assert_array_equal(outside[:, i], base[:, i])
        assert float(jnp.min(jnp.abs(inside[:, i] - base[:, i]))) > 1e-3


def test_sliding_window_first_window_positions_match_full_causal_attention():
    window = 3
    query, key, value = random_qkv(4, 2)
    full = dot_product_attention(query, key, value)
    windowed = dot_product_attention(query, key, value, window=window)
    np.testing.assert_array_equal(windowed[:, :window], full[:, :window])
    assert not np.allclose(windowed[:, window:], full[:, window:])


def test_attention_mask_allows_distance_window_minus_one_but_not_window_nor_the_future():
    window, seq = 3, 8
    mask = np.asarray(attention_mask(seq, window))
    assert mask.shape == (1, 1, 1, seq, seq)
    mask = mask[0, 0, 0]  # [q_seq, k_seq]
    for i in range(seq):
        if i >= window - 1:
            assert mask[i, i - (window - 1)]
        if i >= window:
            assert not mask[i, i - window]
        assert not mask[i, i + 1 :].any()
        assert mask[i, i]
    np.testing.assert_array_equal(mask, reference_mask(seq, window)[0])


def test_attention_mask_without_window_is_lower_triangular():
    np.testing.assert_array_equal(
        np.asarray(attention_mask(6))[0, 0, 0], np.tril(np.ones((6, 6), bool))
    )


# ---- 2. packed documents ----------------------------------------------------------------------


def test_attention_mask_keeps_queries_inside_their_document():
    mask = np.asarray(attention_mask(8, segment_ids=SEGMENTS))
    assert mask.shape == (2, 1, 1, 8, 8)
    np.testing.assert_array_equal(mask[:, 0, 0], reference_mask(8, segment_ids=SEGMENTS))


def test_query_in_second_document_ignores_everything_in_the_first():
    query, key, value = random_qkv(4, 2)
    first = np.asarray(SEGMENTS == 1)[:, :, None, None]  # [batch, seq, 1, 1]
    noise = random_qkv(4, 2, seed=70)
    attend = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, segment_ids=SEGMENTS))
    base = attend(query, key, value)
    changed = attend(
        jnp.where(first, noise[0] * 10, query),
        jnp.where(first, noise[1] * 10, key),
        jnp.where(first, noise[2] * 10, value),
    )
    second = ~first[:, :, 0, 0]
    np.testing.assert_array_equal(np.asarray(changed)[second], np.asarray(base)[second])
    assert not np.allclose(np.asarray(changed)[~second], np.asarray(base)[~second])


# ---- 3. grouped-query attention ---------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_grouped_query_attention_equals_attention_over_repeated_kv_heads(kv_heads):
    query, key, value = random_qkv(4, kv_heads)
    out = dot_product_attention(query, key, value)
    expected = reference_attention(query, key, value, reference_mask(8))
    assert out.shape == query.shape
    np.testing.assert_allclose(out, expected, atol=1e-6, rtol=1e-6)


def test_grouped_query_head_h_reads_kv_head_h_floordiv_group():
    query, key, value = random_qkv(4, 2)
    query = jnp.broadcast_to(query[:, :, :1], query.shape)  # four identical query heads
    out = dot_product_attention(query, key, value)  # group 2: heads 0, 1 -> kv 0; 2, 3 -> kv 1
    np.testing.assert_array_equal(out[:, :, 0], out[:, :, 1])
    np.testing.assert_array_equal(out[:, :, 2], out[:, :, 3])
    assert not np.allclose(out[:, :, 0], out[:, :, 2])


# ---- 4. RoPE -----------------------------------------------------------------------------------


def test_rotary_embedding_preserves_the_norm_of_every_vector():
    x = normal((2, 16, 3, 8), seed=3)  # [batch, seq, heads, head_dim]
    positions = jnp.broadcast_to(jnp.arange(16) * 5, (2, 16))
    rotated = rotary_embedding(x, positions, 10000.0)
    np.testing.assert_allclose(
        jnp.linalg.norm(rotated, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5
    )
    assert not np.allclose(rotated[:, 1:], x[:, 1:])
    np.testing.assert_allclose(rotated[:, 0], x[:, 0], atol=1e-6)  # position 0: no rotation


def test_rotary_embedding_rotates_half_split_pairs_by_position_times_frequency():
    x = normal((2, 8, 3, 16), seed=4)
    positions = random_tokens(2, 8, vocab=50, seed=5)
    np.testing.assert_allclose(
        rotary_embedding(x, positions, 500.0),
        reference_rope(x, positions, 500.0),
        atol=1e-5,
        rtol=1e-5,
    )


def test_rotary_query_key_dot_product_depends_only_on_relative_position():
    q, k = normal((1, 1, 1, 16), seed=6), normal((1, 1, 1, 16), seed=60)
    q, k = q / jnp.linalg.norm(q), k / jnp.linalg.norm(k)

    def score(query_position: int, key_position: int) -> float:
        rotated_q = rotary_embedding(q, jnp.array([[query_position]]), 10000.0)
        rotated_k = rotary_embedding(k, jnp.array([[key_position]]), 10000.0)
        return float(jnp.sum(rotated_q * rotated_k))

    for query_position, key_position in [(5, 2), (2, 5), (7, 7), (0, 3)]:
        for offset in [1, 4, 13, 21]:
            shifted = score(query_position + offset, key_position + offset)
            assert shifted == pytest.approx(score(query_position, key_position), abs=1e-5)
    assert abs(score(5, 2) - score(5, 3)) > 1e-3  # a different distance gives another score
