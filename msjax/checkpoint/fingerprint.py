"""Content fingerprints of checkpointed arrays, so a garbled file is caught at restore.

Orbax notices a truncated file (the read fails) but restores flipped bytes silently. Each array's
fingerprint is a position-weighted sum of its raw bits modulo 2**32: exact integer arithmetic,
so it is the same however the array is sharded.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

_MULTIPLIER = 2654435761  # Knuth's multiplicative hash constant; odd, so every position counts


def _bits_u32(x: jax.Array) -> jax.Array:
    """The array's bits as a flat uint32 vector (narrower dtypes are widened bit-exactly)."""
    itemsize = jnp.dtype(x.dtype).itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned)  # 8-byte types gain a trailing dim of 2
    return bits.reshape(-1).astype(jnp.uint32)


def _array_fingerprint(x: jax.Array) -> jax.Array:
    bits = _bits_u32(x)
    weights = jnp.arange(bits.shape[0], dtype=jnp.uint32) * jnp.uint32(_MULTIPLIER) + 1
    return jnp.sum(bits * weights, dtype=jnp.uint32)


@jax.jit
def _fingerprints(tree: Any) -> Any:
    return jax.tree.map(_array_fingerprint, tree)


def leaf_name(path: tuple[Any, ...]) -> str:
    """A leaf's path as `params/layers/mlp/gate`, the same for dicts, lists and dataclasses."""
    parts = []
    for key in path:
        for attribute in ("key", "name", "idx"):
            if hasattr(key, attribute):
                parts.append(str(getattr(key, attribute)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def fingerprints(tree: Any) -> dict[str, int]:
    """{path: fingerprint} for every array leaf of tree (computed where the arrays live)."""
    values = jax.device_get(_fingerprints(tree))
    leaves = jax.tree_util.tree_flatten_with_path(values)[0]
    return {leaf_name(path): int(value) for path, value in leaves}
