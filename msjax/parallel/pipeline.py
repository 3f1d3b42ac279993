"""Pipeline parallelism over the `pipe` mesh axis: GPipe and circular (interleaved) schedules
run as one SPMD program, the layout every schedule shares (1F1B's loop lives in
msjax.parallel.one_f_one_b), and the layer order that keeps each stage's layers on its devices.

The model is not involved beyond a stage function (layer parameters, activations) -> activations;
everything inside a stage still composes with fsdp, tensor and sequence parallelism and remat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from msjax.config import Config
from msjax.parallel.context import constrain
from msjax.parallel.schedules import IDLE, ScheduleTable, schedule_table

PIPE_AXIS = "pipe"

# (parameters of one stage's layers [layers_per_stage, ...], x [microbatch, seq, embed],
#  positions [microbatch, seq], segment ids [microbatch, seq] or None) -> x
StageFunction = Callable[[Any, jax.Array, jax.Array, jax.Array | None], jax.Array]


@dataclass(frozen=True)
class PipelineLayout:
    """P stages, R virtual stages (repeats) per device, M microbatches, L layers, a schedule.

    Virtual stage v = r P + s (device s, repeat r) runs layers [v K, (v + 1) K), K = L / (P R):
    GPipe and 1F1B are R = 1; circular gives device s the layers s, s + P, ... in chunks of K.
    """

    stages: int
    repeats: int
    microbatches: int
    num_layers: int
    schedule: str = "gpipe"  # PipelineConfig.schedule: gpipe, circular or 1f1b

    @classmethod
    def of(cls, config: Config) -> PipelineLayout:
        pipeline = config.pipeline
        repeats = pipeline.repeats if pipeline.schedule == "circular" else 1
        return cls(
            config.mesh.pipe,
            repeats,
            pipeline.microbatches,
            config.model.num_layers,
            pipeline.schedule,
        )

    @property
    def table(self) -> ScheduleTable:
        """What every stage runs in every iteration, and the schedule's facts
        (msjax.parallel.schedules); the loops execute it."""
        return schedule_table(self.schedule, self.stages, self.repeats, self.microbatches)

    @property
    def interleaves_backward(self) -> bool:
        """Whether the loop runs each microbatch's backward pass too (1F1B), not autodiff."""
        return self.table.runs_backward

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // (self.stages * self.repeats)

    @property
    def forward_iterations(self) -> int:
        """Loop iterations of a forward pass alone (GPipe, circular): R M + P - 1."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def iterations(self) -> int:
        """Loop iterations of the schedule: R M + P - 1 (each run once forward, once backward
        under autodiff), or 2(M + P - 1) for 1F1B (each one forward or one backward)."""
        return self.table.iterations

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-iterations idle: (P - 1) / (R M + P - 1), and for 1F1B
        (P - 1) / (M + P - 1) as well (its iterations are half as long)."""
        return self.table.bubble_fraction

    @property
    def stash_slots(self) -> int:
        """1F1B: microbatches a stage keeps what their backward needs for, min(M, P)."""
        return self.table.stash_slots

    def work_at(self, iteration: int, stage: int) -> tuple[int, int] | None:
        """(microbatch, repeat) that a stage works on in an iteration, or None when idle."""
        kind, microbatch, repeat, _ = self.table.at(iteration, stage)
        return None if kind == IDLE else (microbatch, repeat)

    def memory_order(self) -> np.ndarray:
        """The canonical layer index held at each position of the stacked layer axis in memory.

        Memory is stage-major (device s's layers are one contiguous block, so sharding the layer
        axis over `pipe` puts them there): position (s, r, k) holds layer (r P + s) K + k.
        """
        stages, repeats, per_stage = self.stages, self.repeats, self.layers_per_stage
        s, r, k = np.meshgrid(
            np.arange(stages), np.arange(repeats), np.arange(per_stage), indexing="ij"
        )
        return ((r * stages + s) * per_stage + k).reshape(-1)

    @property
    def reorders_layers(self) -> bool:
        """Whether memory order differs from canonical order (circular with R > 1)."""
        return self.stages > 1 and self.repeats > 1


def to_memory_order(stacked: jax.Array, layout: PipelineLayout) -> jax.Array:
    """A canonical [layers, ...] array in the stage-major order the pipeline keeps in memory."""
    if not layout.reorders_layers:
        return stacked
    return jnp.take(stacked, jnp.asarray(layout.memory_order()), axis=0)


def to_canonical_order(stacked: jax.Array, layout: PipelineLayout) -> jax.Array:
    """The inverse of to_memory_order: [layers, ...] in canonical layer order (for checkpoints)."""
    if not layout.reorders_layers:
        return stacked
    return jnp.take(stacked, jnp.asarray(np.argsort(layout.memory_order())), axis=0)


