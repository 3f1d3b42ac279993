"""The analytical bytes one device sends per step over each mesh axis, with no devices.

Ring collectives (all-reduce, all-gather, reduce-scatter), the pipeline's collective permutes and
the all-to-alls of expert-parallel MoE layers, counted from the shard sizes of
msjax.planner.planning;
`tests/unit/test_communication_model.py` holds them to the collectives of XLA's compiled programs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from msjax.config import Config
from msjax.models.moe import expert_capacity
from msjax.parallel.experts import buffer_rows
from msjax.parallel.pipeline import PipelineLayout, gathers_stage_weights_once
from msjax.parallel.schedules import ScheduleTable
from msjax.planner.candidates import MeshShape, config_for_mesh
from msjax.planner.planning import (
    F32_BYTES,
    INT32_BYTES,
    LocalDims,
    StateBytes,
    head_param_bytes,
    local_dims,
    state_bytes,
)


@dataclass(frozen=True)
class CommEstimate:
    """Bytes one device sends per step over each mesh axis (ring collectives, permutes,
    all-to-alls)."""

    tensor_bytes: int  # Megatron all-reduces of activations
    fsdp_bytes: int  # weight all-gathers and gradient reduce-scatters
    # gradient all-reduce across replicas: over data x expert for the weights every expert
    # device holds, over data for the experts (each expert device holds its own)
    data_bytes: int
    pipe_bytes: int = 0  # stage-to-stage activations and their gradients (collective permutes)
    fsdp_gather_bytes: int = 0  # of fsdp_bytes, the weight all-gathers
    expert_bytes: int = 0  # MoE token exchange: all-to-alls over `expert`, each way and back

    @property
    def total_bytes(self) -> int:
        return (
            self.tensor_bytes
            + self.fsdp_bytes
            + self.data_bytes
            + self.pipe_bytes
            + self.expert_bytes
        )

    def by_axis(self) -> dict[str, int]:
        return {
            "tensor": self.tensor_bytes,
            "fsdp": self.fsdp_bytes,
            "expert": self.expert_bytes,
            "pipe": self.pipe_bytes,
            "data": self.data_bytes,
        }


def ring_all_reduce_bytes(size_bytes: float, group: int) -> float:
    """Bytes one member sends in a ring all-reduce of size_bytes (reduce-scatter + all-gather)."""
    return 2.0 * (group - 1) / group * size_bytes


def ring_all_gather_bytes(gathered_bytes: float, group: int) -> float:
    """Bytes one member sends to gather gathered_bytes (also a reduce-scatter of that size)."""
    return (group - 1) / group * gathered_bytes


def all_to_all_bytes(size_bytes: float, group: int) -> float:
    """Bytes one member sends in an all-to-all of its size_bytes buffer: all but its own block."""
    return (group - 1) / group * size_bytes


def forward_passes(remat: str) -> int:
    """How often a layer's forward matmuls run per step: twice under full recomputation."""
    return 2 if remat == "full" else 1


def estimate_communication(config: Config, mesh: MeshShape) -> CommEstimate:
    """Per-device bytes sent per step over each axis of `mesh` (ConfigError if it cannot run).

    On a pipe mesh a device runs its stage's layers once per pipeline iteration on one
    microbatch (bubble iterations included: they run on zeros), so its per-layer traffic is
    counted per stage run. Accumulating gradients, each of the `grad_accum_steps` microbatches is
    a pass of its own: XLA gathers the weights, and reduces their gradients (over fsdp and over
    data), inside the accumulation loop, once per microbatch.
    """
    config = config_for_mesh(config, mesh)
    dims = local_dims(config, mesh)
    table = PipelineLayout.of(config).table if mesh.pipe > 1 else None
    passes = forward_passes(config.model.remat)
    layer_runs = dims.stage_runs * dims.layers  # layers run per step on this device
    split = dims.residual_split
    stream = dims.batch * dims.seq * dims.embed * dims.act_bytes / split  # one run's stream
    replica_stream = dims.replica_batch * dims.seq * dims.embed * dims.act_bytes / split
    tensor_bytes = 0.0
    if mesh.tensor > 1:
        # Per layer: attention output and MLP output all-reduced in every forward pass, and the
        # gradients into the fused q/k/v and gate/up inputs in the backward pass; plus the
        # vocab-split embedding lookup and the gradient of the unembedding's input, both in
        # float32 (the table's dtype, the loss's); under 1F1B every stage runs the head each
        # iteration, under GPipe and circular on the tokens its stage holds.
        per_layer = (2 * passes + 2) * ring_all_reduce_bytes(stream * split, mesh.tensor)
        # the shares of the batch a device embeds and scores (the schedule's)
        lookups = 1.0 if table is None else table.embedding_share
        head_runs = 1.0 if table is None else table.head_share
        head_stream = replica_stream * split * F32_BYTES / dims.act_bytes
        tensor_bytes = layer_runs * per_layer + (lookups + head_runs) * ring_all_reduce_bytes(
            head_stream, mesh.tensor
        )
    state = state_bytes(config, mesh)
    fsdp_bytes, gather_bytes = _fsdp_bytes(config, mesh, dims, state) if mesh.fsdp > 1 else (0, 0)
    if mesh.tensor > 1 and state.experts:
        off_fsdp, on_tensor = _expert_grads_over_tensor(config, mesh, dims, state)
        fsdp_bytes, tensor_bytes = fsdp_bytes - off_fsdp, tensor_bytes + on_tensor
    # GPipe and circular reduce the tables' gradients over data x pipe (see _pipe_bytes)
    tables = state.params - state.stacked
    if split > 1:  # sequence-parallel lookups: each tensor rank's gradient of the whole table
        tables += (split - 1) * dims.vocab * dims.embed / mesh.fsdp * F32_BYTES
    split_head = table is not None and not table.runs_backward
    data_reduced = state.params - (tables if split_head else 0) - state.experts
    # the expert devices are data-parallel replicas for every weight but the experts
    data_bytes = ring_all_reduce_bytes(data_reduced, mesh.data * mesh.expert)
    data_bytes += ring_all_reduce_bytes(state.experts, mesh.data)
    pipe_bytes = 0.0
    if table is not None:
        pipe_bytes = _pipe_bytes(table, dims, stream, replica_stream, tables, mesh)
    passes_per_step = dims.accum_steps
    return CommEstimate(
        round(passes_per_step * tensor_bytes),
        round(passes_per_step * fsdp_bytes),
        round(passes_per_step * data_bytes),
        pipe_bytes=round(passes_per_step * pipe_bytes),
        fsdp_gather_bytes=round(passes_per_step * gather_bytes),
        expert_bytes=round(passes_per_step * _expert_bytes(config, mesh, dims)),
    )


