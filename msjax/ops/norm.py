"""RMSNorm, alone or fused with the residual add before it: the XLA reference or the Pallas kernel.

The kernel runs per shard over the residual stream's logical axes (batch over the data axes,
seq over `tensor` under sequence parallelism); the scale is gathered whole on every shard.
"""

from __future__ import annotations

import jax

from msjax.models.logical import LogicalAxes
from msjax.ops.dispatch import interpret_kernels, resolve_impl
from msjax.ops.sharding import per_shard
from pallas_kernels import rms_norm as kernels

STREAM = ("batch", "residual_seq", "act_embed")  # the residual stream between blocks
SCALE = (None,)


def rms_norm(
    x: jax.Array,
    scale: jax.Array,
    *,
    eps: float,
    impl: str = "auto",
    axes: LogicalAxes = STREAM,
) -> jax.Array:
    """x / rms(x) * scale over the last axis, in float32, returned in x's dtype."""
    if resolve_impl(impl, "model.norm_impl", ("xla", "pallas")) == "xla":
        return kernels.reference(x, scale, eps=eps)

    def local(x, scale):
        return kernels.rms_norm(x, scale, eps=eps, interpret=interpret_kernels())

    return per_shard(local, (axes, SCALE), axes)(x, scale)


def add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    scale: jax.Array,
    *,
    eps: float,
    impl: str = "auto",
    axes: LogicalAxes = STREAM,
) -> tuple[jax.Array, jax.Array]:
    """(x + residual, rms_norm(x + residual)): one pass over memory with the kernel."""
    if resolve_impl(impl, "model.norm_impl", ("xla", "pallas")) == "xla":
        return kernels.reference_add(x, residual, scale, eps=eps)

    def local(x, residual, scale):
        return kernels.add_rms_norm(x, residual, scale, eps=eps, interpret=interpret_kernels())

    return per_shard(local, (axes, axes, SCALE), (axes, axes))(x, residual, scale)
