"""Pipeline parallelism over the `pipe` mesh axis: GPipe and circular (interleaved) schedules
run as one SPMD program, the layout every schedule shares (1F1B's loop lives in
msjax.parallel.one_f_one_b), and the layer order that keeps each stage's layers on its devices.

The model is not involved beyond a stage function (layer parameters, activations) -> activations;
everything inside a stage still composes with fsdp, tensor and sequence parallelism and remat.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from msjax.config import Config
from msjax.parallel.context import constrain
from msjax.parallel.microbatches import (
    arrange_microbatches,
    merge_microbatches,
    split_microbatches,
)
from msjax.parallel.schedules import (
    FORWARD,
    GPIPE,
    IDLE,
    MICROBATCH,
    REPEAT,
    SCHEDULES,
    ScheduleTable,
    schedule_table,
)

PIPE_AXIS = "pipe"

# (parameters of one stage's layers [layers_per_stage, ...], x [microbatch, seq, embed],
#  positions [microbatch, seq], segment ids [microbatch, seq] or None) -> x
StageFunction = Callable[[Any, jax.Array, jax.Array, jax.Array | None], jax.Array]


@dataclass(frozen=True)
class PipelineLayout:
    """P stages, R virtual stages (repeats) per device, M microbatches, L layers, a schedule.

    Virtual stage v = r P + s (device s, repeat r) runs layers [v K, (v + 1) K), K = L / (P R):
    GPipe and 1F1B are R = 1; circular gives device s the layers s, s + P, ... in chunks of K.
    What runs when, and what the schedule costs, is its table's (`table`).
    """

    stages: int
    repeats: int
    microbatches: int
    num_layers: int
    schedule: str = GPIPE  # PipelineConfig.schedule, a key of msjax.parallel.schedules.SCHEDULES

    @classmethod
    def of(cls, config: Config) -> PipelineLayout:
        pipeline = config.pipeline
        wraps_around = SCHEDULES[pipeline.schedule].wraps_around
        return cls(
            config.mesh.pipe,
            pipeline.repeats if wraps_around else 1,
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
        return self.table.slots_per_stage

    @property
    def return_slots(self) -> int:
        """Circular: the ring where microbatches wait to re-enter stage 0, M - P + 1."""
        return self.table.return_slots

    def input_cells(self) -> np.ndarray:
        """[stages * slots]: the microbatch each stream cell holds before the loop (-1: none).

        Cell (s, i) holds microbatch s slots + i: stage 0 reads cell t mod slots at iteration
        t, and each visit moves a column one stage back, so microbatch t is there in time.
        """
        cells = np.arange(self.stages * self.slots_per_stage)
        return np.where(cells < self.microbatches, cells, -1)

    def output_cells(self) -> np.ndarray:
        """[stages * slots]: the microbatch whose finished output each stream cell holds after
        the loop (-1: none): the table's last-stage actions moved as run_streams moves them
        (visit_column, on each iteration's stream_column)."""
        cells = np.full((self.stages, self.slots_per_stage), -1)
        for iteration, actions in enumerate(self.table.actions):
            kind, microbatch, repeat, _ = actions[-1]  # the last stage's
            finished = microbatch if kind == FORWARD and repeat == self.repeats - 1 else -1
            column = self.stream_column(iteration)
            cells[:, column] = visit_column(cells[:, column], np.full(self.stages, finished), np)
        held = sorted(cells[cells >= 0].tolist())
        assert held == list(range(self.microbatches)), f"outputs lost: {cells}"
        return cells.reshape(-1)

    def stream_column(self, iteration: Any) -> Any:
        """The column of the streams that iteration visits (an int, or traced)."""
        return iteration % self.slots_per_stage

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


def gathers_stage_weights_once(config: Config) -> bool:
    """`pipeline.fsdp_gather=once` on a pipe mesh whose fsdp axis splits the stage's weights:
    gathered whole before the pipeline loop, their gradient reduced once after it."""
    mesh = config.mesh
    return config.pipeline.fsdp_gather == "once" and mesh.fsdp > 1 and mesh.pipe > 1


def visit_column(column: Any, last_stage_output: Any, xp: Any = jnp) -> Any:
    """A column of the streams after its iteration: every cell moves one stage back (stage 0's,
    read in this iteration, leaves: a collective permute over `pipe`), and the last stage's cell
    takes the last stage's output. column, last_stage_output [stages, ...]; xp: jax.numpy in the
    loop, numpy where output_cells follows the microbatches' ids."""
    stages, rest = column.shape[0], (1,) * (column.ndim - 1)
    last_stage = (xp.arange(stages) == stages - 1).reshape(stages, *rest)
    shifted = xp.pad(column[1:], ((0, 1),) + ((0, 0),) * (column.ndim - 1))
    return xp.where(last_stage, last_stage_output, shifted)


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


@dataclass(frozen=True)
class Replicas:
    """The copies of its stage's weights a pipeline loop works on: one per rank of `axes`, each
    on its own rows, so the weights' gradients accumulate per copy through the loop and are
    summed over `axes` once, after it. Data-parallel replicas (`data`), and under
    `pipeline.fsdp_gather=once` the fsdp ranks too, whose weights are whole before the loop."""

    count: int = 1  # the product of the axes' sizes
    axes: tuple[str, ...] = ("data",)


ONE_REPLICA = Replicas()


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


def over_replicas(fn: Callable[..., Any], replicas: Replicas) -> Callable[..., Any]:
    """fn(params, *rows) run by each replica on its own rows with its own params.

    The returned function takes params stacked [replicas, ...] and arrays whose rows are
    replica-major (None passes through) and returns fn's results stacked [replicas, ...]; fn is
    vmapped with the replicas' axes as spmd axes, so it runs under
    `msjax.parallel.rules.placement_within_replica`.
    """
    count = replicas.count

    def run(params: Any, *rows: jax.Array | None) -> Any:
        def split(a: jax.Array | None) -> jax.Array | None:
            return None if a is None else a.reshape(count, a.shape[0] // count, *a.shape[1:])

        vmapped = jax.vmap(fn, spmd_axis_name=replicas.axes)
        return vmapped(params, *(split(a) for a in rows))

    return run


def replica_stage(stage_fn: StageFunction, replicas: Replicas) -> StageFunction:
    """stage_fn over a microbatch, each replica's rows with its own weights: the returned
    function takes a chunk of [replicas, layers_per_stage, ...] arrays."""
    vmapped = over_replicas(stage_fn, replicas)

    def run(chunk: Any, x: jax.Array, positions: jax.Array, segment_ids: Any) -> jax.Array:
        if replicas.count == 1:
            return stage_fn(jax.tree.map(lambda w: w[0], chunk), x, positions, segment_ids)
        return vmapped(chunk, x, positions, segment_ids).reshape(x.shape)

    return run


# a stage's activations [stages, microbatch, seq, embed], and the microbatch streams
# [stages, slots, microbatch, seq, embed]: split over `pipe` by stage, along the sequence over
# `tensor` under sequence parallelism as between any two blocks
# (Megatron's scatter/gather: each tensor rank sends 1 / tensor of a stage's activations)
STAGE_ACTIVATIONS = ("stage", "batch", "residual_seq", "act_embed")
STREAMS = ("stage", None, "batch", "residual_seq", "act_embed")


def rows_to_streams(rows: jax.Array, layout: PipelineLayout) -> jax.Array:
    """The inverse of cells_to_rows, as streams [stages, slots, microbatch, ...]."""
    stages, slots = layout.stages, layout.slots_per_stage
    by_stage = rows.reshape(stages, rows.shape[0] // (stages * slots), slots, *rows.shape[1:])
    return jnp.swapaxes(by_stage, 1, 2)


def run_pipeline(
    stage_fn: StageFunction,
    layer_params: Any,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    layout: PipelineLayout,
    checkpoint_policy: Callable[..., bool] | None = None,
    replicas: Replicas = ONE_REPLICA,
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
    replicas: Replicas = ONE_REPLICA,
) -> jax.Array:
    """The layer stack as a pipeline over microbatch streams held by the stages: a scan over the
    rows of the schedule's table (GPipe, circular), each row one ForwardLoop iteration.

    streams [stages, slots, microbatch, seq, embed], split over `pipe`: cell (s, i) holds
    microbatch input_cells()[s * slots + i]; each stage holds slots = ceil(M / P) microbatches
    (MaxText's state_io), not all M. Returns the finished outputs in the same shape, cell c
    holding microbatch output_cells()[c]'s (-1: nothing), each still on the stage that holds
    it, so a loss head after the loop runs on 1 / P of the tokens per stage.

    layer_params: a pytree of [layers, ...] arrays in memory order (to_memory_order), their layer
    axis sharded over `pipe`.

    checkpoint_policy (circular): what a stage run keeps for the backward pass, as the stage
    function's own remat would (a policy from msjax.models.transformer.enclosing_checkpoint_policy).
    With it, a run's selected chunk of weights is selected again in the backward pass instead of
    being kept: without it the loop keeps every iteration's chunk, (R M + P - 1) / R times the
    device's layer weights.

    replicas: the ranks of `data` (and of `fsdp` where the weights come gathered whole, see
    Replicas). Each replica works on its own copy of its stage's weights (stage_blocks,
    replica_stage), so the weight gradients are summed over its axes once per step, after the
    loop, not once per iteration.
    """
    table = layout.table
    # [stages, replicas, repeats, layers_per_stage, ...]
    weights = stage_blocks(layer_params, layout, replicas.count)
    run_stages = stage_runner(stage_fn, layout, replicas, checkpoint_policy, positions, segment_ids)
    loop = ForwardLoop(layout, functools.partial(run_stages, weights))
    # per iteration: its index, its row of the table, and (a scalar every stage reads alike, so
    # no stage waits for another's row) the repeat that stage 0 starts
    entering_repeat = jnp.asarray(table.actions[:, 0, REPEAT])
    rows = (jnp.arange(table.iterations, dtype=jnp.int32), jnp.asarray(table.actions))
    rows = (*rows, entering_repeat)
    carry, _ = jax.lax.scan(loop.iteration, loop.start(constrain(streams, STREAMS)), rows)
    return carry.streams


def stage_runner(
    stage_fn: StageFunction,
    layout: PipelineLayout,
    replicas: Replicas,
    checkpoint_policy: Callable[..., bool] | None,
    positions: jax.Array,
    segment_ids: jax.Array | None,
) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """(weights [stages, replicas, repeats, layers_per_stage, ...], x [stages, microbatch, seq,
    embed], actions [stages, 4]: a row of the table) -> every stage's output: each stage runs its
    layers of the repeat its action names on x, with its microbatch's positions and segments.
    One program vmapped over the stages (split over `pipe`), so idle stages compute on zeros."""
    count, repeats = layout.microbatches, layout.repeats
    positions = split_microbatches(positions, count)  # [microbatches, microbatch, seq]
    segments = None if segment_ids is None else split_microbatches(segment_ids, count)
    run_replicas = replica_stage(stage_fn, replicas)

    def run_stage(stage_weights, repeat, x, microbatch_positions, microbatch_segments):
        # [replicas, layers_per_stage, ...]; a static index when there is one repeat (no gather,
        # and no scatter of its gradient)
        chunk = jax.tree.map(lambda w: w[:, repeat] if repeats > 1 else w[:, 0], stage_weights)
        # [microbatch, seq, embed]
        return run_replicas(chunk, x, microbatch_positions, microbatch_segments)

    if repeats > 1 and checkpoint_policy is not None:
        run_stage = jax.checkpoint(run_stage, policy=checkpoint_policy, prevent_cse=False)

    def stage_step(stage_weights: Any, x: jax.Array, action: jax.Array) -> jax.Array:
        microbatch = action[MICROBATCH]
        seg = None if segments is None else segments[microbatch]
        return run_stage(stage_weights, action[REPEAT], x, positions[microbatch], seg)

    return jax.vmap(stage_step, spmd_axis_name=PIPE_AXIS)


class StreamCarry(NamedTuple):
    """What the forward loop carries from one iteration to the next."""

    arrived: jax.Array  # [stages, microbatch, seq, embed]: what each stage received
    streams: jax.Array  # [stages, slots, microbatch, seq, embed]: inputs, then finished outputs
    returned: jax.Array  # circular: [stages, ring, microbatch, seq, embed], only stage 0's read
    # circular with the wrap-around delayed: the last iteration's outputs, the last stage's on
    # its way to stage 0 (like `arrived`; [stages, 1] where nothing wraps or it goes at once)
    leaving: jax.Array


@dataclass(frozen=True)
class ForwardLoop:
    """One iteration of the GPipe and circular loop: every stage runs the action its row of the
    table names, on what entered it; then the transfers over `pipe` (collective permutes).

    Circular with M > P delays the wrap-around (MaxText's delayed rotation): the last stage's
    output waits at least two iterations in stage 0's ring before it re-enters, so it is sent in
    the iteration after it was made, from the carry, with no data dependency on that
    iteration's stage runs, and written into the ring after stage 0 has read its slot; its own
    collective permute can overlap them. With M = P it is needed at once, and goes with the
    stage-to-stage transfer.
    """

    layout: PipelineLayout
    run_stages: Callable[[jax.Array, jax.Array], jax.Array]  # (x, actions) -> outputs

    def start(self, streams: jax.Array) -> StreamCarry:
        stages, ring = self.layout.stages, self.layout.return_slots
        arrived = constrain(jnp.zeros_like(streams[:, 0]), STAGE_ACTIVATIONS)
        returned = leaving = jnp.zeros((stages, 1), streams.dtype)
        if ring:  # [stages, ring, microbatch, seq, embed]
            shape = (stages, ring, *streams.shape[2:])
            returned = constrain(jnp.zeros(shape, streams.dtype), STREAMS)
        if self.layout.table.delays_wrap_around:
            leaving = arrived
        return StreamCarry(arrived, streams, returned, leaving)

    def _stage_mask(self, stage: int, like: jax.Array) -> jax.Array:
        stages = self.layout.stages
        return (jnp.arange(stages) == stage).reshape(stages, *(1,) * (like.ndim - 1))

    def iteration(self, carry: StreamCarry, row: tuple) -> tuple[StreamCarry, None]:
        iteration, actions, entering_repeat = row  # actions [stages, 4]: the table's row
        layout, ring = self.layout, self.layout.return_slots
        column_index = layout.stream_column(iteration)
        column = carry.streams[:, column_index]  # [stages, microbatch, seq, embed]
        # stage 0 takes its microbatch's first repeat from its own stream cell, a later repeat
        # from the ring, where it waited since the last stage sent it
        entering = column
        if ring:
            waited = carry.returned[:, iteration % ring]
            entering = jnp.where(entering_repeat > 0, waited, column)
        first_stage = self._stage_mask(0, column)
        x = constrain(jnp.where(first_stage, entering, carry.arrived), STAGE_ACTIVATIONS)
        out = constrain(self.run_stages(x, actions), STAGE_ACTIVATIONS)
        column = constrain(visit_column(column, out), STAGE_ACTIVATIONS)
        streams = carry.streams.at[:, column_index].set(column)
        # stage s receives stage s - 1's output: a collective permute over `pipe`
        if ring and not layout.table.delays_wrap_around:  # and stage 0 the last stage's
            arrived = constrain(jnp.roll(out, 1, axis=0), STAGE_ACTIVATIONS)
        else:  # the last stage sends nothing on (GPipe), or its output leaves later
            pad = ((1, 0),) + ((0, 0),) * (out.ndim - 1)
            arrived = constrain(jnp.pad(out[:-1], pad), STAGE_ACTIVATIONS)
        returned, leaving = self._wrap_around(carry, out, arrived, iteration)
        return StreamCarry(arrived, streams, returned, leaving), None

    def _wrap_around(
        self, carry: StreamCarry, out: jax.Array, arrived: jax.Array, iteration: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(the ring, what leaves next iteration) after this iteration: the ring takes the last
        stage's output as it arrived at stage 0 (M = P), or the previous iteration's, sent now
        from the last stage to stage 0 alone (delayed)."""
        ring = self.layout.return_slots
        if not ring:
            return carry.returned, carry.leaving
        if not self.layout.table.delays_wrap_around:
            return carry.returned.at[:, iteration % ring].set(arrived), carry.leaving
        stages = self.layout.stages
        # [stages, microbatch, seq, embed]: the last stage's row moves to stage 0
        pad = ((0, stages - 1),) + ((0, 0),) * (out.ndim - 1)
        wrapped = constrain(jnp.pad(carry.leaving[-1:], pad), STAGE_ACTIVATIONS)
        returned = carry.returned.at[:, (iteration - 1) % ring].set(wrapped)
        return returned, out
