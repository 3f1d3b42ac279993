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


# The flat bits are summed in rows of 32 first. XLA's CPU backend reduces such short rows in the
# same pass that reads the array (~10 GB/s on 2 cores); a long reduction axis is instead split
# into a tree of partial reductions that first writes the weighted bits out in full (~1 GB/s).
_ROW = 32


def _array_fingerprint(x: jax.Array) -> jax.Array:
    bits = _bits_u32(x)
    pad = (-bits.shape[0]) % _ROW  # zeros add nothing to the sum
    bits = jnp.pad(bits, (0, pad)).reshape(-1, _ROW)  # [rows, 32]
    flat_index = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, 0) * jnp.uint32(
        _ROW
    ) + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, 1)
    weights = flat_index * jnp.uint32(_MULTIPLIER) + 1
    row_sums = jnp.sum(bits * weights, axis=1, dtype=jnp.uint32)  # [rows]
    # keeps XLA from merging the two sums into the one long reduction the comment above avoids
    row_sums = jax.lax.optimization_barrier(row_sums)
    return jnp.sum(row_sums, dtype=jnp.uint32)


@jax.jit
def _fingerprints(tree: Any) -> Any:
    return jax.tree.map(_array_fingerprint, tree)


def compile_fingerprints(abstract_tree: Any) -> None:
    """Compile the fingerprint program for these shapes and shardings ahead of the first use."""
    _fingerprints.lower(abstract_tree).compile()


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


class PendingFingerprints:
    """Fingerprints whose computation is dispatched but not waited for.

    Creating one only enqueues the computation (JAX dispatches asynchronously); `result()`
    waits for it. A checkpoint save fetches the result in the thread that writes the save in the
    background, so the training loop does not wait for it.
    """

    def __init__(self, tree: Any):
        self._values = _fingerprints(tree)  # a tree of uint32 scalars, still being computed

    def result(self) -> dict[str, int]:
        """{path: fingerprint} for every array leaf; blocks until they are computed."""
        values = jax.device_get(self._values)
        leaves = jax.tree_util.tree_flatten_with_path(values)[0]
        return {leaf_name(path): int(value) for path, value in leaves}


def fingerprints(tree: Any) -> dict[str, int]:
    """{path: fingerprint} for every array leaf of tree (computed where the arrays live)."""
    return PendingFingerprints(tree).result()
