"""Causal attention in query blocks, in plain XLA: what msjax runs as `attention_impl=xla`.

Each block of queries attends only to the keys it can see (up to its last query; from its first
query's window start when a sliding window is set), so the attention dots do the causal share
of the S x S work (10/16 of it at S=512 in blocks of 128), and the mask is a small additive bias
per block instead of an S x S select. Same semantics as `attention_reference.dot_product_attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QUERY_BLOCK = 128  # a block's scores, 8 heads x 128 x 512 x 4 B, stay in a core's cache
MASKED = float(jnp.finfo(jnp.float32).min)  # the reference's fill for keys a query cannot see


def query_blocks(seq_len: int, window: int | None, block: int = QUERY_BLOCK) -> list[tuple]:
    """(query start, query end, key start) of each block; its keys end at the query end."""
    blocks = []
    for start in range(0, seq_len, block):
        end = min(start + block, seq_len)
        key_start = 0 if window is None else max(0, start - window + 1)
        blocks.append((start, end, key_start))
    return blocks


def _block_bias(
    start: int,
    end: int,
    key_start: int,
    window: int | None,
    segment_ids: jax.Array | None,
) -> jax.Array:
    """0 where a query of the block may see a key, MASKED elsewhere: [batch or 1, 1, 1, q, k]."""
    query = jnp.arange(start, end)[:, None]
    key = jnp.arange(key_start, end)[None, :]
    allowed = key <= query
    if window is not None:
        allowed = allowed & (query - key < window)
    allowed = allowed[None]  # [1, q, k]
    if segment_ids is not None:
        queries_doc = segment_ids[:, start:end, None]
        keys_doc = segment_ids[:, None, key_start:end]
        allowed = allowed & (queries_doc == keys_doc)  # [batch, q, k]
    bias = jnp.where(allowed, 0.0, MASKED).astype(jnp.float32)
    return bias[:, None, None]


def blocked_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    block: int = QUERY_BLOCK,
) -> jax.Array:
    """Causal grouped-query attention, one query block at a time; softmax in float32.

    query: [batch, seq, heads, head_dim]; key, value: [batch, seq, kv_heads, head_dim];
    returns [batch, seq, heads, head_dim].
    """
    batch, seq_len, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    query = query.reshape(batch, seq_len, num_kv_heads, group, head_dim)
    outputs = []
    for start, end, key_start in query_blocks(seq_len, window, block):
        block_keys = key[:, key_start:end]  # [batch, k, kv_heads, head_dim]
        scores = jnp.einsum(
            "bqkgd,bskd->bkgqs",
            query[:, start:end],
            block_keys,
            preferred_element_type=jnp.float32,
        )
        scores = scores * (head_dim**-0.5)  # [batch, kv_heads, group, q, k]
        scores = scores + _block_bias(start, end, key_start, window, segment_ids)
        weights = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
        outputs.append(jnp.einsum("bkgqs,bskd->bqkgd", weights, value[:, key_start:end]))
    out = outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs, axis=1)
    return out.reshape(batch, seq_len, num_heads, head_dim)
