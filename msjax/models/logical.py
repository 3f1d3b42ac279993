"""Logical-axis hints for activations: models name axes, the parallel layer decides placement.

A model calls `constrain(x, ("batch", "seq", "act_embed"))`. With no placement installed (a plain
CPU run, a unit test) it returns x unchanged; `msjax.parallel.rules.activation_placement` installs
one that maps the names to mesh axes and constrains the sharding. Kernels that must run per
shard (Pallas calls under `shard_map`) read the mesh from `kernel_mesh()`, installed alongside.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax

LogicalAxes = tuple[str | None, ...]
Placement = Callable[[jax.Array, LogicalAxes], jax.Array]

_placement: contextvars.ContextVar[Placement | None] = contextvars.ContextVar(
    "msjax_activation_placement", default=None
)


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """x with its sharding constrained to the logical axes, when a placement is installed."""
    if len(axes) != x.ndim:
        raise ValueError(f"{len(axes)} logical axes {axes} for an array of shape {x.shape}")
    placement = _placement.get()
    return x if placement is None else placement(x, axes)


@contextlib.contextmanager
def use_placement(placement: Placement | None) -> Iterator[None]:
    """Install a placement for activations while tracing model code inside this block."""
    token = _placement.set(placement)
    try:
        yield
    finally:
        _placement.reset(token)


@dataclass(frozen=True)
class KernelMesh:
    """What an op needs to run a kernel per shard: the mesh and the logical-axis mapping."""

    mesh: Any  # a jax.sharding.Mesh; models never look inside
    spec: Callable[[LogicalAxes], Any]  # logical axis names -> PartitionSpec


_kernel_mesh: contextvars.ContextVar[KernelMesh | None] = contextvars.ContextVar(
    "msjax_kernel_mesh", default=None
)


def kernel_mesh() -> KernelMesh | None:
    """The mesh installed for per-shard kernels while tracing, or None (run them whole)."""
    return _kernel_mesh.get()


@contextlib.contextmanager
def use_kernel_mesh(mesh: KernelMesh | None) -> Iterator[None]:
    """Install the mesh per-shard kernels run on while tracing model code inside this block."""
    token = _kernel_mesh.set(mesh)
    try:
        yield
    finally:
        _kernel_mesh.reset(token)
