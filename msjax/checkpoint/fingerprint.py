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


_ROWS = 64  # the flat bits are summed as rows, which XLA's CPU backend reduces in parallel


def _array_fingerprint(x: jax.Array) -> jax.Array:
    bits = _bits_u32(x)
    pad = (-bits.shape[0]) % _ROWS  # zeros add nothing to the sum
    bits = jnp.pad(bits, (0, pad)).reshape(_ROWS, -1)  # [rows, columns]
    flat_index = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, 0) * jnp.uint32(
        bits.shape[1]
    ) + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, 1)
    weights = flat_index * jnp.uint32(_MULTIPLIER) + 1
    row_sums = jnp.sum(bits * weights, axis=1, dtype=jnp.uint32)
    return jnp.sum(row_sums, dtype=jnp.uint32)


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
