"""Which key blocks a flash-attention query block visits, and which of those it must mask.

Blocks wholly outside the causal window are skipped by the loop bounds; only the blocks that
straddle the window's far edge or the diagonal are masked (shared by forward and backward).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def key_block_range(q_start, block_q: int, block_k: int, window: int | None, num_k_blocks):
    """(first, first_unmasked, end_unmasked, end) key-block indices for queries [q_start, +block_q).

    Blocks in [first, first_unmasked) and [end_unmasked, end) straddle the window's far edge or
    the diagonal and are masked; blocks in between are wholly visible; the rest are skipped.
    """
    q_end = q_start + block_q
    end = jnp.minimum(pl.cdiv(q_end, block_k), num_k_blocks)
    end_unmasked = (q_start + 1) // block_k  # key blocks ending at or before the first query
    if window is None:
        first = jnp.int32(0)
        first_unmasked = jnp.int32(0)
    else:
        first = jnp.maximum(q_start - window + 1, 0) // block_k
        first_unmasked = pl.cdiv(jnp.maximum(q_end - window, 0), block_k)
    first_unmasked = jnp.clip(first_unmasked, first, end)
    end_unmasked = jnp.clip(end_unmasked, first_unmasked, end)
    return first, first_unmasked, end_unmasked, end


def query_block_range(k_start, block_q: int, block_k: int, window: int | None, num_q_blocks):
    """(first, first_unmasked, end_unmasked, end) query blocks that see keys [k_start, +block_k)."""
    k_end = k_start + block_k
    first = k_start // block_q
    first_unmasked = pl.cdiv(k_end - 1, block_q)  # query blocks starting at or after the last key
    if window is None:
        end = jnp.int32(num_q_blocks)
        end_unmasked = jnp.int32(num_q_blocks)
    else:
        end = jnp.minimum(pl.cdiv(k_end - 1 + window, block_q), num_q_blocks)
        end_unmasked = (k_start + window) // block_q
    first_unmasked = jnp.clip(first_unmasked, first, end)
    end_unmasked = jnp.clip(end_unmasked, first_unmasked, end)
    return first, first_unmasked, end_unmasked, end


def visible(q_positions, k_positions, window: int | None, causal: bool, q_segments, k_segments):
    """[block_q, block_k] booleans, or None when every pair is visible."""
    mask = None
    if causal:
        mask = k_positions[None, :] <= q_positions[:, None]
        if window is not None:
            mask = mask & (q_positions[:, None] - k_positions[None, :] < window)
    if q_segments is not None:
        same = q_segments[:, None] == k_segments[None, :]
        mask = same if mask is None else mask & same
    return mask


def loop_in_three(bounds, body, carry):
    """Run body(index, carry, masked) over the masked edge, the unmasked middle, the far edge."""
    first, first_unmasked, end_unmasked, end = bounds
    carry = lax.fori_loop(first, first_unmasked, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(
        first_unmasked, end_unmasked, functools.partial(body, masked=False), carry
    )
    return lax.fori_loop(end_unmasked, end, functools.partial(body, masked=True), carry)
