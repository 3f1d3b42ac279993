"""The 1F1B pipeline schedule: each device runs its stage's actions from the schedule table
(msjax.parallel.schedules), one forward or one backward per iteration, branching on its own
action, and keeps each in-flight microbatch's vjp residuals until its backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from msjax.parallel.context import constrain
from msjax.parallel.microbatches import merge_microbatches, split_microbatches
from msjax.parallel.pipeline import (
    ONE_REPLICA,
    PIPE_AXIS,
    PipelineLayout,
    Replicas,
    StageFunction,
    run_pipeline,
    stage_blocks,
)
from msjax.parallel.schedules import FORWARD, GPIPE, HEAD_BRANCH, one_f_one_b_pairs

# (head parameters, the last stage's output x [batch, seq, embed], targets [batch, seq] int,
#  token weights [batch, seq] float32) -> the weighted sum of the token losses, float32 scalar
HeadFunction = Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]

# (layer parameters in memory order, head parameters, x [batch, seq, embed],
#  (targets, token weights, positions, segment ids or None)) -> summed loss
SummedLoss = Callable[[Any, Any, jax.Array, tuple], jax.Array]


def one_f_one_b_loss(
    stage_fn: StageFunction,
    head_fn: HeadFunction,
    layout: PipelineLayout,
    mesh: Any,
    replicas: Replicas = ONE_REPLICA,
) -> SummedLoss:
    """The summed token loss of the layer stack run as a pipeline, then the head.

    Differentiated, it runs the 1F1B loop once (forward and backward interleaved) and hands the
    gradients it computed to autodiff, scaled by the incoming cotangent; so the caller stays
    `jax.value_and_grad(loss)` and the embedding before x gets its gradient as usual. Evaluated
    without a gradient, it runs the GPipe forward, which keeps no activations anyway.
    mesh: the mesh whose `pipe` axis and replicas' axes (`data`, and `fsdp` where the weights
    come gathered whole) the loop is manual over; replicas: see run_pipeline.
    """

    forward_only = dataclasses.replace(layout, schedule=GPIPE)  # evaluation's forward

    @jax.custom_vjp
    def summed_loss(layer_params: Any, head_params: Any, x: jax.Array, labels: tuple) -> jax.Array:
        targets, weights, positions, segment_ids = labels
        y = run_pipeline(
            stage_fn, layer_params, x, positions, segment_ids, forward_only, replicas=replicas
        )
        return head_fn(head_params, y, targets, weights)

    def forward(
        layer_params: Any, head_params: Any, x: jax.Array, labels: tuple
    ) -> tuple[jax.Array, tuple]:
        loop = OneFOneB(stage_fn, head_fn, layout, mesh, replicas.axes)
        return loop.run(layer_params, head_params, x, labels)

    def backward(gradients: tuple, cotangent: jax.Array) -> tuple:
        scaled = jax.tree.map(lambda grad: (grad * cotangent).astype(grad.dtype), gradients)
        return (*scaled, None)  # targets, weights, positions and segments take no gradient

    summed_loss.defvjp(forward, backward)
    return summed_loss


@dataclass(frozen=True)
class Residuals:
    """Where the leaves of a stage run's vjp come from: the stage's weights (leaf index into
    them, read again at the backward) or the stash (None), and the vjp's tree structure."""

    treedef: Any
    weight_leaf: tuple[int | None, ...]

    def stashed(self, leaves: list) -> list:
        return [
            leaf for leaf, weight in zip(leaves, self.weight_leaf, strict=True) if weight is None
        ]

    def vjp(self, stashed: list, chunk: Any) -> Callable:
        weights, kept = jax.tree.leaves(chunk), iter(stashed)
        leaves = [next(kept) if i is None else weights[i] for i in self.weight_leaf]
        return jax.tree.unflatten(self.treedef, leaves)