def split_microbatches(x: jax.Array, count: int) -> jax.Array:
    """[batch, ...] -> [count, batch / count, ...]; microbatch i takes rows i, i + count, ...

    Strided so that each data-parallel replica's rows (a contiguous block) contribute equally to
    every microbatch: the split moves no data between devices.
    """
    return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of split_microbatches."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def stage_blocks(layer_params: Any, layout: PipelineLayout, replicas: int) -> Any:
    """[layers, ...] arrays in memory order -> [stages, replicas, repeats, layers_per_stage, ...].

    Device s's block is [s], sharded over `pipe`. The copies per data-parallel replica are made
    here, before any pipeline loop, so their gradients accumulate per replica inside it and are
    summed (one all-reduce over `data`) only after it.
    """
    stages, repeats, per_stage = layout.stages, layout.repeats, layout.layers_per_stage
    return jax.tree.map(
        lambda w: jnp.broadcast_to(
            w.reshape(stages, 1, repeats, per_stage, *w.shape[1:]),
            (stages, replicas, repeats, per_stage, *w.shape[1:]),
        ),
        layer_params,
    )


def over_replicas(fn: Callable[..., Any], replicas: int) -> Callable[..., Any]:
    """fn(params, *rows) run by each data-parallel replica on its own rows with its own params.

    The returned function takes params stacked [replicas, ...] and arrays whose rows are
    replica-major (None passes through) and returns fn's results stacked [replicas, ...]; fn is
    vmapped with spmd axis `data`, so it runs under
    `msjax.parallel.rules.placement_within_replica`.
    """

    def run(params: Any, *rows: jax.Array | None) -> Any:
        def split(a: jax.Array | None) -> jax.Array | None:
            return None if a is None else a.reshape(replicas, a.shape[0] // replicas, *a.shape[1:])

        return jax.vmap(fn, spmd_axis_name="data")(params, *(split(a) for a in rows))

    return run


def replica_stage(stage_fn: StageFunction, replicas: int) -> StageFunction:
    """stage_fn over a microbatch, each data-parallel replica's rows with its own weights: the
    returned function takes a chunk of [replicas, layers_per_stage, ...] arrays."""
    vmapped = over_replicas(stage_fn, replicas)

    def run(chunk: Any, x: jax.Array, positions: jax.Array, segment_ids: Any) -> jax.Array:
        if replicas == 1:
            return stage_fn(jax.tree.map(lambda w: w[0], chunk), x, positions, segment_ids)
        return vmapped(chunk, x, positions, segment_ids).reshape(x.shape)

    return run


def run_pipeline(
    stage_fn: StageFunction,
    layer_params: Any,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    layout: PipelineLayout,
    checkpoint_policy: Callable[..., bool] | None = None,
    replicas: int = 1,
) -> jax.Array:
    """The layer stack over x [batch, seq, embed] as a pipeline; same result as running it whole.

    layer_params: a pytree of [layers, ...] arrays in memory order (to_memory_order), their layer
    axis sharded over `pipe`. Each iteration every stage runs its layers on its current
    microbatch (one vmapped call, the stage axis split over `pipe`), then activations move one
    stage on with a collective permute. The last stage's output of a microbatch that has repeats
    left returns to stage 0 through a per-device buffer, read M - P + 1 iterations after it was
    sent (MegaScale §3.3: send and receive decoupled); every other transfer is consumed in the
    next iteration, where the next stage needs it.

    checkpoint_policy (circular): what a stage run keeps for the backward pass, as the stage
    function's own remat would (a policy from msjax.models.transformer.enclosing_checkpoint_policy).
    With it, a run's selected chunk of weights is selected again in the backward pass instead of
    being kept: without it the loop keeps every iteration's chunk, (R M + P - 1) / R times the
    device's layer weights.

    replicas: the size of `data`. Each data-parallel replica works on its own copy of its stage's
    weights (stage_blocks, replica_stage), so the weight gradients are summed over `data` once
    per step, after the loop, not once per iteration.
    """
    stages, repeats, count = layout.stages, layout.repeats, layout.microbatches
    # [stages, replicas, repeats, layers_per_stage, ...]
    weights = stage_blocks(layer_params, layout, replicas)
    # [microbatches, microbatch, seq, embed], on every stage's devices
    inputs = constrain(split_microbatches(x, count), (None, "batch", "seq", "act_embed"))
    positions = split_microbatches(positions, count)  # [microbatches, microbatch, seq]
    segments = None if segment_ids is None else split_microbatches(segment_ids, count)
    stage_ids = jnp.arange(stages)
    # [stages, microbatches, microbatch, seq, embed]: one per stage, each on its own devices
    per_stage_buffer = constrain(
        jnp.zeros((stages, *inputs.shape), inputs.dtype),
        ("stage", None, "batch", "seq", "act_embed"),
    )
    stage_activations = ("stage", "batch", "seq", "act_embed")

    def work(stage: jax.Array, iteration: jax.Array) -> tuple[jax.Array, ...]:
        virtual = iteration - stage
        valid = (virtual >= 0) & (virtual < repeats * count)
        virtual = jnp.clip(virtual, 0, repeats * count - 1)
        return virtual % count, virtual // count, valid

    run_replicas = replica_stage(stage_fn, replicas)

    def run_stage(stage_weights, repeat, state, microbatch_positions, microbatch_segments):
        # [replicas, layers_per_stage, ...]; a static index when there is one repeat (no gather,
        # and no scatter of its gradient)
        chunk = jax.tree.map(lambda w: w[:, repeat] if repeats > 1 else w[:, 0], stage_weights)
        # [microbatch, seq, embed]
        return run_replicas(chunk, state, microbatch_positions, microbatch_segments)

    if repeats > 1 and checkpoint_policy is not None:
        run_stage = jax.checkpoint(run_stage, policy=checkpoint_policy, prevent_cse=False)

    def stage_step(stage, stage_weights, state, outputs, iteration):
        """One stage's iteration (vmapped over stages): run its layers, keep finished outputs."""
        microbatch, repeat, valid = work(stage, iteration)
        seg = None if segments is None else segments[microbatch]
        out = run_stage(stage_weights, repeat, state, positions[microbatch], seg)
        finished = valid & (repeat == repeats - 1)
        outputs = outputs.at[microbatch].set(jnp.where(finished, out, outputs[microbatch]))
        return out, outputs

    # every stage's own view of the inputs (only stage 0 reads its): their gradients then
    # accumulate per stage through the loop and are summed over `pipe` once, after it
    inputs_by_stage = constrain(
        jnp.broadcast_to(inputs, (stages, *inputs.shape)),
        ("stage", None, "batch", "seq", "act_embed"),
    )

    def receive(stage, stage_inputs, arrived, returned, iteration):
        """What a stage works on next: stage 0 a new microbatch or one returning for its next
        repeat, every other stage what the previous stage just sent."""
        next_iteration = iteration + 1
        if repeats > 1:
            # the last stage's output of this iteration waits here until its microbatch's turn
            sent_microbatch, _, _ = work(jnp.int32(stages - 1), iteration)
            returned = returned.at[sent_microbatch].set(arrived)
        microbatch, repeat, _ = work(jnp.int32(0), next_iteration)
        entering = jnp.where(next_iteration < count, stage_inputs[microbatch], 0)
        if repeats > 1:
            entering = jnp.where(repeat == 0, entering, returned[microbatch])
        return jnp.where(stage == 0, entering, arrived), returned

    vmapped_step = jax.vmap(stage_step, in_axes=(0, 0, 0, 0, None), spmd_axis_name=PIPE_AXIS)
    vmapped_receive = jax.vmap(receive, in_axes=(0, 0, 0, 0, None), spmd_axis_name=PIPE_AXIS)

    def iteration_body(carry, iteration):
        state, returned, outputs = carry
        out, outputs = vmapped_step(stage_ids, weights, state, outputs, iteration)
        # stage s receives stage s - 1's output: a collective permute over `pipe`
        if repeats > 1:  # the last stage's output returns to stage 0 for its next repeat
            arrived = jnp.roll(out, 1, axis=0)
        else:  # GPipe: nothing wraps around, so the last stage sends nothing
            arrived = jnp.pad(out[:-1], ((1, 0),) + ((0, 0),) * (out.ndim - 1))
        arrived = constrain(arrived, stage_activations)
        state, returned = vmapped_receive(stage_ids, inputs_by_stage, arrived, returned, iteration)
        state = constrain(state, stage_activations)
        return (state, returned, outputs), None

    first = jnp.zeros((stages, *inputs.shape[1:]), inputs.dtype).at[0].set(inputs[0])
    first = constrain(first, stage_activations)
    returned = per_stage_buffer if repeats > 1 else jnp.zeros((stages, 1), inputs.dtype)
    carry = (first, returned, per_stage_buffer)
    (_, _, outputs), _ = jax.lax.scan(
        iteration_body, carry, jnp.arange(layout.forward_iterations, dtype=jnp.int32)
    )
    return merge_microbatches(outputs[stages - 1])
