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

    @property
    def slots_per_stage(self) -> int:
        """Microbatches each stage holds of the pipeline's inputs and outputs: ceil(M / P)."""
        return -(-self.microbatches // self.stages)

    @property
    def return_slots(self) -> int:
        """Circular: iterations a microbatch waits between leaving the last stage and entering
        stage 0 again, M - P + 1, so the ring where it waits holds that many."""
        return self.microbatches - self.stages + 1

    def input_cells(self) -> np.ndarray:
        """[stages * slots]: the microbatch each stream cell holds before the loop (-1: none).

        Cell (s, i) holds microbatch s slots + i: stage 0 reads cell t mod slots at iteration
        t, and each visit moves a column one stage back, so microbatch t is there in time.
        """
        cells = np.arange(self.stages * self.slots_per_stage)
        return np.where(cells < self.microbatches, cells, -1)

    def output_cells(self) -> np.ndarray:
        """[stages * slots]: the microbatch whose finished output each stream cell holds after
        the loop (-1: none), as run_streams moves them: iteration t shifts column t mod slots
        one stage back and puts the last stage's output in its last cell."""
        slots = self.slots_per_stage
        cells = np.full((self.stages, slots), -1)
        for iteration in range(self.forward_iterations):
            column = iteration % slots
            cells[:-1, column] = cells[1:, column]
            work = self.work_at(iteration, self.stages - 1)
            finished = work is not None and work[1] == self.repeats - 1
            cells[-1, column] = work[0] if finished else -1
        held = sorted(cells[cells >= 0].tolist())
        assert held == list(range(self.microbatches)), f"outputs lost: {cells}"
        return cells.reshape(-1)

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


# a stage's activations [stages, microbatch, seq, embed], and the microbatch streams
# [stages, slots, microbatch, seq, embed]: split over `pipe` by stage, along the sequence over
# `tensor` under sequence parallelism as between any two blocks
# (Megatron's scatter/gather: each tensor rank sends 1 / tensor of a stage's activations)
STAGE_ACTIVATIONS = ("stage", "batch", "residual_seq", "act_embed")
STREAMS = ("stage", None, "batch", "residual_seq", "act_embed")


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


def rows_to_streams(rows: jax.Array, layout: PipelineLayout) -> jax.Array:
    """The inverse of cells_to_rows, as streams [stages, slots, microbatch, ...]."""
    stages, slots = layout.stages, layout.slots_per_stage
    by_stage = rows.reshape(stages, rows.shape[0] // (stages * slots), slots, *rows.shape[1:])
    return jnp.swapaxes(by_stage, 1, 2)


def streams_to_rows(streams: jax.Array) -> jax.Array:
    """[stages, slots, microbatch, ...] -> rows as cells_to_rows orders them."""
    return cells_to_rows(streams.reshape(-1, *streams.shape[2:]), streams.shape[0])


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
    """The layer stack over x [batch, seq, embed] as a pipeline (run_streams); same result as
    running it whole, on every pipe rank (the outputs are gathered from the stages that hold
    them: for a caller that needs them all, such as 1F1B's evaluation)."""
    count = layout.microbatches
    streams = arrange_microbatches(x, layout.input_cells(), count).reshape(
        layout.stages, layout.slots_per_stage, x.shape[0] // count, *x.shape[1:]
    )
    outputs = run_streams(
        stage_fn, layer_params, streams, positions, segment_ids, layout, checkpoint_policy, replicas
    )
    cells = outputs.reshape(-1, *outputs.shape[2:])  # [stages * slots, microbatch, ...]
    where = [int(np.flatnonzero(layout.output_cells() == m)[0]) for m in range(count)]
    return merge_microbatches(jnp.take(cells, jnp.asarray(where), axis=0))


def run_streams(
    stage_fn: StageFunction,
    layer_params: Any,
    streams: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    layout: PipelineLayout,
    checkpoint_policy: Callable[..., bool] | None = None,
    replicas: int = 1,
) -> jax.Array:
    """The layer stack as a pipeline over microbatch streams held by the stages.

    streams [stages, slots, microbatch, seq, embed], split over `pipe`: cell (s, i) holds
    microbatch input_cells()[s * slots + i]; each stage holds slots = ceil(M / P) microbatches
    (MaxText's state_io), not all M. Returns the finished outputs in the same shape, cell c
    holding microbatch output_cells()[c]'s (-1: nothing), each still on the stage that holds
    it, so a loss head after the loop runs on 1 / P of the tokens per stage.

    layer_params: a pytree of [layers, ...] arrays in memory order (to_memory_order), their layer
    axis sharded over `pipe`. Iteration t: stage 0 takes microbatch t from its own cell t mod
    slots (circular, for a later repeat: what the last stage sent M - P + 1 iterations before,
    kept in a ring of that many), every other stage what the previous stage sent; every stage
    runs its layers (one vmapped call, the stage axis split over `pipe`); its output moves one
    stage on, and column t mod slots of the streams moves one stage back, the last stage's
    output joining it: two collective permutes of a microbatch per iteration, and no transfer
    of the whole batch before or after the loop.

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
    slots, ring = layout.slots_per_stage, layout.return_slots
    # [stages, replicas, repeats, layers_per_stage, ...]
    weights = stage_blocks(layer_params, layout, replicas)
    streams = constrain(streams, STREAMS)
    positions = split_microbatches(positions, count)  # [microbatches, microbatch, seq]
    segments = None if segment_ids is None else split_microbatches(segment_ids, count)
    stage_ids = jnp.arange(stages)
    first_stage = (stage_ids == 0).reshape(stages, *(1,) * (streams.ndim - 2))
    run_replicas = replica_stage(stage_fn, replicas)

    def run_stage(stage_weights, repeat, x, microbatch_positions, microbatch_segments):
        # [replicas, layers_per_stage, ...]; a static index when there is one repeat (no gather,
        # and no scatter of its gradient)
        chunk = jax.tree.map(lambda w: w[:, repeat] if repeats > 1 else w[:, 0], stage_weights)
        # [microbatch, seq, embed]
        return run_replicas(chunk, x, microbatch_positions, microbatch_segments)

    if repeats > 1 and checkpoint_policy is not None:
        run_stage = jax.checkpoint(run_stage, policy=checkpoint_policy, prevent_cse=False)

    def stage_step(stage, stage_weights, x, iteration):
        """One stage's iteration (vmapped over stages): its layers on its current microbatch."""
        virtual = jnp.clip(iteration - stage, 0, repeats * count - 1)
        microbatch, repeat = virtual % count, virtual // count
        seg = None if segments is None else segments[microbatch]
        return run_stage(stage_weights, repeat, x, positions[microbatch], seg)

    vmapped_step = jax.vmap(stage_step, in_axes=(0, 0, 0, None), spmd_axis_name=PIPE_AXIS)

    def iteration_body(carry, iteration):
        arrived, streams, returned = carry
        column = streams[:, iteration % slots]  # [stages, microbatch, seq, embed]
        entering = column  # stage 0's own cell: microbatch `iteration`, while there are new ones
        if repeats > 1:  # a later repeat: what the last stage sent `ring` iterations ago
            entering = jnp.where(iteration < count, column, returned[:, iteration % ring])
        x = constrain(jnp.where(first_stage, entering, arrived), STAGE_ACTIVATIONS)
        out = constrain(vmapped_step(stage_ids, weights, x, iteration), STAGE_ACTIVATIONS)
        # the column moves one stage back (a collective permute; stage 0's cell was just read),
        # and the last stage's output takes the last stage's cell
        shifted = jnp.pad(column[1:], ((0, 1),) + ((0, 0),) * (column.ndim - 1))
        last_stage = (stage_ids == stages - 1).reshape(first_stage.shape)
        column = constrain(jnp.where(last_stage, out, shifted), STAGE_ACTIVATIONS)
        streams = streams.at[:, iteration % slots].set(column)
        # stage s receives stage s - 1's output: a collective permute over `pipe`
        if repeats > 1:  # the last stage's output returns to stage 0 for its next repeat
            arrived = jnp.roll(out, 1, axis=0)
            returned = returned.at[:, iteration % ring].set(arrived)
        else:  # GPipe: nothing wraps around, so the last stage sends nothing
            arrived = jnp.pad(out[:-1], ((1, 0),) + ((0, 0),) * (out.ndim - 1))
        return (constrain(arrived, STAGE_ACTIVATIONS), streams, returned), None

    arrived = constrain(jnp.zeros_like(streams[:, 0]), STAGE_ACTIVATIONS)
    returned = jnp.zeros((stages, 1), streams.dtype)
    if repeats > 1:  # [stages, ring, microbatch, seq, embed]; only stage 0 reads its own
        returned = constrain(jnp.zeros((stages, ring, *streams.shape[2:]), streams.dtype), STREAMS)
    (_, streams, _), _ = jax.lax.scan(
        iteration_body,
        (arrived, streams, returned),
        jnp.arange(layout.forward_iterations, dtype=jnp.int32),
    )
    return streams
