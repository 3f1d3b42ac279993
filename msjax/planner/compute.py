"""The planner's compute model: the matmul FLOPs one device runs per step on a mesh, as compiled,
against the model FLOPs of `msjax.observe.flops` (which count no recomputation and no idle work).

What the compiled step runs beyond the model FLOPs: the XLA attention's scores of whole query
blocks (msjax.ops.causal_blocks: each block's key span, where the model counts the causal half),
what `model.remat` recomputes, a pipeline's bubble iterations (stages compute on zeros; 1F1B's
branch, so its idle stages do not), and the loss head: GPipe and circular split its tokens over
pipe (the ceil(M / P) microbatches a stage holds), 1F1B runs it on the last stage alone.
`tests/unit/test_compiled_flops.py` holds it to the compiled program's dots within 5%.
"""

from __future__ import annotations

from dataclasses import dataclass

from msjax.config import Config, ModelConfig
from msjax.models.moe import expert_capacity
from msjax.observe.flops import count_params, flops_per_step, mean_causal_context
from msjax.ops.causal_blocks import blocked_keys_per_query
from msjax.ops.grouped_matmul_blocks import padded_rows
from msjax.parallel.experts import buffer_rows
from msjax.parallel.pipeline import PipelineLayout
from msjax.planner.candidates import PLANNED_BACKEND, MeshShape, config_for_mesh
from msjax.planner.planning import attention_is_fused, local_dims


@dataclass(frozen=True)
class ComputeEstimate:
    """Matmul FLOPs per step: the model's (all devices) and one device's as compiled."""

    model_flops: float  # msjax.observe.flops.flops_per_step: all devices, no recomputation
    layers_flops: float  # one device's decoder layers, recomputation and bubble included
    head_flops: float  # one device's unembedding (the loss head), forward and backward
    devices: int

    @property
    def device_flops(self) -> float:
        return self.layers_flops + self.head_flops

    @property
    def ratio(self) -> float:
        """Compiled FLOPs over model FLOPs: 1 when every device does only its share once."""
        return self.device_flops * self.devices / self.model_flops


def _layer_forward_flops(
    config: Config, mesh: MeshShape, platform: str
) -> tuple[float, float, float]:
    """Per token and layer: (the forward's matmul FLOPs, the attention's part of them, the part
    that a recompute never needs: the layer's last projections, whose outputs the backward pass
    does not read, so XLA drops them from a rematerialised forward)."""
    model = config.model
    # the parameters a token runs (a mixture of experts: its active experts and the router)
    layer_params = (count_params(model).active_matmul - model.vocab_size * model.embed_dim) / (
        model.num_layers
    )
    seq = config.data.seq_len
    # the XLA path computes every score of its query blocks' key spans and masks; kernels skip
    # masked blocks of keys too
    context = (
        mean_causal_context(seq, model.attention_window)
        if attention_is_fused(model)
        else blocked_keys_per_query(seq, model.attention_window)
    )
    attention = 4.0 * model.num_heads * model.resolved_head_dim * context  # scores and values
    last = 2.0 * _down_projection_width(model) * model.embed_dim  # the MLP's down projection
    if model.parallel_block:  # and the attention's output projection, added beside it
        last += 2.0 * model.num_heads * model.resolved_head_dim * model.embed_dim
    experts = _expanded_expert_flops(config, mesh, platform)
    return 2.0 * layer_params + attention + experts, attention, last


def _expanded_expert_flops(config: Config, mesh: MeshShape, platform: str) -> float:
    """Per token and layer, averaged over the layers: what the grouped matmul runs beyond the
    chosen experts. XLA's CPU ragged_dot computes each routed row against every expert's weights
    (a dense dot, masked): num_experts times the grouped work. The padded row blocks (`blocks`)
    run their padding: each expert's rows rounded up to whole blocks, within the static bound of
    msjax.ops.grouped_matmul_blocks. Elsewhere the grouped matmul runs the routed rows alone."""
    model = config.model
    moe = model.moe
    if not moe.enabled:
        return 0.0
    expert = 2.0 * 3.0 * model.embed_dim * (moe.expert_mlp_dim or model.mlp_dim)  # per row
    moe_layers_share = (model.num_layers - moe.first_dense_layers) / model.num_layers
    if moe.matmul_impl == "xla" and platform == "cpu":
        return expert * moe.experts_per_token * (moe.num_experts - 1) * moe_layers_share
    if moe.matmul_impl != "blocks":
        return 0.0
    extra_rows = _block_padding_rows(config, mesh) / _layer_run_tokens(config, mesh)
    return expert * extra_rows * moe_layers_share


