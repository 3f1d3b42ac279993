"""The tracing context through which model code reaches the mesh without naming one: activation
placement behind `constrain`, weights in the compute dtype behind `compute_weight`, the mesh
per-shard kernels run on, and whether Pallas is interpreted.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

LogicalAxes = tuple[str | None, ...]
Placement = Callable[[jax.Array, LogicalAxes], jax.Array]

_placement: contextvars.ContextVar[Placement | None] = contextvars.ContextVar(
    "msjax_activation_placement", default=None
)


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """x with its sharding constrained to the logical axes, when a placement is installed.

    Models call `constrain(x, ("batch", "seq", "act_embed"))` and never see a mesh: with no
    placement installed (a plain CPU run, a unit test) x comes back unchanged, and
    `msjax.parallel.rules.activation_placement` installs one that maps the names to mesh axes.
    """
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


WeightGather = Callable[[jax.Array, LogicalAxes, jnp.dtype], jax.Array]

_weight_gather: contextvars.ContextVar[WeightGather | None] = contextvars.ContextVar(
    "msjax_weight_gather", default=None
)


def compute_weight(weight: jax.Array, axes: LogicalAxes, dtype: jnp.dtype) -> jax.Array:
    """A parameter (float32, its logical axes) as the compute needs it: in `dtype`, whole.

    With no gather installed this is `weight.astype(dtype)` and XLA places the cast; with one
    (msjax.parallel.rules) the cast runs on each device's shard before the shards are gathered,
    so a sharded weight crosses the wire in the compute dtype.
    """
    if len(axes) != weight.ndim:
        raise ValueError(f"{len(axes)} logical axes {axes} for a weight of shape {weight.shape}")
    gather = _weight_gather.get()
    return weight.astype(dtype) if gather is None else gather(weight, axes, jnp.dtype(dtype))


@contextlib.contextmanager
def use_weight_gather(gather: WeightGather | None) -> Iterator[None]:
    """Install how weights reach the compute while tracing model code inside this block."""
    token = _weight_gather.set(gather)
    try:
        yield
    finally:
        _weight_gather.reset(token)


@dataclass(frozen=True)
class KernelMesh:
    """What an op needs to run a kernel per shard: the mesh and the logical-axis mapping."""

    mesh: Mesh
    spec: Callable[[LogicalAxes], PartitionSpec]  # logical axis names -> mesh axes


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


def interpret_kernels() -> bool:
    """Pallas kernels run in the interpreter (slow, exact) everywhere but on a GPU."""
    return jax.default_backend() != "gpu"