def _expert_bytes(config: Config, mesh: MeshShape, dims: LocalDims) -> float:
    """Bytes a device sends over `expert` per pass: its MoE layers' token exchanges
    (msjax.parallel.experts), dense buffers of [expert, buffer_rows, embed] each way.

    Per MoE layer and forward pass, the token rows sent to their experts' devices, their int32
    expert ids beside them, and the outputs sent back; the backward pass sends both rows'
    gradients the other way (the ids have none). A recomputing remat policy runs the forward's
    exchanges again: their results are neither dots nor kept.
    """
    moe = config.model.moe
    if mesh.expert == 1 or not moe.enabled:
        return 0.0
    k = moe.experts_per_token
    pass_tokens = dims.replica_batch * dims.seq * config.mesh.batch_split()  # the layer's tokens
    capacity = expert_capacity(moe.capacity_factor, pass_tokens, k, moe.num_experts)
    rows = buffer_rows(dims.batch * dims.seq * k, moe.num_experts // mesh.expert, capacity)
    sent_rows = all_to_all_bytes(mesh.expert * rows * dims.embed * dims.act_bytes, mesh.expert)
    sent_ids = all_to_all_bytes(mesh.expert * rows * INT32_BYTES, mesh.expert)
    recomputes = 0 if config.model.remat == "none" else 1
    per_layer = (1 + recomputes) * (2 * sent_rows + sent_ids) + 2 * sent_rows
    return (config.model.num_layers - moe.first_dense_layers) * per_layer


def _expert_grads_over_tensor(
    config: Config, mesh: MeshShape, dims: LocalDims, state: StateBytes
) -> tuple[float, float]:
    """(bytes no longer sent over fsdp, bytes sent over tensor instead) per pass: every tensor
    rank runs its experts whole on the same tokens, and XLA reduces their gradients by one
    all-reduce over fsdp x tensor, not a reduce-scatter over fsdp (read off the compiled step at
    fsdp 2 x expert 2 x tensor 2), counted on tensor."""
    experts = state.experts * mesh.fsdp * _grad_itemsize(config, dims) / F32_BYTES
    return (
        ring_all_gather_bytes(experts, mesh.fsdp),
        ring_all_reduce_bytes(experts, mesh.fsdp * mesh.tensor),
    )


def _grad_itemsize(config: Config, dims: LocalDims) -> int:
    """Bytes per element of the gradients reduced over fsdp: optim.grad_reduce_dtype's under a
    narrower compute dtype, float32's otherwise."""
    if dims.act_bytes < F32_BYTES:
        return np.dtype(config.optim.grad_reduce_dtype).itemsize
    return F32_BYTES


def _fsdp_bytes(
    config: Config, mesh: MeshShape, dims: LocalDims, state: StateBytes
) -> tuple[float, float]:
    """(bytes a device sends over fsdp per pass, of them the weights' all-gathers).

    Float32 compute: weights gathered for every forward pass and again for the backward pass
    (XLA does not keep them). A narrower compute dtype: weights cast on the shard and gathered
    in it (msjax.parallel.rules.weight_gather) once per forward pass, the backward reusing them.
    Gradients reduced once, in optim.grad_reduce_dtype.

    On a pipe mesh the tables used outside the loop (embedding, unembedding) are gathered once
    per forward pass and kept. A stage's layers: with one layer per stage run XLA gathers them
    once per pass, outside the pipeline's loop; with a layer scan inside the stage, or a
    repeat's chunk selected per iteration (circular), it gathers (and reduces the gradient of)
    each layer where the loop runs it, so once per pipeline iteration. Under
    `pipeline.fsdp_gather=once` they are gathered in their own dtype (float32) before the loop
    and their gradient reduced, in optim.grad_reduce_dtype, after it, once each per pass,
    whatever the schedule and remat.
    """
    table = PipelineLayout.of(config).table if mesh.pipe > 1 else None
    passes = forward_passes(config.model.remat)
    narrow = dims.act_bytes < F32_BYTES
    gathers = passes if narrow else passes + 1
    stacked = state.stage_gathered  # this device's stacked layers, whole over fsdp
    tables = state.fsdp_gathered - stacked
    reduce_itemsize = np.dtype(config.optim.grad_reduce_dtype).itemsize
    grad_itemsize = _grad_itemsize(config, dims)
    # a stage run gathers what it runs: one repeat's chunk of the device's layers under circular
    chunk, stacked_runs = stacked, 1
    if table is not None and (dims.layers > 1 or table.repeats > 1):
        chunk, stacked_runs = stacked / table.repeats, dims.stage_runs
    if mesh.pipe == 1:
        gathered = gathers * state.fsdp_gathered * dims.act_bytes / F32_BYTES
        stacked_reduced = stacked * grad_itemsize / F32_BYTES
    elif gathers_stage_weights_once(config):
        gathered = passes * tables * dims.act_bytes / F32_BYTES + stacked
        stacked_reduced = stacked * reduce_itemsize / F32_BYTES
    else:
        gathered = (passes * tables + gathers * stacked_runs * chunk) * dims.act_bytes / F32_BYTES
        stacked_reduced = stacked_runs * chunk * grad_itemsize / F32_BYTES
    gather_bytes = ring_all_gather_bytes(gathered, mesh.fsdp)
    # GPipe and circular reduce the tables' gradients over fsdp within their reduction over
    # data x pipe (see _pipe_bytes)
    split_tables = table is not None and not table.runs_backward
    reduced = (0 if split_tables else tables * grad_itemsize / F32_BYTES) + stacked_reduced
    return gather_bytes + ring_all_gather_bytes(reduced, mesh.fsdp), gather_bytes


def _pipe_bytes(
    table: ScheduleTable,
    dims: LocalDims,
    stream: float,
    replica_stream: float,
    tables: float,
    mesh: MeshShape,
) -> float:
    """Bytes a device sends over `pipe` per step (msjax.parallel.pipeline, .one_f_one_b).

    stream: one stage run's activations on a device (1 / tensor of them under sequence
    parallelism), replica_stream: its replica's whole batch; tables: a device's float32 share
    of the parameters outside the layer stack (embedding, unembedding, final norm).
    In the loop, every iteration: the schedule's sends_per_iteration, stage activations and
    their gradients (collective permutes). Once per step, where the loop leaves the backward to
    autodiff (GPipe, circular), the tables' gradients, each stage's from its own tokens, are
    summed over pipe within the data-parallel all-reduce: a reduce-scatter of the whole tables
    over data x fsdp x pipe, then an all-gather of a device's fsdp shard over data x pipe (one
    all-reduce over data x pipe without fsdp; read off the compiled program of data 2 x fsdp 2 x
    pipe 2). Where it runs the backward itself (1F1B), stage 0's input gradients and the head's
    parameter gradients are summed over the stages, the input gradients in float32 (the
    embedding's dtype); reading the head's gradients off the last stage, XLA first permutes them
    from the last stage to stage 0 (one device in P sends; read off the compiled program at
    vocab 264 and 131,072); the head's gradients move as their fsdp shards.
    """
    stages = table.stages
    in_loop = table.iterations * stream * table.sends_per_iteration
    if not table.runs_backward:
        replicas = mesh.data * stages
        table_grads = ring_all_gather_bytes(tables * mesh.fsdp, replicas * mesh.fsdp)
        table_grads += ring_all_gather_bytes(tables, replicas)
        return in_loop + table_grads
    all_reduce = ring_all_reduce_bytes(replica_stream, stages)
    input_grads = all_reduce * F32_BYTES / dims.act_bytes
    head_params = head_param_bytes(dims) / mesh.fsdp  # their gradients' fsdp shard
    head_grads = ring_all_reduce_bytes(head_params, stages) + head_params / stages
    return in_loop + input_grads + head_grads
