"""The experts' grouped matmul: `jax.lax.ragged_dot` (xla, the reference) or the Pallas kernel.

Rows come grouped by expert (contiguous groups of group_sizes); the arrays are taken whole
(experts split over a mesh axis, each device running its own groups, come with expert
parallelism).
"""

from __future__ import annotations

import jax

from msjax.ops.dispatch import resolved_impl
from msjax.parallel.context import interpret_kernels
from pallas_kernels import grouped_matmul as kernels


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: str = "xla"
) -> jax.Array:
    """x [rows, k] in groups of group_sizes [experts], w [experts, k, n] -> [rows, n]."""
    if resolved_impl(impl, "moe.matmul_impl") == "xla":
        return kernels.reference(x, w, group_sizes)
    return kernels.grouped_matmul(x, w, group_sizes, interpret=interpret_kernels())
