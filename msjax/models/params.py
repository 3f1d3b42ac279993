"""How a model module makes a parameter: float32 values with their logical axis names."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, init, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> nnx.Param:
    """A float32 parameter drawn by init, carrying its logical axes (never a mesh's)."""
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=axes)
