"""The plain-JAX causal attention every attention kernel is checked against (and runs as `xla`).

Causal, optionally limited to a sliding window (MegaScale §3.1), optionally kept inside packed
documents by segment ids, and grouped-query without materialising a repeat of the kv heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(
    seq_len: int, window: int | None = None, segment_ids: jax.Array | None = None
) -> jax.Array:
    """Which keys each query may see: [batch or 1, 1, 1, q_seq, k_seq] booleans.

    Query i sees key j when j <= i, when i - j < window (if a window is set), and when both
    belong to the same document (if segment ids are given).
    """
    query = jnp.arange(seq_len)[:, None]
    key = jnp.arange(seq_len)[None, :]
    allowed = key <= query
    if window is not None:
        allowed = allowed & (query - key < window)
    allowed = allowed[None, None, None]  # [1, 1, 1, q_seq, k_seq]
    if segment_ids is not None:
        same_document = segment_ids[:, :, None] == segment_ids[:, None, :]  # [batch, q, k]
        allowed = allowed & same_document[:, None, None]
    return allowed


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Causal grouped-query attention in plain XLA; softmax in float32.

    query: [batch, seq, heads, head_dim]; key, value: [batch, seq, kv_heads, head_dim];
    returns [batch, seq, heads, head_dim].
    """
    batch, seq_len, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    query = query.reshape(batch, seq_len, num_kv_heads, group, head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", query, key, preferred_element_type=jnp.float32)
    scores = scores * (head_dim**-0.5)  # [batch, kv_heads, group, q_seq, k_seq]
    mask = attention_mask(seq_len, window, segment_ids)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", weights, value)  # [batch, seq, kv_heads, group, dim]
    return out.reshape(batch, seq_len, num_heads, head_dim)
