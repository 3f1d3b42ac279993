"""The experts' grouped matmul in plain JAX that runs only the routed work (`blocks`): rows are
padded per group to whole blocks of `block_rows_for(rows, groups)` rows, and a loop over the
blocks multiplies each by its own group's weights. The backward is the same loop giving each
block's dx and adding its x^T dy into its group's dw, so it keeps no per-block weights.

XLA's CPU `ragged_dot` runs every group's weights on every row (masked); this runs
`padded_rows(rows, groups)` rows once each: the routed rows plus at most block_rows - 1 of
padding per group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Rows per block, largest first: a larger block makes a more efficient batched dot, a smaller
# one less padding (at most block_rows - 1 rows per group).
BLOCK_ROWS_CHOICES = (64, 32, 16, 8)
PADDING_SHARE = 1 / 32  # the padding bound's most, as a share of the rows, where a block fits


def block_rows_for(rows: int, groups: int) -> int:
    """The largest block whose padding bound, groups x (block_rows - 1), is at most
    PADDING_SHARE of the rows (the smallest block where none is)."""
    for block_rows in BLOCK_ROWS_CHOICES:
        if groups * (block_rows - 1) <= rows * PADDING_SHARE:
            return block_rows
    return BLOCK_ROWS_CHOICES[-1]


def block_count(rows: int, groups: int, block_rows: int) -> int:
    """The blocks that hold `rows` rows in `groups` groups, each group padded to whole blocks:
    the static bound ceil((rows + groups * (block_rows - 1)) / block_rows)."""
    return -(-(rows + groups * (block_rows - 1)) // block_rows)


def padded_rows(rows: int, groups: int) -> int:
    """The rows the batched dot multiplies for `rows` rows in `groups` groups, at the block size
    `grouped_matmul_blocks` chooses: block_count x block_rows."""
    block_rows = block_rows_for(rows, groups)
    return block_count(rows, groups, block_rows) * block_rows


def grouped_matmul_blocks(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, block_rows: int | None = None
) -> jax.Array:
    """x [rows, k] in groups of group_sizes [groups] (rows past their sum give zeros), w [groups,
    k, n] -> [rows, n], as `jax.lax.ragged_dot`; block_rows: None for `block_rows_for`."""
    rows, k = x.shape
    groups, _, n = w.shape
    block_rows = block_rows or block_rows_for(rows, groups)
    blocks = block_count(rows, groups, block_rows)
    sizes = group_sizes.astype(jnp.int32)
    padded_sizes = -(-sizes // block_rows) * block_rows  # [groups], whole blocks
    starts = jnp.cumsum(sizes) - sizes  # [groups]: each group's first row in x
    padded_ends = jnp.cumsum(padded_sizes)
    padded_starts = padded_ends - padded_sizes  # [groups]: its first row in the blocks
    slots = jnp.arange(blocks * block_rows, dtype=jnp.int32)  # [blocks * block_rows]
    # each slot's group (groups for the slots past every group's blocks), its row of x or -1
    slot_groups = jnp.searchsorted(padded_ends, slots, side="right").astype(jnp.int32)
    group = jnp.minimum(slot_groups, groups - 1)
    offset = slots - padded_starts[group]
    filled = (slot_groups < groups) & (offset < sizes[group])
    source = jnp.where(filled, starts[group] + offset, rows)  # rows: out of range, gives zeros
    blocked = x.at[source].get(mode="fill", fill_value=0)  # [blocks * block_rows, k]
    block_groups = group[::block_rows]  # [blocks]: a block's rows share one group
    products = _block_matmul(blocked.reshape(blocks, block_rows, k), w, block_groups)
    # each row of x back from its slot; rows past every group read out of range: zeros
    row_ids = jnp.arange(rows, dtype=jnp.int32)
    row_groups = jnp.searchsorted(starts + sizes, row_ids, side="right").astype(jnp.int32)
    row_group = jnp.minimum(row_groups, groups - 1)
    row_slots = row_ids - starts[row_group] + padded_starts[row_group]
    row_slots = jnp.where(row_groups < groups, row_slots, blocks * block_rows)
    flat = products.reshape(blocks * block_rows, n)
    return flat.at[row_slots].get(mode="fill", fill_value=0)


@jax.custom_vjp
def _block_matmul(blocked: jax.Array, w: jax.Array, block_groups: jax.Array) -> jax.Array:
    """blocked [blocks, block_rows, k], w [groups, k, n], block_groups [blocks] -> [blocks,
    block_rows, n]: each block times its group's weights."""
    return _block_products(blocked, w, block_groups)


def _block_products(blocked: jax.Array, w: jax.Array, block_groups: jax.Array) -> jax.Array:
    def multiply(_, block):
        rows, group = block
        return None, jnp.dot(rows, w[group], preferred_element_type=jnp.float32).astype(rows.dtype)

    return lax.scan(multiply, None, (blocked, block_groups))[1]


def _block_matmul_fwd(blocked, w, block_groups):
    return _block_products(blocked, w, block_groups), (blocked, w, block_groups)


def _block_matmul_bwd(residuals, d_products):
    blocked, w, block_groups = residuals

    def block_grads(dw, block):
        rows, d_rows, group = block  # [block_rows, k], [block_rows, n]
        dw = dw.at[group].add(jnp.dot(rows.T, d_rows, preferred_element_type=jnp.float32))
        d_blocked = jnp.dot(d_rows, w[group].T, preferred_element_type=jnp.float32)
        return dw, d_blocked.astype(rows.dtype)

    dw = jnp.zeros(w.shape, jnp.float32)  # [groups, k, n], summed over each group's blocks
    dw, d_blocked = lax.scan(block_grads, dw, (blocked, d_products, block_groups))
    return d_blocked, dw.astype(w.dtype), None


_block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)
