"""The dense products msjax computes through one door, `einsum`, so that a drill can make one
process's matmuls slightly wrong on device (msjax.resilience.faults' `corrupt_compute`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_perturbation = 0.0  # 0: exact; set once per process, before anything is traced


def corrupt_matmuls(relative: float) -> None:
    """From now on, every `einsum` this process traces adds `relative` times its output reversed
    along the last axis: a broken device's small, input-dependent error (a uniform scale would
    vanish in the softmax and RMSNorm after it). Call it before the programs are traced."""
    global _perturbation
    _perturbation = float(relative)


def einsum(spec: str, *operands: jax.Array, **options) -> jax.Array:
    """jnp.einsum(spec, *operands, **options), corrupted in a process that `corrupt_matmuls`."""
    out = jnp.einsum(spec, *operands, **options)
    if _perturbation:
        out = out + (_perturbation * jnp.flip(out, axis=-1)).astype(out.dtype)
    return out
