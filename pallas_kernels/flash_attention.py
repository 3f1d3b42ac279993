"""Flash attention in Pallas (Triton backend): causal, sliding window, packed documents, GQA.
FlashAttention-2 (Dao, 2023) forward and backward under one `jax.custom_vjp`; `reference` is the
plain-JAX attention with the same signature (from pallas_kernels.attention_reference).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention_blocks import (
    key_block_range,
    loop_in_three,
    query_block_range,
    visible,
)
from pallas_kernels.attention_reference import dot_product_attention

reference = dot_product_attention  # the plain-JAX attention every test compares against

# Key blocks that lie wholly outside a query block's causal window are never visited, forward
# or backward (the loop bounds of pallas_kernels.attention_blocks skip them; MegaScale §3.1
# needs this for sliding windows to pay off); only blocks on the window's edges are masked.

LOG2_E = math.log2(math.e)  # scores are kept in base 2: exp(x) == exp2(x * log2(e))
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so max() of a masked row works


@dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and Triton launch settings; powers of two (at least 16) on GPU.

    The defaults follow the FlashAttention-2 Triton tutorial (128 x 64 forward, 64 x 64
    backward); they are starting points, not yet tuned on a GPU. Blocks larger than the
    sequence shrink to it.
    """

    block_q: int = 128  # forward: queries per program
    block_k: int = 64  # forward: keys per loop step
    block_q_backward: int = 64  # backward (dK/dV and dQ kernels): queries per tile
    block_k_backward: int = 64  # backward: keys per tile
    num_warps: int | None = None  # None: 4 for head_dim <= 64, else 8
    num_stages: int = 2


@dataclass(frozen=True)
class _Static:
    """Everything the kernels are specialised on (hashable: a custom_vjp nondiff argument)."""

    window: int | None
    scale: float
    block_q: int
    block_k: int
    block_q_backward: int
    block_k_backward: int
    num_warps: int
    num_stages: int
    interpret: bool


