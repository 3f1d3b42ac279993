"""Expert parallelism's token exchange over the `expert` mesh axis, inside a shard_map: each
device sends every token choice to the device that holds its expert by one dense all-to-all and
gets the experts' outputs back by another. The experts' own math is the caller's (msjax.ops).

The buffers are dense, one per destination device (XLA:CPU has no ragged all-to-all): as long as
the caller says, the worst case when dropless (every local choice to one device) or the
destination's experts' capacity when a capacity factor caps them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Sent(NamedTuple):
    """Where this device's token choices went: what `return_outputs` brings the outputs back by."""

    order: jax.Array  # [choices] int32: the choices (token-major) sorted by expert, stably
    destination: jax.Array  # [choices] in that order: the device holding each choice's expert
    slot: jax.Array  # [choices] in that order: the choice's row in its destination's buffer


class Received(NamedTuple):
    """The token rows this device's experts run, from every device of the axis."""

    rows: jax.Array  # [devices * buffer_rows, embed]; empty slots are zeros
    local_experts: jax.Array  # [devices * buffer_rows] int32: the row's expert on this device,
    # experts_here (past every local expert) for an empty slot


def buffer_rows(local_choices: int, experts_here: int, capacity: int | None) -> int:
    """Rows of one destination's buffer: every local choice (dropless), or at most the
    destination's experts' capacity (each expert takes `capacity` choices of the whole batch)."""
    if capacity is None:
        return local_choices
    return min(local_choices, experts_here * capacity)


def send_to_experts(
    tokens: jax.Array, experts: jax.Array, num_experts: int, axis: str, rows_per_device: int
) -> tuple[Received, Sent]:
    """tokens [tokens, embed], experts [tokens, k] int32 (num_experts for a dropped choice, which
    is sent nowhere) -> the rows this device's experts run, and how to send their outputs back.

    Experts are held in order: device d of the axis holds experts [d E/D, (d + 1) E/D)."""
    devices = jax.lax.axis_size(axis)
    experts_here = num_experts // devices
    k, embed = experts.shape[-1], tokens.shape[-1]
    choices = experts.reshape(-1)  # [tokens * k], token-major
    order = jnp.argsort(choices, stable=True)
    sorted_experts = choices[order]
    destination = sorted_experts // experts_here  # a dropped choice: `devices`, past them all
    counts = jnp.bincount(destination, length=devices + 1)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(choices.size) - starts[destination]  # place in its destination's buffer
    shape = (devices, rows_per_device)
    # out-of-range places (the dropped choices' destination) are left out by mode="drop"
    rows = jnp.zeros((*shape, embed), tokens.dtype)
    rows = rows.at[destination, slot].set(tokens[order // k], mode="drop")
    local = jnp.full(shape, experts_here, jnp.int32)
    local = local.at[destination, slot].set(sorted_experts % experts_here, mode="drop")
    # [devices, rows_per_device, ...]: row block d goes to device d; block s came from device s
    rows = jax.lax.all_to_all(rows, axis, 0, 0, tiled=True)
    local = jax.lax.all_to_all(local, axis, 0, 0, tiled=True)
    received = Received(rows.reshape(-1, embed), local.reshape(-1))
    return received, Sent(order.astype(jnp.int32), destination, slot)


def return_outputs(outputs: jax.Array, sent: Sent, axis: str, k: int) -> jax.Array:
    """The experts' outputs [devices * rows_per_device, embed] (in `Received.rows` order) back to
    the devices their tokens came from -> [tokens, k, embed] per choice, zeros where dropped."""
    devices = jax.lax.axis_size(axis)
    embed = outputs.shape[-1]
    back = jax.lax.all_to_all(outputs.reshape(devices, -1, embed), axis, 0, 0, tiled=True)
    # back[d, s]: the output of what this device sent to device d in slot s
    in_sorted_order = back.at[sent.destination, sent.slot].get(mode="fill", fill_value=0)
    in_token_order = jnp.zeros_like(in_sorted_order).at[sent.order].set(in_sorted_order)
    return in_token_order.reshape(-1, k, embed)
