"""A batch cut into microbatches, and the microbatches arranged as a pipeline's stages hold them:
row orders that split over `pipe` and `data` without moving data between devices. Arrays and
counts only; the pipeline's layout and loops are msjax.parallel.pipeline's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def split_microbatches(x: jax.Array, count: int) -> jax.Array:
    """[batch, ...] -> [count, batch / count, ...]; microbatch i takes rows i, i + count, ...

    Strided so that each data-parallel replica's rows (a contiguous block) contribute equally to
    every microbatch: the split moves no data between devices.
    """
    return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of split_microbatches."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def arrange_microbatches(x: jax.Array, cells: np.ndarray, count: int) -> jax.Array:
    """[batch, ...] -> [stages * slots, batch / count, ...]: cell c holds microbatch cells[c] of
    split_microbatches(x, count) (-1: zeros). A static gather along the microbatch axis, so with
    the rows split over `data` it moves nothing between devices."""
    microbatches = split_microbatches(x, count)
    padded = jnp.concatenate([microbatches, jnp.zeros_like(microbatches[:1])])
    return jnp.take(padded, jnp.asarray(np.where(cells < 0, len(microbatches), cells)), axis=0)


def cells_to_rows(cells: jax.Array, stages: int) -> jax.Array:
    """[stages * slots, microbatch, ...] -> [stages * microbatch * slots, ...]: rows in an order
    that splits them over `pipe` (stage-major) and then over `data` (within a microbatch)."""
    slots, microbatch = cells.shape[0] // stages, cells.shape[1]
    by_stage = cells.reshape(stages, slots, microbatch, *cells.shape[2:])
    return jnp.swapaxes(by_stage, 1, 2).reshape(stages * microbatch * slots, *cells.shape[2:])


def streams_to_rows(streams: jax.Array) -> jax.Array:
    """[stages, slots, microbatch, ...] -> rows as cells_to_rows orders them."""
    return cells_to_rows(streams.reshape(-1, *streams.shape[2:]), streams.shape[0])
