"""Rotary position embeddings: the model's own attention math (attention itself is an op).

The attention that follows them runs through msjax.ops; its plain-JAX reference lives beside the
kernels in pallas_kernels.attention_reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate pairs of features of x by angles that grow with position (RoPE, half-split form).

    x: [batch, seq, heads, head_dim]; positions: [batch, seq].
    """
    head_dim = x.shape[-1]
    half = head_dim // 2
    frequencies = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / head_dim)  # [half]
    angles = positions.astype(jnp.float32)[..., None] * frequencies  # [batch, seq, half]
    sin = jnp.sin(angles)[:, :, None, :]  # [batch, seq, 1, half]
    cos = jnp.cos(angles)[:, :, None, :]
    first, second = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
