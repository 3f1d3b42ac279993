"""Run a kernel on each device's shard: `jax.shard_map` over the mesh the parallel layer installed.
Without an installed mesh (a CPU unit test, a single-device run) a kernel runs on whole arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from msjax.parallel.context import LogicalAxes, kernel_mesh


def _is_axes(leaf: Any) -> bool:
    return isinstance(leaf, tuple) and all(name is None or isinstance(name, str) for name in leaf)


def per_shard(
    fn: Callable[..., Any], in_axes: tuple[LogicalAxes, ...], out_axes: Any
) -> Callable[..., Any]:
    """fn under shard_map with in/out specs from logical axes (out_axes: axes or a tuple of them).

    A `pallas_call` is one program per device: inside a sharded step it must see local blocks.

    check_vma=False: pallas_call has no varying-manual-axes rule; the transpose then sums the
    gradients of inputs replicated over some mesh axes (scales, unsplit kv heads) over them.
    """
    mesh = kernel_mesh()
    if mesh is None:
        return fn
    return jax.shard_map(
        fn,
        mesh=mesh.mesh,
        in_specs=tuple(mesh.spec(axes) for axes in in_axes),
        out_specs=jax.tree.map(mesh.spec, out_axes, is_leaf=_is_axes),
        check_vma=False,
    )
