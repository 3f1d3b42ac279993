"""Content fingerprints of checkpointed arrays, so a garbled file is caught at restore.

Orbax notices a truncated file (the read fails) but restores flipped bytes silently. Format 3
hashes each 32-bit word of an array together with its position (two avalanche mixes, one per
32-bit half) and sums the hashes modulo 2**32: the same however the array is sharded, and no
longer linear in the bits (formats 1 and 2 were weighted sums, blind to a negation).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# 1: sum of bits x (index x 2654435761 + 1): even weights at odd positions missed sign flips.
# 2: sum of bits x (2 x index x 2654435761 + 1): odd weights, but still linear, so a negation,
#    two sign flips, or all-1.0 against all-2.0 summed to the same value.
# 3: two sums of a non-linear mix of (position, word): a 64-bit fingerprint. New saves write 3;
#    checkpoints of 1 and 2 are checked with the function they were written with.
FINGERPRINT_FORMATS = (1, 2, 3)

_MULTIPLIER = 2654435761  # Knuth's multiplicative hash constant (formats 1 and 2)
# Format 3, per 32-bit half of the fingerprint: (index multiplier, seed, mixer). The index
# multipliers are odd, so the 2**32 positions of a word get 2**32 different offsets.
_LANES = (
    (0x9E3779B9, 0x243F6A88, (0x85EBCA6B, 0xC2B2AE35, 16, 13, 16)),  # MurmurHash3's fmix32
    (0x85EBCA77, 0x13198A2E, (0x7FEB352D, 0x846CA68B, 16, 15, 16)),  # C. Wellons' lowbias32
)
_HIGH_INDEX_MULTIPLIER = 0x27D4EB2F  # positions past 2**32 words (16 GiB of one array)


def _bits_u32(x: jax.Array) -> jax.Array:
    """The array's bits as a flat uint32 vector (narrower dtypes are widened bit-exactly)."""
    itemsize = jnp.dtype(x.dtype).itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned)  # 8-byte types gain a trailing dim of 2
    return bits.reshape(-1).astype(jnp.uint32)


# The flat bits are summed in rows of 32 first. XLA's CPU backend reduces such short rows in the
# same pass that reads the array; a long reduction axis is instead split into a tree of partial
# reductions that first writes the per-word terms out in full (several times slower).
_ROW = 32


def _mix(x: jax.Array, mixer: tuple[int, int, int, int, int]) -> jax.Array:
    """A 32-bit avalanche finalizer: a bijection in which each input bit flips about half of
    the output bits."""
    first, second, shift_a, shift_b, shift_c = mixer
    x = x ^ (x >> jnp.uint32(shift_a))
    x = x * jnp.uint32(first)
    x = x ^ (x >> jnp.uint32(shift_b))
    x = x * jnp.uint32(second)
    return x ^ (x >> jnp.uint32(shift_c))


def _linear_terms(bits: jax.Array, flat_index: jax.Array, fingerprint_format: int) -> jax.Array:
    scrambled = flat_index * jnp.uint32(_MULTIPLIER)
    weights = scrambled + 1 if fingerprint_format == 1 else scrambled * jnp.uint32(2) + 1
    return bits * weights


def _array_fingerprint(
    x: jax.Array, fingerprint_format: int = FINGERPRINT_FORMATS[-1]
) -> jax.Array:
    """uint32[2] (format 3: high and low half of 64 bits) or a uint32 scalar (formats 1, 2)."""
    bits = _bits_u32(x)
    words = bits.shape[0]
    pad = (-words) % _ROW
    bits = jnp.pad(bits, (0, pad)).reshape(-1, _ROW)  # [rows, 32]
    row = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, 0)
    column = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, 1)
    flat_index = row * jnp.uint32(_ROW) + column  # the word's position, modulo 2**32

    def total(terms: jax.Array) -> jax.Array:
        row_sums = jnp.sum(terms, axis=1, dtype=jnp.uint32)  # [rows]
        # keeps XLA from merging the two sums into the one long reduction the comment above avoids
        row_sums = jax.lax.optimization_barrier(row_sums)
        return jnp.sum(row_sums, dtype=jnp.uint32)

    if fingerprint_format in (1, 2):  # padding zeros add nothing to these sums
        return total(_linear_terms(bits, flat_index, fingerprint_format))
    if fingerprint_format != 3:
        raise ValueError(f"fingerprint format {fingerprint_format}; known: {FINGERPRINT_FORMATS}")
    high_index = row >> jnp.uint32(32 - 5)  # 5 = log2(_ROW): bits of the position past 32
    offset_high = high_index * jnp.uint32(_HIGH_INDEX_MULTIPLIER)
    # the padding words (the last row's after `words`) count for nothing
    real = (row < jnp.uint32(words // _ROW)) | (column < jnp.uint32(words % _ROW)) if pad else None
    halves = []
    for multiplier, seed, mixer in _LANES:
        offset = flat_index * jnp.uint32(multiplier) + offset_high
        terms = _mix((bits + offset) ^ jnp.uint32(seed), mixer)
        if real is not None:
            terms = jnp.where(real, terms, jnp.uint32(0))
        halves.append(total(terms))
    return jnp.stack(halves)  # [2]: high half, low half


@functools.partial(jax.jit, static_argnames="fingerprint_format")
def _fingerprints(tree: Any, fingerprint_format: int = FINGERPRINT_FORMATS[-1]) -> Any:
    return jax.tree.map(lambda x: _array_fingerprint(x, fingerprint_format), tree)


def fingerprint_value(value: Any) -> int:
    """One array's fingerprint, fetched, as a whole number (format 3: high x 2**32 + low)."""
    halves = [int(half) for half in np.asarray(value).reshape(-1)]
    return halves[0] if len(halves) == 1 else (halves[0] << 32) | halves[1]


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
        # a tree of uint32[2] (uint32 scalars before format 3), still being computed
        self._values = _fingerprints(tree, fingerprint_format=fingerprint_format)

    def result(self) -> dict[str, int]:
        """{path: fingerprint} for every array leaf; blocks until they are computed."""
        values = jax.device_get(self._values)
        leaves = jax.tree_util.tree_flatten_with_path(values)[0]
        return {leaf_name(path): fingerprint_value(value) for path, value in leaves}


def fingerprints(tree: Any, fingerprint_format: int = FINGERPRINT_FORMATS[-1]) -> dict[str, int]:
    """{path: fingerprint} for every array leaf of tree (computed where the arrays live)."""
    return PendingFingerprints(tree, fingerprint_format).result()
