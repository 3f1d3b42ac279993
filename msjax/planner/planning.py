"""The analytical per-device memory of one train step on a mesh, with no devices.

State (parameters, optimizer moments) is exact: every array's shard shape from the logical-axis
rules. Activations and temporaries are closed-form counts of what the model keeps for the backward
pass under each `model.remat` policy, and on a pipe mesh of what the pipeline's loop keeps,
calibrated against XLA's buffer assignment (the coefficients below; `tests/unit/test_plan.py`
holds them to 10% of XLA's memory analysis, on pipe meshes too). Communication, the bytes one device
sends per step, is msjax.planner.communication's, built on the shard sizes here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from msjax.batch import BATCH_FIELDS
from msjax.config import Config, ModelConfig, OptimConfig
from msjax.models.moe import expert_capacity
from msjax.ops.causal_blocks import blocked_keys_per_query
from msjax.parallel.context import LogicalAxes
from msjax.parallel.experts import buffer_rows
from msjax.parallel.pipeline import PipelineLayout, gathers_stage_weights_once
from msjax.parallel.rules import logical_axis_rules, logical_to_spec
from msjax.planner.candidates import PLANNED_BACKEND, MeshShape, config_for_mesh
from msjax.state_layout import state_layout
from pallas_kernels.cross_entropy import BlockSizes

F32_BYTES = 4
INT32_BYTES = 4
STEP_BYTES = 4  # the train state's int32 step counter, counted with the optimizer state


@dataclass(frozen=True)
class ArrayLayout:
    """One state array: its global shape, bytes per element and logical axis names."""

    shape: tuple[int, ...]
    itemsize: int
    axes: LogicalAxes  # () for arrays that are replicated (step counters)
    stacked: bool  # has a "layers" axis: lives inside the scanned blocks


def _array_layout(shape: jax.ShapeDtypeStruct, axes: LogicalAxes) -> ArrayLayout:
    itemsize = np.dtype(shape.dtype).itemsize
    return ArrayLayout(tuple(shape.shape), itemsize, axes, "layers" in axes)


@functools.cache
def state_arrays(
    model: ModelConfig, optim: OptimConfig, total_steps: int
) -> tuple[tuple[ArrayLayout, ...], tuple[ArrayLayout, ...]]:
    """(parameters, optimizer state) of the train state, as `msjax.state_layout` lays it out."""
    layout = state_layout(model, optim, total_steps)
    param_shapes = jax.tree.leaves(nnx.to_pure_dict(layout.abstract_params))
    param_axes = jax.tree.leaves(layout.param_axes, is_leaf=lambda leaf: isinstance(leaf, tuple))
    opt_shapes = jax.tree.leaves(layout.opt_state_shapes)
    opt_axes = [axes.names for axes in jax.tree.leaves(layout.opt_state_axes)]
    return (
        tuple(_array_layout(*pair) for pair in zip(param_shapes, param_axes, strict=True)),
        tuple(_array_layout(*pair) for pair in zip(opt_shapes, opt_axes, strict=True)),
    )


def _shard_elements(array: ArrayLayout, rules: dict[str, Any], sizes: dict[str, int]) -> int:
    """Elements of one device's shard; uneven splits are padded up, as GSPMD does."""
    if not array.axes:
        return math.prod(array.shape)
    spec = logical_to_spec(array.axes, rules)
    elements = 1
    for dim, mesh_axes in zip(array.shape, tuple(spec) + (None,) * len(array.shape), strict=False):
        names = (mesh_axes,) if isinstance(mesh_axes, str) else (mesh_axes or ())
        elements *= -(-dim // math.prod(sizes[name] for name in names))
    return elements


@dataclass(frozen=True)
class LocalDims:
    """The per-device sizes that activations are made of."""

    batch: int  # sequences per device and layer run: global_batch / (data x fsdp) / microbatches
    seq: int
    embed: int  # activations keep the whole embedding (`act_embed` is not split)
    heads: int  # query heads per device (split over tensor)
    kv_heads: int  # kv heads a device's query heads read
    kv_heads_weights: int  # kv heads in a device's k/v weights: all unless tensor divides them
    head_dim: int
    mlp: int
    vocab: int
    layers: int  # layers a device runs per pass of its batch: all, or one stage's
    stage_runs: int  # passes of a microbatch through those layers per step (1 without a pipe)
    # sequences per data-parallel replica in one pass: global_batch / (data x fsdp) /
    # grad_accum_steps (one accumulation microbatch's; the whole replica batch without)
    replica_batch: int
    accum_steps: int  # train.grad_accum_steps: passes per step, one after another
    act_bytes: int  # bytes per element of the compute dtype
    residual_split: int  # `tensor` when the residual stream is sequence-parallel, else 1
    parallel_block: bool
    fused_attention: bool  # a flash-attention kernel: no [seq, seq] scores are kept
    score_keys: float  # keys per query in the XLA path's scores (its query blocks' key spans)
    fused_gate_up: bool  # gate and up as one matmul (msjax.models.transformer.MLP)
    fused_loss: bool  # the fused cross-entropy kernel: no [batch, seq, vocab] logits are kept


def attention_is_fused(model: ModelConfig) -> bool:
    """Whether a resolved model's attention runs as a flash-attention kernel (every kernel
    does; only the XLA reference holds the [seq, seq] scores)."""
    return model.attention_impl != "xla"


def loss_is_fused(model: ModelConfig) -> bool:
    """Whether a resolved model's loss runs as the fused cross-entropy kernel."""
    return model.loss_impl == "pallas"


def local_dims(config: Config, mesh: MeshShape) -> LocalDims:
    """Per-device activation sizes of a config made for `mesh` (see `config_for_mesh`)."""
    model, tensor = config.model, mesh.tensor
    accum_steps = config.train.grad_accum_steps
    replica_batch = config.train.global_batch // config.mesh.batch_split() // accum_steps
    layers, stage_runs, microbatches = model.num_layers, 1, 1
    if mesh.pipe > 1:
        layout = PipelineLayout.of(config)
        # stage forwards a device computes per step (msjax.parallel.schedules)
        layers, stage_runs = layout.layers_per_stage, layout.table.stage_runs
        microbatches = layout.microbatches
    return LocalDims(
        batch=replica_batch // microbatches,
        seq=config.data.seq_len,
        embed=model.embed_dim,
        heads=-(-model.num_heads // tensor),
        kv_heads=-(-model.num_kv_heads // tensor),
        kv_heads_weights=(
            model.num_kv_heads // tensor if model.num_kv_heads % tensor == 0 else model.num_kv_heads
        ),
        head_dim=model.resolved_head_dim,
        mlp=-(-model.mlp_dim // tensor),
        vocab=-(-model.vocab_size // tensor),
        layers=layers,
        stage_runs=stage_runs,
        replica_batch=replica_batch,
        accum_steps=accum_steps,
        act_bytes=np.dtype(model.compute_dtype).itemsize,
        residual_split=tensor if config.mesh.sequence_parallel else 1,
        parallel_block=model.parallel_block,
        fused_attention=attention_is_fused(model),
        score_keys=blocked_keys_per_query(config.data.seq_len, model.attention_window),
        fused_gate_up=tensor > 1 or mesh.fsdp == 1,  # apart where fsdp gathers them alone
        fused_loss=loss_is_fused(model),
    )


# What one layer keeps from its forward pass for its backward pass (remat "none"), read off XLA's
# buffer assignment of the scanned layer: the attention scores and their softmax ([batch, heads,
# queries, keys] of each query block; scores in float32), six [batch, seq, mlp] (gate, up, silu
# and its pieces), six [batch, seq, embed] (inputs and outputs of the two norms and the two
# residual adds), q and the attended values, k and v. Under "dots" the matmul outputs without
# batch dimensions (q, k, v, attention output, gate, up, down) and the layer input; under "full"
# the layer input only.
SAVED_MLP = 6
SAVED_MLP_FUSED_GATE_UP = 7  # the gate/up matmul's output is kept beside its two halves
SAVED_EMBED = 6
SAVED_EMBED_PARALLEL_BLOCK = 2  # MegaScale §3.1's block: one norm, one residual add
# Buffers alive while the last layer runs backward, besides what is saved: multiples of one
# float32 score tensor, one [batch, seq, mlp] and one [batch, seq, embed] tensor. Fitted to XLA's
# temporaries for the tiny and small configs on five to ten meshes per remat policy (float32,
# vocab 264 and the small config's: tests/unit/test_plan.py's TINY_MESHES, SMALL_MESHES and
# PIPE_CASES).
WORKING_MULTIPLES = {
    "none": (3.5, 2, 5),
    "full": (5.5, 2, 3),
    "dots": (2.5, 2, 0),
    "attention": (2.5, 2, 0),  # taken as dots' (not fitted)
}
LOSS_BUFFERS = 3  # float32 [batch, seq, vocab]: the logits, their softmax (saved), their gradient
FUSED_LOSS_CHUNK = BlockSizes().backward_chunk  # vocab columns of d_logits the fused loss holds
# On a pipe mesh (msjax.parallel.pipeline) a device keeps what each run of its stage saved,
# bubble runs included ([iterations, layers_per_stage, ...] stacks carried through the
# pipeline's loop), and, read off XLA's buffer assignment of that loop:
# - The loop's own copies of the device's stacked layer weights (the schedule's
#   loop_weight_copies, msjax.parallel.schedules, fitted to XLA's totals on test_plan's
#   PIPE_CASES). With one layer per stage run XLA drops the stage's layer scan, and its totals
#   show none of these copies (tiny, pipe 2 and 4).
# - Circular: a stage selects its repeat's chunk of the weights every iteration, and selects it
#   again in the backward pass (run_pipeline's checkpoint_policy) rather than keeping every
#   iteration's chunk, which would be iterations / repeats copies of the device's weights.
# - Remat none: one stage run's saved activations more: the stage's layer scan builds them before
#   they are written into the loop's stacks, and the backward pass reads one run's back out (with
#   one layer per stage run there is no layer scan, and no such copy).
# - Remat dots saves what full saves: inside the pipeline's vmap over stages every matmul has the
#   stage axis as a batch dimension, so `dots_with_no_batch_dims_saveable` keeps none of them.
# After the backward pass the optimizer holds the gradients and the updates: two float32 copies
# of the parameter shards. On a mesh without fsdp and with short activations this is the peak.
OPTIMIZER_PHASE_COPIES = 2


def _saved_per_layer(dims: LocalDims, remat: str) -> float:
    """Bytes one layer keeps from its forward pass until its backward pass."""
    b, s, act = dims.batch, dims.seq, dims.act_bytes
    stream = b * s * dims.embed * act
    layer_input = stream / dims.residual_split
    if remat == "full":
        return layer_input
    mlp = b * s * dims.mlp * act
    if remat in ("dots", "attention"):
        # The k and v projections are whole on every device when tensor does not split kv heads.
        qkv = b * s * (dims.heads + 2 * dims.kv_heads_weights) * dims.head_dim * act
        attended = b * s * dims.heads * dims.head_dim * act if remat == "attention" else 0
        return layer_input + qkv + 2 * mlp + 2 * stream + attended
    if dims.fused_attention:  # the kernel keeps its output's float32 log-sum-exp per query
        scores = b * dims.heads * s * F32_BYTES
    else:  # float32 scores, their softmax in the compute dtype
        scores = b * dims.heads * s * dims.score_keys * (F32_BYTES + act)
    heads = b * s * 2 * (dims.heads + dims.kv_heads) * dims.head_dim * act
    embed = SAVED_EMBED_PARALLEL_BLOCK if dims.parallel_block else SAVED_EMBED
    saved_mlp = SAVED_MLP_FUSED_GATE_UP if dims.fused_gate_up else SAVED_MLP
    return scores + saved_mlp * mlp + embed * layer_input + heads


def _working_set(dims: LocalDims, remat: str) -> float:
    """Bytes of the buffers alive while the last layer runs backward, besides saved activations."""
    b, s, act = dims.batch, dims.seq, dims.act_bytes
    scores, mlp, embed = WORKING_MULTIPLES[remat]
    attention = b * dims.heads * s * dims.score_keys * F32_BYTES
    if dims.fused_attention:  # blocks of scores stay on chip; dq, dk, dv are written out
        scores = 1
        attention = b * s * (dims.heads + 2 * dims.kv_heads) * dims.head_dim * act
    if dims.fused_loss:  # one backward chunk of d_logits, in the compute dtype
        loss = b * s * min(dims.vocab, FUSED_LOSS_CHUNK) * act
    else:
        loss = (LOSS_BUFFERS - 1) * b * s * dims.vocab * F32_BYTES
    return (
        scores * attention + mlp * b * s * dims.mlp * act + embed * b * s * dims.embed * act + loss
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of one train step, by what holds them.

    The peak is the state and batch plus the larger of two phases: the backward pass (gradients,
    saved activations, working buffers) and the optimizer update (gradients and updates).
    """

    params_bytes: int
    optimizer_bytes: int  # moments, counters and the step
    batch_bytes: int
    gradients_bytes: int
    activations_bytes: int  # saved by the forward pass for the backward pass
    working_bytes: int  # one layer's backward buffers, gathered weights, loss buffers
    update_bytes: int  # the optimizer phase's temporaries

    @property
    def state_bytes(self) -> int:
        return self.params_bytes + self.optimizer_bytes

    @property
    def backward_bytes(self) -> int:
        return self.gradients_bytes + self.activations_bytes + self.working_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.batch_bytes + max(self.backward_bytes, self.update_bytes)


@dataclass(frozen=True)
class StateBytes:
    """One device's share of the train state, in bytes (float32 parameters, their moments)."""

    params: int
    optimizer: int
    stacked: int  # this device's shard of the stacked layers' parameters
    layer_gathered: int  # one layer's parameters as gathered over fsdp (still split by tensor)
    fsdp_gathered: int  # all parameters as gathered over fsdp
    stage_gathered: int  # this device's stacked layers as gathered over fsdp
    experts: int = 0  # of params, this device's share of the MoE layers' experts (split over
    # the `expert` axis as well as fsdp)


def state_bytes(config: Config, mesh: MeshShape) -> StateBytes:
    """Per-device state of a config made for `mesh` (see `config_for_mesh`)."""
    rules = logical_axis_rules(config)
    sizes = mesh.sizes()
    params, opt_state = state_arrays(config.model, config.optim, config.train.steps)
    unsharded = dict(sizes, fsdp=1)
    layer_gathered = sum(
        _shard_elements(array, rules, unsharded) * array.itemsize
        for array in params
        if array.stacked
    )
    return StateBytes(
        params=sum(_shard_elements(a, rules, sizes) * a.itemsize for a in params),
        stacked=sum(_shard_elements(a, rules, sizes) * a.itemsize for a in params if a.stacked),
        optimizer=sum(_shard_elements(a, rules, sizes) * a.itemsize for a in opt_state)
        + STEP_BYTES,
        layer_gathered=layer_gathered // (config.model.num_layers // mesh.pipe),  # per layer
        stage_gathered=layer_gathered,
        fsdp_gathered=sum(_shard_elements(a, rules, unsharded) * a.itemsize for a in params),
        experts=sum(
            _shard_elements(a, rules, sizes) * a.itemsize for a in params if "expert" in a.axes
        ),
    )


def estimate_memory(
    config: Config, mesh: MeshShape, platform: str = PLANNED_BACKEND
) -> MemoryEstimate:
    """Per-device memory of the train step of `config` on `mesh` (ConfigError if it cannot run).

    `platform` (gpu, cpu, tpu) is the backend the kernels are resolved for: `auto` runs a
    flash-attention kernel that keeps no [seq, seq] scores on GPUs, the XLA reference elsewhere.
    """
    config = config_for_mesh(config, mesh, platform)
    state = state_bytes(config, mesh)
    dims = local_dims(config, mesh)
    remat = config.model.remat
    table = PipelineLayout.of(config).table if mesh.pipe > 1 else None
    if table is not None and remat in ("dots", "attention"):
        remat = "full"  # the pipeline's vmap gives every matmul a batch dimension (see above)
    b, s = dims.replica_batch, dims.seq
    # Outside the layers: the embedding output, the final norm's input and output, the softmax
    # (the fused loss keeps a float32 log-sum-exp per token instead).
    softmax = b * s * (1 if dims.fused_loss else dims.vocab) * F32_BYTES
    head = 3 * b * s * dims.embed * dims.act_bytes + softmax
    if table is not None:
        # GPipe and circular: the embedding, the head and the loss run on the ceil(M / P)
        # microbatches a stage holds, beside the loop's streams, their gradient and circular's
        # ring (the table's stream_buffers, msjax.parallel.pipeline.run_streams)
        stream = dims.batch * s * dims.embed * dims.act_bytes / dims.residual_split
        head = table.head_share * head + table.stream_buffers * stream
    # With fsdp one layer's weights at a time are gathered whole (still split by tensor). The
    # pipeline's loop keeps the stage's weights as sharded (the schedule's loop_weight_copies):
    # no gathered copy is among its buffers at the peak; under `pipeline.fsdp_gather=once` it
    # keeps them whole (_loop_weights).
    gathered = state.layer_gathered if mesh.fsdp > 1 and mesh.pipe == 1 else 0
    pipeline_working = _loop_weights(config, dims, state)
    pipeline_saved = 0.0
    # with a layer scan in the stage under remat none, one stage run's saved activations on
    # their way to the stash
    if table is not None and dims.layers > 1 and remat == "none":
        pipeline_saved += dims.layers * _saved_per_layer(dims, remat)
    # Weights gathered in a narrower compute dtype are kept for the backward pass (every layer's,
    # unless remat recomputes the layer, and its gather with it).
    if mesh.fsdp > 1 and dims.act_bytes < F32_BYTES and remat == "none":
        head += dims.stage_runs * dims.layers * state.layer_gathered * dims.act_bytes / F32_BYTES
    saved = dims.stage_runs * dims.layers * _saved_per_layer(dims, remat) + pipeline_saved
    exchange_saved, exchange_working = _exchanges(config, mesh, dims, remat)
    saved, pipeline_working = saved + exchange_saved, pipeline_working + exchange_working
    if table is not None and table.runs_backward:
        saved, head, pipeline_working = _one_f_one_b_buffers(config, dims, state, remat)
    return MemoryEstimate(
        params_bytes=state.params,
        optimizer_bytes=state.optimizer,
        batch_bytes=len(BATCH_FIELDS) * b * dims.accum_steps * s * INT32_BYTES,
        # float32, sharded like the parameters; accumulating, a microbatch's gradients beside
        # their running sum (msjax.step.microbatched)
        gradients_bytes=state.params * (2 if dims.accum_steps > 1 else 1),
        # a pipeline stage keeps what each of its runs saved (bubble runs included)
        activations_bytes=round(saved + head),
        working_bytes=round(_working_set(dims, remat) + gathered + pipeline_working),
        update_bytes=OPTIMIZER_PHASE_COPIES * state.params,
    )


# What one MoE layer's token exchange (msjax.parallel.experts) keeps for its backward pass, in
# buffers of [expert x buffer_rows] rows: the token rows received, the same grouped by expert,
# the experts' outputs and those sent back ([.., embed]); the gate, up, silu and product
# ([.., expert_mlp]). Counted from the program, not yet fitted to XLA's buffer assignment.
EXCHANGE_EMBED_BUFFERS = 4
EXCHANGE_HIDDEN_BUFFERS = 4


def _exchanges(config: Config, mesh: MeshShape, dims: LocalDims, remat: str) -> tuple[float, float]:
    """(saved, working) bytes of the MoE layers' exchange buffers: every MoE layer keeps its own
    for the backward pass, or under remat the layer running backward rebuilds its own."""
    exchange = _exchange_buffers(config, mesh, dims)
    if remat == "none":
        return (config.model.num_layers - config.model.moe.first_dense_layers) * exchange, 0.0
    return 0.0, exchange


def _exchange_buffers(config: Config, mesh: MeshShape, dims: LocalDims) -> float:
    """Bytes of one MoE layer's exchange buffers on a device (0 without expert parallelism):
    dense [expert, buffer_rows, ...] buffers, worst case when dropless (msjax.parallel.experts)."""
    moe = config.model.moe
    if mesh.expert == 1 or not moe.enabled:
        return 0.0
    k = moe.experts_per_token
    layer_tokens = dims.batch * dims.seq * config.mesh.batch_split()
    capacity = expert_capacity(moe.capacity_factor, layer_tokens, k, moe.num_experts)
    rows = mesh.expert * buffer_rows(
        dims.batch * dims.seq * k, moe.num_experts // mesh.expert, capacity
    )
    hidden = moe.expert_mlp_dim or config.model.mlp_dim
    widths = EXCHANGE_EMBED_BUFFERS * dims.embed + EXCHANGE_HIDDEN_BUFFERS * hidden
    return rows * widths * dims.act_bytes


def _loop_weights(config: Config, dims: LocalDims, state: StateBytes) -> float:
    """Bytes of the copies of a device's stacked layer weights the pipeline's loop holds (their
    gradient's among them): the schedule's loop_weight_copies of the shard where the stage runs
    a layer scan, or its gathered_weight_copies whole over fsdp where they are gathered before
    the loop (`pipeline.fsdp_gather=once`), with or without a layer scan."""
    if config.mesh.pipe == 1:
        return 0.0
    schedule = PipelineLayout.of(config).table.schedule
    if gathers_stage_weights_once(config):
        return schedule.gathered_weight_copies * state.stage_gathered
    return schedule.loop_weight_copies * state.stacked if dims.layers > 1 else 0.0


def head_param_bytes(dims: LocalDims) -> float:
    """A device's float32 share of the loss head's parameters: unembedding and final norm."""
    return (dims.vocab + 1) * dims.embed * F32_BYTES


def _one_f_one_b_buffers(
    config: Config, dims: LocalDims, state: StateBytes, remat: str
) -> tuple[float, float, float]:
    """(saved activations, buffers outside the layers, the loop's working copies) of a 1F1B
    step (msjax.parallel.one_f_one_b), per device.

    A stage keeps the vjp residuals of min(M, P) stage runs (its in-flight microbatches), and
    the slot its iteration's branch reads and writes twice more. Outside the layers: the
    embedding output, its microbatched copy and stage 0's gradients of it. The loop accumulates
    the head's parameter gradients and runs the head (and its loss buffers) on one microbatch at
    a time. Checked against XLA's buffer assignment on tiny, pipe 2 and 4 (tests/unit/test_plan.py).
    """
    layout = PipelineLayout.of(config)
    microbatch_stream = dims.batch * dims.seq * dims.embed * dims.act_bytes / dims.residual_split
    replica_stream = dims.replica_batch * dims.seq * dims.embed * dims.act_bytes
    # each in-flight microbatch's vjp residuals, and two runs' more: the slot read out for the
    # iteration's branch and the branch's result before it is written back
    run_saved = microbatch_stream + dims.layers * _saved_per_layer(dims, remat)
    saved = (layout.stash_slots + 2) * run_saved
    head_params = head_param_bytes(dims)
    # the loop's copy of the stage's weights and its gradient accumulator, as under GPipe
    return saved, 3 * replica_stream, _loop_weights(config, dims, state) + head_params
