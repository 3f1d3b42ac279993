"""The `xla` attention path: causal attention in plain JAX by query blocks, each attending only
to the keys it can see (the blocks wholly above the diagonal, or beyond a sliding window, are never
computed), with the causal mask as a small additive bias per block instead of a [seq, seq] select.

At seq 512 and blocks of 128 that is 10/16 of the full square's scores. Each block's scores
([batch, kv_heads, group, block, keys]) stay small enough for the CPU's caches. The square
reference every kernel is checked against stays in pallas_kernels.attention_reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

QUERY_BLOCK = 128  # queries per block; a sequence of one block computes the square as it is
MAX_BLOCKS = 16  # longer sequences get longer blocks: the unrolled blocks bound the program size
MASKED = float(np.finfo(np.float32).min)  # a masked score; every query sees its own key


def first_key(start: int, window: int | None) -> int:
    """The first key a block starting at query `start` may see: its block's keys are
    [first_key, the block's end), causal and within the window."""
    return 0 if window is None else max(0, start - window + 1)


def query_block_size(seq_len: int) -> int:
    """Queries per block: QUERY_BLOCK, or more where that would make over MAX_BLOCKS blocks."""
    return max(QUERY_BLOCK, -(-seq_len // MAX_BLOCKS))


def query_blocks(seq_len: int, block: int | None = None) -> list[tuple[int, int]]:
    """The [start, stop) of each query block (of `query_block_size` queries unless given)."""
    block = block or query_block_size(seq_len)
    return [(start, min(start + block, seq_len)) for start in range(0, seq_len, block)]


def blocked_keys_per_query(seq_len: int, window: int | None, block: int | None = None) -> float:
    """The keys each query's scores span on average in the blocked computation (its block's key
    span): seq_len for one block, 10/16 of it at seq 512 in blocks of 128 (for the planner)."""
    spans = [
        (stop - start) * (stop - first_key(start, window))
        for start, stop in query_blocks(seq_len, block)
    ]
    return sum(spans) / seq_len


def causal_bias(start: int, stop: int, first: int, window: int | None) -> np.ndarray:
    """[queries, keys] float32: 0 where query i may see key j, MASKED where not (a constant)."""
    query = np.arange(start, stop)[:, None]
    key = np.arange(first, stop)[None, :]
    allowed = key <= query
    if window is not None:
        allowed &= query - key < window
    return np.where(allowed, 0.0, MASKED).astype(np.float32)


def blocked_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    block: int | None = None,
) -> jax.Array:
    """Causal grouped-query attention as `dot_product_attention` computes it, by query blocks;
    softmax in float32.

    query: [batch, seq, heads, head_dim]; key, value: [batch, seq, kv_heads, head_dim];
    segment_ids: [batch, seq] (packed documents) or None; block: queries per block
    (`query_block_size` when None); returns [batch, seq, heads, head_dim].
    """
    batch, seq_len, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    query = query.reshape(batch, seq_len, num_kv_heads, group, head_dim)
    outputs = []
    for start, stop in query_blocks(seq_len, block):
        first = first_key(start, window)
        keys, values = key[:, first:stop], value[:, first:stop]  # [batch, keys, kv_heads, dim]
        scores = jnp.einsum(
            "bqkgd,bskd->bkgqs", query[:, start:stop], keys, preferred_element_type=jnp.float32
        )  # [batch, kv_heads, group, queries, keys]
        scores = scores * (head_dim**-0.5) + causal_bias(start, stop, first, window)
        if segment_ids is not None:  # packed documents: a query sees its own document only
            same = segment_ids[:, start:stop, None] == segment_ids[:, None, first:stop]
            scores = jnp.where(same[:, None, None], scores, MASKED)
        weights = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
        outputs.append(jnp.einsum("bkgqs,bskd->bqkgd", weights, values))
    out = jnp.concatenate(outputs, axis=1) if len(outputs) > 1 else outputs[0]
    return out.reshape(batch, seq_len, num_heads, head_dim)
