"""A grouped matmul in Pallas: row group g of x times w[g], the experts of a mixture of experts.

Rows are grouped contiguously as in `jax.lax.ragged_dot` (`reference`): group_sizes [groups]
counts the rows of each group in order, and rows past their sum give zeros. The backward is two
more kernels: dx is the same grouped matmul against w transposed, dw[g] = x_g^T @ dy_g walks the
row blocks of group g alone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

BLOCK_ROWS = 16  # rows one program multiplies; a block spanning a group boundary runs both


def reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [rows, k], its rows in groups of group_sizes [groups]; w [groups, k, n] -> [rows, n]."""
    return lax.ragged_dot(x, w, group_sizes.astype(jnp.int32))


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, interpret: bool = False
) -> jax.Array:
    """The kernel form of `reference`, differentiable in x and w."""
    return _grouped_matmul(x, w, group_sizes.astype(jnp.int32), interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul(x, w, group_sizes, interpret):
    return _forward(x, w, group_sizes, interpret)


def _grouped_matmul_fwd(x, w, group_sizes, interpret):
    return _forward(x, w, group_sizes, interpret), (x, w, group_sizes)


def _grouped_matmul_bwd(interpret, residuals, dy):
    x, w, group_sizes = residuals
    dx = _forward(dy, jnp.swapaxes(w, 1, 2), group_sizes, interpret).astype(x.dtype)
    dw = _group_weight_grads(x, dy, group_sizes, interpret).astype(w.dtype)
    return dx, dw, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def _padded_rows(array: jax.Array, rows: int) -> jax.Array:
    return jnp.pad(array, ((0, rows - array.shape[0]),) + ((0, 0),) * (array.ndim - 1))


def _row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """[rows] int32: each row's group; len(group_sizes) for rows past every group."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right").astype(jnp.int32)


def _forward(x: jax.Array, w: jax.Array, group_sizes: jax.Array, interpret: bool) -> jax.Array:
    rows, k = x.shape
    groups, _, n = w.shape
    padded = pl.cdiv(rows, BLOCK_ROWS) * BLOCK_ROWS
    row_groups = _row_groups(group_sizes, padded)  # [padded]

    def kernel(x_ref, w_ref, groups_ref, out_ref):
        block_groups = groups_ref[...]  # [BLOCK_ROWS], sorted
        first = jnp.min(block_groups)
        last = jnp.minimum(jnp.max(block_groups), groups - 1)
        x_block = x_ref[...]

        def add_group(group, total):
            product = jnp.dot(x_block, w_ref[group], preferred_element_type=jnp.float32)
            return total + jnp.where((block_groups == group)[:, None], product, 0.0)

        total = lax.fori_loop(first, last + 1, add_group, jnp.zeros((BLOCK_ROWS, n), jnp.float32))
        out_ref[...] = total.astype(out_ref.dtype)

    out = pl.pallas_call(
        kernel,
        grid=(padded // BLOCK_ROWS,),
        in_specs=[
            pl.BlockSpec((BLOCK_ROWS, k), lambda block: (block, 0)),
            pl.BlockSpec((groups, k, n), lambda block: (0, 0, 0)),
            pl.BlockSpec((BLOCK_ROWS,), lambda block: (block,)),
        ],
        out_specs=pl.BlockSpec((BLOCK_ROWS, n), lambda block: (block, 0)),
        out_shape=jax.ShapeDtypeStruct((padded, n), x.dtype),
        interpret=interpret,
    )(_padded_rows(x, padded), w, row_groups)
    return out[:rows]


def _group_weight_grads(
    x: jax.Array, dy: jax.Array, group_sizes: jax.Array, interpret: bool
) -> jax.Array:
    """[groups, k, n]: x_g^T @ dy_g for each group g, one program per group."""
    rows, k = x.shape
    n = dy.shape[1]
    groups = group_sizes.shape[0]
    padded = pl.cdiv(rows, BLOCK_ROWS) * BLOCK_ROWS
    row_groups = _row_groups(group_sizes, padded)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes)])

    def kernel(x_ref, dy_ref, groups_ref, offsets_ref, out_ref):
        group = pl.program_id(0)
        start, end = offsets_ref[group], offsets_ref[group + 1]

        def add_block(block, total):
            window = pl.ds(pl.multiple_of(block * BLOCK_ROWS, BLOCK_ROWS), BLOCK_ROWS)
            mine = (groups_ref[window] == group)[:, None]
            x_block = jnp.where(mine, x_ref[window, :], 0.0)
            return total + jnp.dot(x_block.T, dy_ref[window, :], preferred_element_type=jnp.float32)

        blocks = (start // BLOCK_ROWS, pl.cdiv(end, BLOCK_ROWS))
        total = lax.fori_loop(*blocks, add_block, jnp.zeros((k, n), jnp.float32))
        out_ref[...] = total[None].astype(out_ref.dtype)

    return pl.pallas_call(
        kernel,
        grid=(groups,),
        in_specs=[
            pl.BlockSpec((padded, k), lambda group: (0, 0)),
            pl.BlockSpec((padded, n), lambda group: (0, 0)),
            pl.BlockSpec((padded,), lambda group: (0,)),
            pl.BlockSpec((groups + 1,), lambda group: (0,)),
        ],
        out_specs=pl.BlockSpec((1, k, n), lambda group: (group, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((groups, k, n), jnp.float32),
        interpret=interpret,
    )(_padded_rows(x, padded), _padded_rows(dy, padded), row_groups, offsets)
