"""Content fingerprints of checkpointed arrays, so a garbled file is caught at restore.

Orbax notices a truncated file (the read fails) but restores flipped bytes silently. Each array's
fingerprint is a position-weighted sum of its raw bits modulo 2**32: exact integer arithmetic,
so it is the same however the array is sharded. Every weight is odd, so any single-bit flip
(which changes one word by 2**b, b < 32) changes the sum by 2**b x odd, never 0 mod 2**32.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

_MULTIPLIER = 2654435761  # Knuth's multiplicative hash constant
# Format 1 weighted word i by i * _MULTIPLIER + 1, which is even for every odd i: a flip of bit
# 31 (a float32's sign) there added 2**31 x even = 0 mod 2**32 and went unseen. Format 2 weights
# word i by 2 * (i * _MULTIPLIER) + 1, odd everywhere. Checkpoints of format 1 are still checked
# with the weights they were written with.
FINGERPRINT_FORMATS = (1, 2)


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


def _weights(flat_index: jax.Array, fingerprint_format: int) -> jax.Array:
    scrambled = flat_index * jnp.uint32(_MULTIPLIER)
    if fingerprint_format == 1:
        return scrambled + 1
    return scrambled * jnp.uint32(2) + 1  # odd: see the module docstring


def _array_fingerprint(x: jax.Array, fingerprint_format: int = 2) -> jax.Array:
    bits = _bits_u32(x)
    pad = (-bits.shape[0]) % _ROW  # zeros add nothing to the sum
    bits = jnp.pad(bits, (0, pad)).reshape(-1, _ROW)  # [rows, 32]
    flat_index = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, 0) * jnp.uint32(
        _ROW
    ) + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, 1)
    weights = _weights(flat_index, fingerprint_format)
    row_sums = jnp.sum(bits * weights, axis=1, dtype=jnp.uint32)  # [rows]
    # keeps XLA from merging the two sums into the one long reduction the comment above avoids
    row_sums = jax.lax.optimization_barrier(row_sums)
    return jnp.sum(row_sums, dtype=jnp.uint32)


@functools.partial(jax.jit, static_argnames="fingerprint_format")
def _fingerprints(tree: Any, fingerprint_format: int = FINGERPRINT_FORMATS[-1]) -> Any:
    return jax.tree.map(lambda x: _array_fingerprint(x, fingerprint_format), tree)


def compile_fingerprints(abstract_tree: Any) -> None:
    """Compile the fingerprint program for these shapes and shardings ahead of the first use."""
    _fingerprints.lower(abstract_tree, fingerprint_format=FINGERPRINT_FORMATS[-1]).compile()


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

    def __init__(self, tree: Any, fingerprint_format: int = FINGERPRINT_FORMATS[-1]):
        # a tree of uint32 scalars, still being computed
        self._values = _fingerprints(tree, fingerprint_format=fingerprint_format)

    def result(self) -> dict[str, int]:
        """{path: fingerprint} for every array leaf; blocks until they are computed."""
        values = jax.device_get(self._values)
        leaves = jax.tree_util.tree_flatten_with_path(values)[0]
        return {leaf_name(path): int(value) for path, value in leaves}


def fingerprints(tree: Any, fingerprint_format: int = FINGERPRINT_FORMATS[-1]) -> dict[str, int]:
    """{path: fingerprint} for every array leaf of tree (computed where the arrays live)."""
    return PendingFingerprints(tree, fingerprint_format).result()