@dataclass(frozen=True)
class OneFOneB:
    """The 1F1B loop of one step: `run` maps parameters and inputs to the loss and gradients."""

    stage_fn: StageFunction
    head_fn: HeadFunction
    layout: PipelineLayout
    mesh: Any
    replica_axes: tuple[str, ...] = ONE_REPLICA.axes  # Replicas.axes: each rank its own rows

    def run(
        self, layer_params: Any, head_params: Any, x: jax.Array, labels: tuple
    ) -> tuple[jax.Array, tuple[Any, Any, jax.Array]]:
        """(summed loss, (gradients of layer_params, of head_params, of x)).

        layer_params: a pytree of [layers, ...] arrays, their layer axis sharded over `pipe`.
        The loop is a shard_map manual over `pipe` and the replicas' axes (`data`, and `fsdp`
        where the weights come gathered whole; the rest stay with the partitioner): each device
        reads its stage's weights, whole over those axes (each replica its own copy) and its
        replica's rows of every microbatch. The gradients are summed over the replicas' axes
        once, after the loop; the last stage's loss and head gradients and stage 0's input
        gradients are read from those stages.
        """
        count, stages = self.layout.microbatches, self.layout.stages
        targets, weights, positions, segment_ids = labels
        # [stages, layers_per_stage, ...]: device s's block is [s]
        stage_weights = jax.tree.map(
            lambda w: w[:, 0, 0], stage_blocks(layer_params, self.layout, 1)
        )
        microbatches = {  # [microbatches, microbatch, ...], a replica's rows on its devices
            "inputs": constrain(split_microbatches(x, count), (None, "batch", "seq", "act_embed")),
            "positions": split_microbatches(positions, count),
            "targets": split_microbatches(targets, count),
            "weights": split_microbatches(weights, count),
        }
        if segment_ids is not None:
            microbatches["segments"] = split_microbatches(segment_ids, count)
        replicas = self.replica_axes
        pipe, whole, rows = P(PIPE_AXIS), P(), P(None, replicas)
        loop = jax.shard_map(
            self._device_loop,
            mesh=self.mesh,
            in_specs=(pipe, whole, rows),
            out_specs=(pipe, pipe, pipe, P(PIPE_AXIS, None, replicas)),
            axis_names={PIPE_AXIS, *replicas},
            check_vma=False,
        )
        grads, head_grads, loss, input_grads = loop(stage_weights, head_params, microbatches)
        layer_grads = jax.tree.map(lambda grad, w: grad.reshape(w.shape), grads, layer_params)
        head_grads = jax.tree.map(lambda grad: grad[stages - 1], head_grads)
        return loss[stages - 1], (layer_grads, head_grads, merge_microbatches(input_grads[0]))

    def _run_stage(self, chunk: Any, x: jax.Array, microbatches: dict, index: jax.Array) -> Any:
        segments = microbatches.get("segments")
        segment_ids = None if segments is None else segments[index]
        return self.stage_fn(chunk, x, microbatches["positions"][index], segment_ids)

    def _forward(self, chunk: Any, x: jax.Array, microbatches: dict, index: jax.Array) -> tuple:
        """(stage output, its vjp's leaves): the stage runs once, its residuals kept."""
        out, vjp = jax.vjp(lambda c, x: self._run_stage(c, x, microbatches, index), chunk, x)
        return out, jax.tree.leaves(vjp)

    def _residuals(self, chunk: Any, microbatches: dict) -> tuple[Residuals, list]:
        """The vjp's structure (traced once, on microbatch 0) and its stashed leaves' shapes."""
        found: list[Residuals] = []
        x = microbatches["inputs"][0]

        def probe(chunk: Any, x: jax.Array) -> list:
            _, vjp = jax.vjp(
                lambda c, x: self._run_stage(c, x, microbatches, jnp.int32(0)), chunk, x
            )
            leaves, treedef = jax.tree.flatten(vjp)
            weights = jax.tree.leaves(chunk)
            weight_leaf = tuple(
                next((i for i, w in enumerate(weights) if leaf is w), None) for leaf in leaves
            )
            found.append(Residuals(treedef, weight_leaf))
            return found[0].stashed(leaves)

        shapes = jax.eval_shape(probe, chunk, x)
        return found[0], shapes

    def _device_loop(self, stage_weights: Any, head_params: Any, microbatches: dict) -> tuple:
        """One device's loop over the table (inside the shard_map): its stage's weights
        [1, layers_per_stage, ...] -> its sums over its replica's rows, each summed over the
        replicas' axes and given a leading axis of 1 (stage 0's input gradients stay its
        replica's)."""
        layout, table = self.layout, self.layout.table
        stage = jax.lax.axis_index(PIPE_AXIS)
        chunk = jax.tree.map(lambda w: w[0], stage_weights)  # [layers_per_stage, ...]
        residuals, shapes = self._residuals(chunk, microbatches)
        inputs = microbatches["inputs"]
        stash = [jnp.zeros((table.stash_slots, *s.shape), s.dtype) for s in shapes]
        sums = (
            jax.tree.map(jnp.zeros_like, chunk),
            jax.tree.map(jnp.zeros_like, head_params),
            jnp.zeros((), jnp.float32),
            jnp.zeros_like(inputs),  # stage 0's gradients of the microbatches' inputs
        )
        branches = self._branches(chunk, head_params, microbatches, residuals, stage)
        actions = jnp.asarray(table.actions)

        def iteration(carry: tuple, index: jax.Array, parity: int) -> tuple:
            arrived, stash, sums = carry
            kind, microbatch, _, slot = (actions[index, stage, c] for c in range(4))
            last_forward = (kind == FORWARD) & (stage == layout.stages - 1)
            branch = jnp.where(last_forward, HEAD_BRANCH, kind)
            slot = jnp.maximum(slot, 0)
            # the branch reads and writes one slot, updated in place here, outside it
            held = [s[slot] for s in stash]
            send, keep, held, sums = jax.lax.switch(
                branch, branches, arrived, held, sums, microbatch
            )
            stash = [s.at[slot].set(h) for s, h in zip(stash, held, strict=True)]
            received = jax.lax.ppermute(send, PIPE_AXIS, one_f_one_b_pairs(layout.stages, parity))
            # the last stage's forward turns its microbatch round: the head's gradient is what
            # its next iteration, that microbatch's backward, starts from
            return jnp.where(last_forward, keep, received), stash, sums

        def two_iterations(carry: tuple, pair: jax.Array) -> tuple[tuple, None]:
            # the transfer's pairs alternate with the iteration's parity (one_f_one_b_pairs)
            carry = iteration(carry, 2 * pair, 0)
            return iteration(carry, 2 * pair + 1, 1), None

        carry = (jnp.zeros_like(inputs[0]), stash, sums)
        pairs = jnp.arange(table.iterations // 2, dtype=jnp.int32)
        (_, _, sums), _ = jax.lax.scan(two_iterations, carry, pairs)
        grads, head_grads, loss, input_grads = jax.lax.psum(sums[:3], self.replica_axes) + sums[3:]
        return jax.tree.map(lambda a: a[None], (grads, head_grads, loss, input_grads))

    def _branches(
        self, chunk: Any, head_params: Any, microbatches: dict, residuals: Residuals, stage: Any
    ) -> list[Callable]:
        """The switch's branches: (arrived, the action's stash slot, sums, microbatch) -> (what
        to send, what the device keeps for its next iteration, the slot, sums)."""
        inputs = microbatches["inputs"]
        zeros = jnp.zeros_like(inputs[0])

        def idle(arrived, held, sums, microbatch):
            return zeros, zeros, held, sums

        def forward(arrived, held, sums, microbatch):
            x = jnp.where(stage == 0, inputs[microbatch], arrived)
            out, leaves = self._forward(chunk, x, microbatches, microbatch)
            return out, zeros, residuals.stashed(leaves), sums

        def forward_and_head(arrived, held, sums, microbatch):
            out, leaves = self._forward(chunk, arrived, microbatches, microbatch)
            labels = (microbatches["targets"][microbatch], microbatches["weights"][microbatch])
            head_loss, head_vjp = jax.vjp(
                lambda params, y: self.head_fn(params, y, *labels), head_params, out
            )
            head_grads, cotangent = head_vjp(jnp.ones_like(head_loss))
            grads, total_head_grads, loss, input_grads = sums
            total_head_grads = jax.tree.map(jnp.add, total_head_grads, head_grads)
            sums = (grads, total_head_grads, loss + head_loss, input_grads)
            return zeros, cotangent.astype(zeros.dtype), residuals.stashed(leaves), sums

        def backward(arrived, held, sums, microbatch):
            vjp = residuals.vjp(held, chunk)
            chunk_grads, input_grad = vjp(arrived)
            grads, head_grads, loss, input_grads = sums
            grads = jax.tree.map(jnp.add, grads, chunk_grads)
            input_grads = input_grads.at[microbatch].set(input_grad)  # read from stage 0 only
            return input_grad, zeros, held, (grads, head_grads, loss, input_grads)

        return [idle, forward, backward, forward_and_head]  # IDLE_BRANCH ... HEAD_BRANCH
