"""RMSNorm, alone or fused with the residual add before it: the XLA reference or a kernel, run per
shard over the residual stream's logical axes with the scale whole on every shard.
"""

from __future__ import annotations

import functools
from types import ModuleType

import jax

from msjax.ops.dispatch import resolved_impl
from msjax.ops.sharding import per_shard
from msjax.parallel.context import LogicalAxes, interpret_kernels
from pallas_kernels import rms_norm as kernels

STREAM = ("batch", "residual_seq", "act_embed")  # the residual stream between blocks
SCALE = (None,)


def rms_norm(
    x: jax.Array,
    scale: jax.Array,
    *,
    eps: float,
    impl: str = "xla",
    axes: LogicalAxes = STREAM,
) -> jax.Array:
    """x / rms(x) * scale over the last axis, in float32, returned in x's dtype."""
    impl = resolved_impl(impl, "norm_impl")
    if impl == "xla":
        return kernels.reference(x, scale, eps=eps)
    if impl == "triton":
        local = functools.partial(_triton_kernels().rms_norm, eps=eps)
    else:
        local = functools.partial(kernels.rms_norm, eps=eps, interpret=interpret_kernels())
    return per_shard(local, (axes, SCALE), axes)(x, scale)


def add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    scale: jax.Array,
    *,
    eps: float,
    impl: str = "xla",
    axes: LogicalAxes = STREAM,
) -> tuple[jax.Array, jax.Array]:
    """(x + residual, rms_norm(x + residual)): one pass over memory with a kernel."""
    impl = resolved_impl(impl, "norm_impl")
    if impl == "xla":
        return kernels.reference_add(x, residual, scale, eps=eps)
    if impl == "triton":
        local = functools.partial(_triton_kernels().add_rms_norm, eps=eps)
    else:
        local = functools.partial(kernels.add_rms_norm, eps=eps, interpret=interpret_kernels())
    return per_shard(local, (axes, axes, SCALE), (axes, axes))(x, residual, scale)


def _triton_kernels() -> ModuleType:
    """pallas_kernels.triton_rms_norm, imported only for `triton`: it loads jax-triton (GPU)."""
    from pallas_kernels import triton_rms_norm

    return triton_rms_norm