def flash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool | None = None,
) -> jax.Array:
    """Causal grouped-query attention, as `reference` computes it, without the [seq, seq] scores.

    query: [batch, seq, heads, head_dim]; key, value: [batch, seq, kv_heads, head_dim] with
    kv_heads dividing heads (query head h reads kv head h // (heads // kv_heads));
    segment_ids: [batch, seq] ints, a query sees only keys of its own segment;
    window: a query at i sees keys j with i - window < j <= i (None: all j <= i).
    Accumulates in float32 for bfloat16 and float32 inputs. interpret=None runs the kernels in
    the Pallas interpreter unless the default backend is a GPU.
    """
    batch, seq_len, num_heads, head_dim = query.shape
    if key.shape != value.shape or key.shape[:2] != (batch, seq_len) or key.ndim != 4:
        raise ValueError(
            f"key {key.shape} and value {value.shape} must be [batch, seq, kv_heads, head_dim] "
            f"matching query {query.shape}"
        )
    if key.shape[3] != head_dim or num_heads % key.shape[2]:
        raise ValueError(
            f"query {query.shape} needs kv heads dividing its {num_heads} heads and the same "
            f"head_dim; got key {key.shape}"
        )
    if segment_ids is not None and segment_ids.shape != (batch, seq_len):
        raise ValueError(f"segment_ids {segment_ids.shape} must be [batch, seq] = {batch, seq_len}")
    if window is not None and window <= 0:
        raise ValueError(f"window={window} must be positive (or None)")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"

    # Triton tiles are powers of two and tl.dot wants 16 or more: pad head_dim with zeros
    # (scores and outputs unchanged) and seq to whole blocks. Padded keys come after every
    # real query, so causality hides them.
    padded_dim = max(16, pl.next_power_of_2(head_dim))
    seq_cap = max(16, pl.next_power_of_2(seq_len))
    sizes = [
        min(block, seq_cap)
        for block in (
            block_sizes.block_q,
            block_sizes.block_k,
            block_sizes.block_q_backward,
            block_sizes.block_k_backward,
        )
    ]
    padded_seq = _round_up(seq_len, math.lcm(*sizes))
    num_warps = block_sizes.num_warps or (4 if padded_dim <= 64 else 8)
    static = _Static(
        window=None if window is None or window >= seq_len else window,
        scale=head_dim**-0.5,
        block_q=sizes[0],
        block_k=sizes[1],
        block_q_backward=sizes[2],
        block_k_backward=sizes[3],
        num_warps=num_warps,
        num_stages=block_sizes.num_stages,
        interpret=bool(interpret),
    )
    pad = ((0, 0), (0, padded_seq - seq_len), (0, 0), (0, padded_dim - head_dim))
    if any(after for _, after in pad):
        query, key, value = (jnp.pad(x, pad) for x in (query, key, value))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, padded_seq - seq_len)))
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    out = _attention(query, key, value, segment_ids, static)
    return out[:, :seq_len, :, :head_dim]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _dot_t(a, b):
    """a @ b.T with float32 accumulation, without materialising the transpose."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


# ---- forward ----------------------------------------------------------------------------------


def _forward_kernel(q_ref, k_ref, v_ref, segment_ref, o_ref, lse_ref, *, static: _Static):
    block_q, block_k, window = static.block_q, static.block_k, static.window
    seq_len = k_ref.shape[0]
    num_q_blocks = seq_len // block_q
    # Heaviest query blocks (most keys under causality) first: a shorter tail of the launch.
    q_block = num_q_blocks - 1 - pl.program_id(0)
    q_start = q_block * block_q
    q = q_ref[...]  # [block_q, head_dim]
    q_positions = q_start + jnp.arange(block_q)
    q_segments = None if segment_ref is None else segment_ref[pl.ds(q_start, block_q)]
    score_scale = static.scale * LOG2_E

    def body(k_block, carry, masked: bool):
        acc, row_max, row_sum = carry
        k_start = k_block * block_k
        k = k_ref[pl.ds(k_start, block_k), :]  # [block_k, head_dim]
        v = v_ref[pl.ds(k_start, block_k), :]
        scores = _dot_t(q, k) * score_scale  # [block_q, block_k], base 2
        k_segments = None if segment_ref is None else segment_ref[pl.ds(k_start, block_k)]
        mask = visible(
            q_positions, k_start + jnp.arange(block_k), window, masked, q_segments, k_segments
        )
        if mask is not None:
            scores = jnp.where(mask, scores, MASK_VALUE)
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
        correction = jnp.exp2(row_max - new_max)
        probs = jnp.exp2(scores - new_max[:, None])
        row_sum = row_sum * correction + jnp.sum(probs, axis=1)
        acc = acc * correction[:, None] + _dot(probs.astype(v.dtype), v)
        return acc, new_max, row_sum

    carry = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    bounds = key_block_range(q_start, block_q, block_k, window, seq_len // block_k)
    acc, row_max, row_sum = loop_in_three(bounds, body, carry)
    o_ref[...] = (acc / row_sum[:, None]).astype(o_ref.dtype)
    lse_ref[...] = row_max + jnp.log2(row_sum)  # base-2 log-sum-exp of the scaled scores


def _forward(q, k, v, segment_ids, static: _Static):
    """out [batch, seq, heads, head_dim] and lse [batch, heads, seq] (base 2, float32)."""
    batch, seq_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[2]
    block_q = static.block_q
    num_q_blocks = seq_len // block_q

    def q_index(i, b, h):
        return b, num_q_blocks - 1 - i, h, 0

    def kv_index(i, b, h):
        return b, 0, h // group, 0  # grouped-query: no repeated kv heads in memory

    return pl.pallas_call(
        functools.partial(_forward_kernel, static=static),
        grid=(num_q_blocks, batch, num_heads),
        in_specs=[
            pl.BlockSpec((None, block_q, None, head_dim), q_index),
            pl.BlockSpec((None, seq_len, None, head_dim), kv_index),
            pl.BlockSpec((None, seq_len, None, head_dim), kv_index),
            None if segment_ids is None else pl.BlockSpec((None, seq_len), lambda i, b, h: (b, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, block_q, None, head_dim), q_index),
            pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, num_q_blocks - 1 - i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, seq_len), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=static.num_warps, num_stages=static.num_stages
        ),
        interpret=static.interpret,
        name="flash_attention_forward",
    )(q, k, v, segment_ids)


# ---- backward ---------------------------------------------------------------------------------


def _dkv_kernel(
    q_ref, k_ref, v_ref, segment_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, static
):
    """dK, dV of one key block, summed over the query heads of its group and their queries."""
    block_q, block_k, window = static.block_q_backward, static.block_k_backward, static.window
    seq_len, group = q_ref.shape[0], q_ref.shape[1]
    k_start = pl.program_id(0) * block_k
    k = k_ref[...]  # [block_k, head_dim]
    v = v_ref[...]
    k_positions = k_start + jnp.arange(block_k)
    k_segments = None if segment_ref is None else segment_ref[pl.ds(k_start, block_k)]
    score_scale = static.scale * LOG2_E
    bounds = query_block_range(k_start, block_q, block_k, window, seq_len // block_q)

    def head(g, carry):
        def body(q_block, carry, masked: bool):
            dk, dv = carry
            q_start = q_block * block_q
            q = q_ref[pl.ds(q_start, block_q), g, :]  # [block_q, head_dim]
            do = do_ref[pl.ds(q_start, block_q), g, :]
            lse = lse_ref[g, pl.ds(q_start, block_q)]  # [block_q]
            delta = delta_ref[g, pl.ds(q_start, block_q)]
            scores = _dot_t(q, k) * score_scale  # [block_q, block_k]
            q_segments = None if segment_ref is None else segment_ref[pl.ds(q_start, block_q)]
            mask = visible(
                q_start + jnp.arange(block_q), k_positions, window, masked, q_segments, k_segments
            )
            if mask is not None:
                scores = jnp.where(mask, scores, MASK_VALUE)
            probs = jnp.exp2(scores - lse[:, None])  # the forward's softmax, recomputed
            dv = dv + _dot(probs.T.astype(do.dtype), do)
            d_probs = _dot_t(do, v)  # [block_q, block_k]
            d_scores = probs * (d_probs - delta[:, None])
            dk = dk + _dot(d_scores.T.astype(q.dtype), q)
            return dk, dv

        return loop_in_three(bounds, body, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    dk_ref[...] = (dk * static.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, segment_ref, do_ref, lse_ref, delta_ref, dq_ref, *, static):
    """dQ of one query block, over the key blocks its window reaches."""
    block_q, block_k, window = static.block_q_backward, static.block_k_backward, static.window
    seq_len = k_ref.shape[0]
    num_q_blocks = seq_len // block_q
    q_start = (num_q_blocks - 1 - pl.program_id(0)) * block_q
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    q_positions = q_start + jnp.arange(block_q)
    q_segments = None if segment_ref is None else segment_ref[pl.ds(q_start, block_q)]
    score_scale = static.scale * LOG2_E

    def body(k_block, dq, masked: bool):
        k_start = k_block * block_k
        k = k_ref[pl.ds(k_start, block_k), :]
        v = v_ref[pl.ds(k_start, block_k), :]
        scores = _dot_t(q, k) * score_scale
        k_segments = None if segment_ref is None else segment_ref[pl.ds(k_start, block_k)]
        mask = visible(
            q_positions, k_start + jnp.arange(block_k), window, masked, q_segments, k_segments
        )
        if mask is not None:
            scores = jnp.where(mask, scores, MASK_VALUE)
        probs = jnp.exp2(scores - lse[:, None])
        d_scores = probs * (_dot_t(do, v) - delta[:, None])
        return dq + _dot(d_scores.astype(k.dtype), k)

    bounds = key_block_range(q_start, block_q, block_k, window, seq_len // block_k)
    dq = loop_in_three(bounds, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * static.scale).astype(dq_ref.dtype)


def _backward(static: _Static, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    batch, seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    block_q, block_k = static.block_q_backward, static.block_k_backward
    num_q_blocks = seq_len // block_q
    # delta_i = sum_d out_id * dout_id = sum_j P_ij dP_ij (FlashAttention-2, Algorithm 2 line 4)
    delta = jnp.einsum(
        "bshd,bshd->bhs", out.astype(jnp.float32), d_out.astype(jnp.float32)
    )  # [batch, heads, seq]
    params = plgpu.CompilerParams(num_warps=static.num_warps, num_stages=static.num_stages)
    segment_spec = (
        None if segment_ids is None else pl.BlockSpec((None, seq_len), lambda *i: (i[1], 0))
    )

    # dK, dV: one program per (key block, batch, kv head); query heads of the group are a block
    # of `group` consecutive heads, so the group is read in place, never repeated.
    def group_index(j, b, kh):
        return b, 0, kh, 0

    def k_block_index(j, b, kh):
        return b, j, kh, 0

    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, static=static),
        grid=(seq_len // block_k, batch, num_kv_heads),
        in_specs=[
            pl.BlockSpec((None, seq_len, group, head_dim), group_index),
            pl.BlockSpec((None, block_k, None, head_dim), k_block_index),
            pl.BlockSpec((None, block_k, None, head_dim), k_block_index),
            segment_spec,
            pl.BlockSpec((None, seq_len, group, head_dim), group_index),
            pl.BlockSpec((None, group, seq_len), lambda j, b, kh: (b, kh, 0)),
            pl.BlockSpec((None, group, seq_len), lambda j, b, kh: (b, kh, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, block_k, None, head_dim), k_block_index),
            pl.BlockSpec((None, block_k, None, head_dim), k_block_index),
        ],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params,
        interpret=static.interpret,
        name="flash_attention_dkv",
    )(q, k, v, segment_ids, d_out, lse, delta)

    def q_index(i, b, h):
        return b, num_q_blocks - 1 - i, h, 0

    def kv_index(i, b, h):
        return b, 0, h // group, 0

    def row_index(i, b, h):
        return b, h, num_q_blocks - 1 - i

    dq = pl.pallas_call(
        functools.partial(_dq_kernel, static=static),
        grid=(num_q_blocks, batch, num_heads),
        in_specs=[
            pl.BlockSpec((None, block_q, None, head_dim), q_index),
            pl.BlockSpec((None, seq_len, None, head_dim), kv_index),
            pl.BlockSpec((None, seq_len, None, head_dim), kv_index),
            segment_spec,
            pl.BlockSpec((None, block_q, None, head_dim), q_index),
            pl.BlockSpec((None, None, block_q), row_index),
            pl.BlockSpec((None, None, block_q), row_index),
        ],
        out_specs=pl.BlockSpec((None, block_q, None, head_dim), q_index),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=static.interpret,
        name="flash_attention_dq",
    )(q, k, v, segment_ids, d_out, lse, delta)
    return dq, dk, dv, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segment_ids, static: _Static):
    return _forward(q, k, v, segment_ids, static)[0]


def _attention_forward(q, k, v, segment_ids, static: _Static):
    out, lse = _forward(q, k, v, segment_ids, static)
    return out, (q, k, v, segment_ids, out, lse)


_attention.defvjp(_attention_forward, _backward)
