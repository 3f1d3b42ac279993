"""RMSNorm, alone or fused with the residual add before it: the XLA reference or a kernel.

The kernels (Pallas, or raw Triton through jax-triton) run per shard over the residual stream's
logical axes (batch over the data axes, seq over `tensor` under sequence parallelism); the scale
is gathered whole on every shard. jax-triton is imported only once `triton` has resolved, on a GPU.
"""

from __future__ import annotations

import functools
from types import ModuleType

import jax

from msjax.models.logical import LogicalAxes
from msjax.ops.dispatch import NORM_IMPLS, interpret_kernels, resolve_impl
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
    resolved = resolve_impl(impl, "model.norm_impl", NORM_IMPLS)
    if resolved == "xla":
        return kernels.reference(x, scale, eps=eps)
    if resolved == "triton":
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
    impl: str = "auto",
    axes: LogicalAxes = STREAM,
) -> tuple[jax.Array, jax.Array]:
    """(x + residual, rms_norm(x + residual)): one pass over memory with a kernel."""
    resolved = resolve_impl(impl, "model.norm_impl", NORM_IMPLS)
    if resolved == "xla":
        return kernels.reference_add(x, residual, scale, eps=eps)
    if resolved == "triton":
        local = functools.partial(_triton_kernels().add_rms_norm, eps=eps)
    else:
        local = functools.partial(kernels.add_rms_norm, eps=eps, interpret=interpret_kernels())
    return per_shard(local, (axes, axes, SCALE), (axes, axes))(x, residual, scale)


def _triton_kernels() -> ModuleType:
    """pallas_kernels.triton_rms_norm, imported on first use: it imports jax-triton (GPU only)."""
    from pallas_kernels import triton_rms_norm

    return triton_rms_norm