def _layer_run_tokens(config: Config, mesh: MeshShape) -> int:
    """The tokens one device runs through a layer at once (a microbatch's, if any)."""
    return local_dims(config, mesh).batch * config.data.seq_len


def _block_padding_rows(config: Config, mesh: MeshShape) -> int:
    """The rows one device's padded row blocks hold beyond its routed ones (tokens x k) in one
    MoE layer run: without expert parallelism its own tokens' choices over all experts; with it
    the exchange's buffers (every device's, msjax.parallel.experts) over its local experts."""
    moe = config.model.moe
    tokens = _layer_run_tokens(config, mesh)
    routed = tokens * moe.experts_per_token
    rows, experts_here = routed, moe.num_experts
    if mesh.expert > 1:
        experts_here = moe.num_experts // mesh.expert
        layer_tokens = tokens * config.mesh.batch_split()  # the capacity counts the whole batch
        capacity = expert_capacity(
            moe.capacity_factor, layer_tokens, moe.experts_per_token, moe.num_experts
        )
        rows = mesh.expert * buffer_rows(routed, experts_here, capacity)
    return padded_rows(rows, experts_here) - routed


def _down_projection_width(model: ModelConfig) -> float:
    """The MLP's hidden width a token's down projection reads, averaged over the layers: in a
    MoE layer its active experts' (top-k and shared) together."""
    moe = model.moe
    if not moe.enabled:
        return float(model.mlp_dim)
    active = (moe.experts_per_token + moe.shared_experts) * (moe.expert_mlp_dim or model.mlp_dim)
    dense = moe.first_dense_layers
    return (dense * model.mlp_dim + (model.num_layers - dense) * active) / model.num_layers


def _layer_step_flops(config: Config, mesh: MeshShape, platform: str) -> float:
    """Per token and layer run: forward, backward (twice the forward) and recomputation."""
    forward, attention, last = _layer_forward_flops(config, mesh, platform)
    remat = config.model.remat
    keeps_dots = remat in ("dots", "attention")
    if mesh.pipe > 1 and keeps_dots and not PipelineLayout.of(config).table.branches_per_stage:
        remat = "full"  # the pipeline's vmap over stages gives every matmul a batch dimension
    # "attention" keeps attention's output: only the scores' matmul runs again
    recompute = {"none": 0.0, "full": forward - last, "dots": attention, "attention": attention / 2}
    recompute = recompute[remat]
    # 1F1B stashes each stage run's vjp residuals: one forward, one backward, and what remat
    # recomputes inside the backward, as without a pipeline
    return 3.0 * forward + recompute


def estimate_compute(
    config: Config, mesh: MeshShape, platform: str = PLANNED_BACKEND
) -> ComputeEstimate:
    """One device's matmul FLOPs per step of `config` on `mesh` (ConfigError if it cannot run).

    A device runs its replica's tokens (global_batch x seq / (data x fsdp)) through its tensor
    share (1 / tensor) of every matmul. On a pipe mesh it runs a microbatch through its stage's
    layers on every iteration of the schedule, bubble iterations included (GPipe, circular), or
    on each microbatch once each way (1F1B, which branches per device); the head runs on the
    ceil(M / P) microbatches its stage holds (GPipe, circular: 1 / P of the replica batch when
    P divides M), or on the last stage alone (1F1B).
    `platform` decides the attention kernel, as in `estimate_memory`.

    Not modelled: with fsdp beside pipe the partitioner may split the head's weight gradient
    between pipe ranks (tiny, fsdp 2 x pipe 2 or 4: the compiled step does 1% less).
    """
    config = config_for_mesh(config, mesh, platform)
    model = config.model
    tokens = config.train.global_batch * config.data.seq_len / config.mesh.batch_split()
    layer_runs = float(model.num_layers)  # per token of the replica
    head_runs = 1.0
    if mesh.pipe > 1:
        layout = PipelineLayout.of(config)
        table = layout.table
        # stage runs a device computes per microbatch (bubble runs included where idle stages
        # compute on zeros), and its share of the head (the last stage's alone under 1F1B)
        per_microbatch = table.stage_runs / table.microbatches
        layer_runs = per_microbatch * layout.layers_per_stage
        head_runs = table.head_share
    head = 6.0 * model.vocab_size * model.embed_dim  # forward and backward, per token
    return ComputeEstimate(
        model_flops=flops_per_step(config),
        layers_flops=tokens * layer_runs * _layer_step_flops(config, mesh, platform) / mesh.tensor,
        head_flops=tokens * head_runs * head / mesh.tensor,
        devices=mesh.devices,
    )
