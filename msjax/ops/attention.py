"""Causal grouped-query attention: plain XLA by query blocks (msjax.ops.causal_blocks), the Pallas
flash kernel, or cuDNN.

The kernels run per shard: batch over the data axes, heads over `tensor`, whole sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from msjax.ops.causal_blocks import blocked_attention
from msjax.ops.dispatch import resolved_impl
from msjax.ops.sharding import per_shard
from msjax.parallel.context import interpret_kernels, kernel_mesh
from pallas_kernels.flash_attention import flash_attention

QUERY = ("batch", None, "heads", None)  # seq and head_dim stay whole inside a kernel
KEY_VALUE = ("batch", None, "kv_heads", None)
SEGMENTS = ("batch", None)


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    impl: str = "xla",
) -> jax.Array:
    """Causal attention by `impl` (xla | pallas | cudnn), as
    pallas_kernels.attention_reference.dot_product_attention computes it.

    query: [batch, seq, heads, head_dim]; key, value: [batch, seq, kv_heads, head_dim].
    """
    impl = resolved_impl(impl, "attention_impl")
    if impl == "xla":
        return blocked_attention(query, key, value, window=window, segment_ids=segment_ids)
    num_heads, num_kv_heads = query.shape[2], key.shape[2]

    def local(query, key, value, *segments):
        key, value = _kv_heads_of_local_queries(key, value, query.shape[2], num_heads, num_kv_heads)
        segment_ids = segments[0] if segments else None
        if impl == "cudnn":
            return _cudnn_attention(query, key, value, window, segment_ids)
        return flash_attention(
            query,
            key,
            value,
            window=window,
            segment_ids=segment_ids,
            interpret=interpret_kernels(),
        )

    args = (query, key, value) + (() if segment_ids is None else (segment_ids,))
    in_axes = (QUERY, KEY_VALUE, KEY_VALUE) + (() if segment_ids is None else (SEGMENTS,))
    return per_shard(local, in_axes, QUERY)(*args)


def _kv_heads_of_local_queries(
    key: jax.Array, value: jax.Array, local_heads: int, num_heads: int, num_kv_heads: int
) -> tuple[jax.Array, jax.Array]:
    """The kv heads this shard's query heads read, when heads are split but kv heads are not.

    Query head h reads kv head h // group. With `tensor` splitting query heads and not kv heads
    (kv_heads not divisible by it), shard t holds query heads [t*local, (t+1)*local).
    """
    mesh = kernel_mesh()
    if mesh is None or key.shape[2] != num_kv_heads or local_heads == num_heads:
        return key, value  # kv heads are split alongside the query heads (or nothing is split)
    group = num_heads // num_kv_heads
    shard = lax.axis_index(mesh.spec(("heads",))[0])
    first = shard * local_heads // group
    if local_heads % group == 0 or group % local_heads == 0:
        count = max(1, local_heads // group)
        return (
            lax.dynamic_slice_in_dim(key, first, count, axis=2),
            lax.dynamic_slice_in_dim(value, first, count, axis=2),
        )
    # Groups straddle shards unevenly: gather one kv head per local query head (group 1).
    index = (shard * local_heads + jnp.arange(local_heads)) // group
    return jnp.take(key, index, axis=2), jnp.take(value, index, axis=2)


def _cudnn_attention(query, key, value, window, segment_ids):
    """cuDNN flash attention through jax.nn; segments become a [batch, 1, q, k] mask."""
    mask = None
    if segment_ids is not None:
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return jax.nn.dot_product_attention(
        query,
        key,
        value,
        mask=mask,
        is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn",
    )
