"""The 1F1B pipeline schedule as one SPMD program: every iteration each stage runs the forward of
one microbatch and the backward (an explicit vjp) of an earlier one, so a stage keeps the inputs
of at most 2P - 1 microbatches for its backward passes instead of every microbatch's activations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from msjax.parallel.context import constrain
from msjax.parallel.pipeline import (
    PIPE_AXIS,
    PipelineLayout,
    StageFunction,
    merge_microbatches,
    over_replicas,
    replica_stage,
    run_pipeline,
    split_microbatches,
    stage_blocks,
)

# (head parameters, the last stage's output x [batch, seq, embed], targets [batch, seq] int,
#  token weights [batch, seq] float32) -> the weighted sum of the token losses, float32 scalar
HeadFunction = Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]

# (layer parameters in memory order, head parameters, x [batch, seq, embed],
#  (targets, token weights, positions, segment ids or None)) -> summed loss
SummedLoss = Callable[[Any, Any, jax.Array, tuple], jax.Array]

STAGE_ACTIVATIONS = ("stage", "batch", "seq", "act_embed")


def one_f_one_b_loss(
    stage_fn: StageFunction, head_fn: HeadFunction, layout: PipelineLayout, replicas: int = 1
) -> SummedLoss:
    """The summed token loss of the layer stack run as a pipeline, then the head.

    Differentiated, it runs the 1F1B loop once (forward and backward interleaved) and hands the
    gradients it computed to autodiff, scaled by the incoming cotangent; so the caller stays
    `jax.value_and_grad(loss)` and the embedding before x gets its gradient as usual. Evaluated
    without a gradient, it runs the GPipe forward, which keeps no activations anyway.
    replicas: the size of `data` (see run_pipeline).
    """

    @jax.custom_vjp
    def summed_loss(layer_params: Any, head_params: Any, x: jax.Array, labels: tuple) -> jax.Array:
        targets, weights, positions, segment_ids = labels
        y = run_pipeline(
            stage_fn, layer_params, x, positions, segment_ids, layout, replicas=replicas
        )
        return head_fn(head_params, y, targets, weights)

    def forward(
        layer_params: Any, head_params: Any, x: jax.Array, labels: tuple
    ) -> tuple[jax.Array, tuple]:
        return run_one_f_one_b(
            stage_fn, head_fn, layout, layer_params, head_params, x, labels, replicas
        )

    def backward(gradients: tuple, cotangent: jax.Array) -> tuple:
        scaled = jax.tree.map(lambda grad: (grad * cotangent).astype(grad.dtype), gradients)
        return (*scaled, None)  # targets, weights, positions and segments take no gradient

    summed_loss.defvjp(forward, backward)
    return summed_loss


def run_one_f_one_b(
    stage_fn: StageFunction,
    head_fn: HeadFunction,
    layout: PipelineLayout,
    layer_params: Any,
    head_params: Any,
    x: jax.Array,
    labels: tuple,
    replicas: int = 1,
) -> tuple[jax.Array, tuple[Any, Any, jax.Array]]:
    """(summed loss, (gradients of layer_params, of head_params, of x)) by the 1F1B schedule.

    layer_params: a pytree of [layers, ...] arrays, their layer axis sharded over `pipe`.
    Iteration t, stage s (PipelineLayout.forward_at / backward_at):
    - forward of microbatch t - s on what arrived from stage s - 1 (stage 0: the microbatch of
      x), stashing that input in slot m mod stash_slots; the last stage then runs the head and
      its vjp, which gives the cotangent of the microbatch it has just run;
    - backward of microbatch t - (2P - 2 - s): the vjp of the stage function at its stashed
      input (the stage forward is recomputed: stage-level remat) with the cotangent that arrived
      from stage s + 1; weight gradients add up in the loop, the input gradient goes to s - 1.
    Both directions move with one collective permute each per iteration; bubble iterations
    compute on stale values and are masked out, so no stage ever branches.
    """
    targets, weights, positions, segment_ids = labels
    stages, count, slots = layout.stages, layout.microbatches, layout.stash_slots
    # [stages, replicas, layers_per_stage, ...]: device s's block is [s], sharded over `pipe`,
    # a copy per data-parallel replica whose gradients are summed over `data` after the loop
    stage_weights = jax.tree.map(lambda w: w[:, :, 0], stage_blocks(layer_params, layout, replicas))
    # [microbatches, microbatch, seq, embed], on every stage's devices
    inputs = constrain(split_microbatches(x, count), (None, "batch", "seq", "act_embed"))
    positions = split_microbatches(positions, count)  # [microbatches, microbatch, seq]
    segments = None if segment_ids is None else split_microbatches(segment_ids, count)
    targets = split_microbatches(targets, count)  # [microbatches, microbatch, seq]
    weights = split_microbatches(weights, count)  # [microbatches, microbatch, seq]
    stage_ids = jnp.arange(stages)

    def microbatch_of(offset: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(index clipped into range, whether it names a real microbatch)."""
        return jnp.clip(offset, 0, count - 1), (offset >= 0) & (offset < count)

    run_replicas = replica_stage(stage_fn, replicas)
    run_head = over_replicas(head_fn, replicas)
    # [replicas, ...]: as the stage weights, a copy per replica made before the loop, so the
    # head's gradients are summed over `data` once, after it
    replica_head_params = jax.tree.map(
        lambda p: jnp.broadcast_to(p, (replicas, *p.shape)), head_params
    )

    def run_stage(chunk: Any, x: jax.Array, microbatch: jax.Array) -> jax.Array:
        seg = None if segments is None else segments[microbatch]
        return run_replicas(chunk, x, positions[microbatch], seg)

    def stage_step(stage, chunk, arrived, cotangent_in, stash, sums, iteration):
        """One stage's iteration (vmapped over stages): a forward, the head, a backward."""
        grads, head_grads, loss, input_grads = sums
        last = stage == stages - 1
        forward_microbatch, forward_valid = microbatch_of(iteration - stage)
        out = run_stage(chunk, arrived, forward_microbatch)  # [microbatch, seq, embed]
        slot = forward_microbatch % slots
        stash = stash.at[slot].set(jnp.where(forward_valid, arrived, stash[slot]))

        def head(params: Any, y: jax.Array) -> jax.Array:  # params: a copy per replica
            labels = (targets[forward_microbatch], weights[forward_microbatch])
            if replicas == 1:
                return head_fn(jax.tree.map(lambda p: p[0], params), y, *labels)
            return jnp.sum(run_head(params, y, *labels))

        head_loss, head_vjp = jax.vjp(head, replica_head_params, out)
        head_param_grads, head_cotangent = head_vjp(jnp.ones_like(head_loss))
        scored = last & forward_valid
        loss = loss + jnp.where(scored, head_loss, 0.0)
        head_grads = jax.tree.map(
            lambda total, grad: total + jnp.where(scored, grad, 0), head_grads, head_param_grads
        )

        backward_microbatch, backward_valid = microbatch_of(iteration - (2 * stages - 2 - stage))
        cotangent = jnp.where(last, head_cotangent, cotangent_in)
        _, stage_vjp = jax.vjp(
            lambda c, x: run_stage(c, x, backward_microbatch),
            chunk,
            stash[backward_microbatch % slots],
        )
        chunk_grads, input_grad = stage_vjp(cotangent)
        grads = jax.tree.map(
            lambda total, grad: total + jnp.where(backward_valid, grad, 0), grads, chunk_grads
        )
        finished = (stage == 0) & backward_valid  # the gradient w.r.t. x of this microbatch
        input_grads = input_grads.at[backward_microbatch].set(
            jnp.where(finished, input_grad, input_grads[backward_microbatch])
        )
        return out, input_grad, stash, (grads, head_grads, loss, input_grads)

    vmapped_step = jax.vmap(stage_step, in_axes=(0, 0, 0, 0, 0, 0, None), spmd_axis_name=PIPE_AXIS)

    def iteration_body(carry, iteration):
        arrived, cotangent, stash, sums = carry
        out, input_grad, stash, sums = vmapped_step(
            stage_ids, stage_weights, arrived, cotangent, stash, sums, iteration
        )
        # stage s receives stage s - 1's output and stage s + 1's input gradient: one collective
        # permute over `pipe` each way; stage 0 takes the next microbatch instead
        next_microbatch, next_valid = microbatch_of(iteration + 1)
        entering = jnp.where(next_valid, inputs[next_microbatch], 0)  # [microbatch, seq, embed]
        sent = jnp.roll(out, 1, axis=0)
        arrived = constrain(
            jnp.where((stage_ids == 0)[:, None, None, None], entering[None], sent),
            STAGE_ACTIVATIONS,
        )
        cotangent = constrain(jnp.roll(input_grad, -1, axis=0), STAGE_ACTIVATIONS)
        stash = constrain(stash, ("stage", None, "batch", "seq", "act_embed"))
        return (arrived, cotangent, stash, sums), None

    activation = jnp.zeros((stages, *inputs.shape[1:]), inputs.dtype)
    first = constrain(activation.at[0].set(inputs[0]), STAGE_ACTIVATIONS)
    # [stages, stash_slots, microbatch, seq, embed]: each stage's inputs awaiting their backward
    stash = constrain(
        jnp.zeros((stages, slots, *inputs.shape[1:]), inputs.dtype),
        ("stage", None, "batch", "seq", "act_embed"),
    )
    sums = (
        jax.tree.map(jnp.zeros_like, stage_weights),
        jax.tree.map(lambda p: jnp.zeros((stages, *p.shape), p.dtype), replica_head_params),
        jnp.zeros((stages,), jnp.float32),
        # [stages, microbatches, microbatch, seq, embed]: stage 0's gradients w.r.t. x
        constrain(
            jnp.zeros((stages, *inputs.shape), inputs.dtype),
            ("stage", None, "batch", "seq", "act_embed"),
        ),
    )
    carry = (first, constrain(jnp.zeros_like(activation), STAGE_ACTIVATIONS), stash, sums)
    (_, _, _, sums), _ = jax.lax.scan(
        iteration_body, carry, jnp.arange(layout.iterations, dtype=jnp.int32)
    )
    grads, head_grads, loss, input_grads = sums
    layer_grads = jax.tree.map(
        lambda grad, w: jnp.sum(grad, axis=1).reshape(w.shape), grads, layer_params
    )
    # only the last stage's head ran on real microbatches (the others' sums stayed zero)
    head_grads = jax.tree.map(lambda grad: jnp.sum(grad, axis=(0, 1)), head_grads)
    x_grad = merge_microbatches(input_grads[0])
    return jnp.sum(loss), (layer_grads, head_grads, x_grad)
