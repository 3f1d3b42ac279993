"""Predicted step time and MFU from a device's peak and link bandwidths; MegaScale's Table 2.

Compute time is the step's hardware FLOPs (model FLOPs plus recomputation) at a fraction of peak;
each collective takes its ring bytes over the link its mesh axis spans (inside a node or across
nodes). Two bounds: `serial` adds every collective to the compute, `overlapped` hides each link's
traffic behind the compute. The paper's own layout (interleaved 1F1B, tensor 8 x pipeline 8, ZeRO-2)
is modelled beside msjax's mesh, whose pipe axis runs msjax's GPipe or circular schedule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from msjax.config import Config
from msjax.observe.flops import count_params, flops_per_step
from msjax.parallel.pipeline import PipelineLayout as PipelineSchedule
from msjax.planner.candidates import MeshShape, config_for_mesh, mesh_of_config
from msjax.planner.communication import (
    estimate_communication,
    forward_passes,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
)


@dataclass(frozen=True)
class Hardware:
    """One device and its links. Defaults: A100 SXM nodes as MegaScale ran (§6, Table 2)."""

    peak_tflops: float = 312.0  # dense bf16
    matmul_efficiency: float = 0.8  # share of peak that large bf16 GEMMs sustain on an A100
    intra_node_gb_s: float = 300.0  # NVLink 3: 600 GB/s both ways per GPU, 300 each way
    inter_node_gb_s: float = 25.0  # one 200 Gb/s NIC per GPU (MegaScale: 8 x 200G per node)
    devices_per_node: int = 8

    def describe(self) -> str:
        return (
            f"{self.peak_tflops:g} TFLOP/s peak at {self.matmul_efficiency:.0%} matmul "
            f"efficiency; links {self.intra_node_gb_s:g} GB/s inside a node of "
            f"{self.devices_per_node}, {self.inter_node_gb_s:g} GB/s per device across nodes"
        )


@dataclass(frozen=True)
class PipelineLayout:
    """Interleaved 1F1B pipeline (MegaScale's 175B: 8 stages, 6 virtual stages each)."""

    stages: int = 8
    virtual_stages: int = 6
    micro_batch: int = 1
    tensor: int = 8


@dataclass(frozen=True)
class StepPrediction:
    """Predicted time of one step on `devices` devices; comm times per mesh axis."""

    devices: int
    layout: str
    model_flops: float  # per step, all devices
    compute_s: float
    bubble_s: float
    comm_s: dict[str, float]
    intra_node_s: float
    inter_node_s: float
    peak_tflops: float

    @property
    def serial_s(self) -> float:
        return self.compute_s + self.bubble_s + sum(self.comm_s.values())

    @property
    def overlapped_s(self) -> float:
        return max(self.compute_s + self.bubble_s, self.intra_node_s, self.inter_node_s)

    def mfu(self, step_s: float) -> float:
        return self.model_flops / (step_s * self.devices * self.peak_tflops * 1e12)


def recompute_factor(config: Config) -> float:
    """Hardware FLOPs / model FLOPs: recomputation under `model.remat` (Korthikanti et al. 2022).

    "full" runs every layer's forward twice: 8 instead of 6 FLOPs per parameter and token.
    "dots" keeps the projections and recomputes the attention's score and value products;
    "attention" also keeps attention's output and recomputes only the scores.
    """
    # every schedule recomputes only what remat asks (1F1B stashes its stages' vjp residuals)
    return _layer_recompute_factor(config)


def _layer_recompute_factor(config: Config) -> float:
    remat = config.model.remat
    if remat == "full":
        return 4.0 / 3.0
    if remat in ("dots", "attention"):
        model, seq = config.model, config.data.seq_len
        context = seq if model.attention_window is None else min(model.attention_window, seq)
        attention = 12 * model.num_layers * model.num_heads * model.resolved_head_dim * context
        per_token = 6 * count_params(model).active_matmul + attention
        recomputed = attention / 3.0 if remat == "dots" else attention / 6.0  # scores only
        return 1.0 + recomputed / per_token
    return 1.0


def _inside_node(stride: int, size: int, hardware: Hardware) -> bool:
    """Whether an axis of `size` whose neighbours are `stride` devices apart stays in a node."""
    return stride * size <= hardware.devices_per_node


def _compute_s(config: Config, devices: int, hardware: Hardware) -> float:
    hardware_flops = flops_per_step(config) * recompute_factor(config) / devices
    return hardware_flops / (hardware.peak_tflops * 1e12 * hardware.matmul_efficiency)


def _prediction(
    config: Config,
    devices: int,
    layout: str,
    compute_s: float,
    bubble_s: float,
    comm: dict[str, tuple[float, bool]],  # axis -> (bytes per device, inside a node)
    hardware: Hardware,
) -> StepPrediction:
    comm_s = {
        axis: size / (1e9 * (hardware.intra_node_gb_s if inside else hardware.inter_node_gb_s))
        for axis, (size, inside) in comm.items()
    }
    return StepPrediction(
        devices=devices,
        layout=layout,
        model_flops=flops_per_step(config),
        compute_s=compute_s,
        bubble_s=bubble_s,
        comm_s=comm_s,
        intra_node_s=sum(comm_s[axis] for axis, (_, inside) in comm.items() if inside),
        inter_node_s=sum(comm_s[axis] for axis, (_, inside) in comm.items() if not inside),
        peak_tflops=hardware.peak_tflops,
    )


def predict_mesh_step(config: Config, mesh: MeshShape, hardware: Hardware) -> StepPrediction:
    """msjax's own layout: data x fsdp x expert x pipe x tensor, tensor innermost (ConfigError if
    invalid). A pipe mesh adds its bubble: (P - 1) / (R M) of the compute (R = 1 for gpipe and
    1F1B), the iterations in which stages run on nothing."""
    config = config_for_mesh(config, mesh)
    comm = estimate_communication(config, mesh)
    strides = {  # mesh order: data, fsdp, expert, pipe, tensor (innermost)
        "tensor": 1,
        "pipe": mesh.tensor,
        "expert": mesh.tensor * mesh.pipe,
        "fsdp": mesh.tensor * mesh.pipe * mesh.expert,
        "data": mesh.tensor * mesh.pipe * mesh.expert * mesh.fsdp,
    }
    sizes = mesh.sizes()
    inside = {axis: _inside_node(strides[axis], sizes[axis], hardware) for axis in strides}
    compute_s = _compute_s(config, mesh.devices, hardware)
    bubble_s = 0.0
    layout = mesh.describe()
    if mesh.pipe > 1:
        pipeline = PipelineSchedule.of(config)
        # idle stage-iterations over busy ones, read off the schedule's table
        bubble = pipeline.bubble_fraction
        bubble_s = compute_s * bubble / (1.0 - bubble)
        layout += f" ({config.pipeline.schedule}, {pipeline.microbatches} microbatches"
        layout += f" x {pipeline.repeats} repeats)" if pipeline.repeats > 1 else ")"
    return _prediction(
        config,
        mesh.devices,
        layout,
        compute_s,
        bubble_s,
        {axis: (size, inside[axis]) for axis, size in comm.by_axis().items()},
        hardware,
    )


def predict_pipeline_step(
    config: Config, devices: int, pipeline: PipelineLayout, hardware: Hardware
) -> StepPrediction:
    """What-if: data x pipeline x tensor with interleaved 1F1B and ZeRO-2 data parallelism."""
    tensor, stages = pipeline.tensor, pipeline.stages
    data = devices // (tensor * stages)
    model = config.model
    act_bytes = np.dtype(model.compute_dtype).itemsize
    sequences = config.train.global_batch / data  # per data replica, through every stage
    stream = sequences * config.data.seq_len * model.embed_dim * act_bytes
    passes = forward_passes(model.remat)
    layers_per_stage = model.num_layers / stages
    tensor_bytes = layers_per_stage * (2 * passes + 2) * ring_all_reduce_bytes(stream, tensor)
    # Each micro-batch crosses every virtual stage boundary forward and its gradient backward;
    # each tensor rank sends its 1/tensor slice (Megatron's scatter-gather, Narayanan et al. §4.1).
    pipe_bytes = 2 * pipeline.virtual_stages * stream / tensor if stages > 1 else 0.0
    # ZeRO-2 (MegaScale §3.2): reduce-scatter float32 gradients, all-gather compute-dtype weights.
    shard_params = count_params(model).total / (tensor * stages)
    data_bytes = ring_all_gather_bytes(shard_params * (4 + act_bytes), data) if data > 1 else 0
    compute_s = _compute_s(config, devices, hardware)
    micro_batches = sequences / pipeline.micro_batch
    bubble = (stages - 1) / (pipeline.virtual_stages * micro_batches)
    strides = {"tensor": (1, tensor), "pipe": (tensor, stages), "data": (tensor * stages, data)}
    inside = {axis: _inside_node(*strides[axis], hardware) for axis in strides}
    comm = {"tensor": tensor_bytes, "pipe": pipe_bytes, "data": data_bytes}
    return _prediction(
        config,
        devices,
        f"data {data} x pipe {stages} (x{pipeline.virtual_stages} virtual) x tensor {tensor}",
        compute_s,
        compute_s * bubble,
        {axis: (size, inside[axis]) for axis, size in comm.items()},
        hardware,
    )


@dataclass(frozen=True)
class Table2Row:
    """MegaScale (NSDI '24) Table 2: 175B strong scaling, Megatron-LM -> MegaScale."""

    gpus: int
    global_batch: int
    megatron_s: float
    megascale_s: float
    megatron_mfu: float
    megascale_mfu: float


MEGASCALE_TABLE2 = (
    Table2Row(256, 768, 40.0, 32.0, 0.530, 0.653),
    Table2Row(512, 768, 21.2, 16.5, 0.499, 0.635),
    Table2Row(768, 768, 15.2, 11.5, 0.467, 0.613),
    Table2Row(1024, 768, 11.9, 8.9, 0.447, 0.590),
    Table2Row(3072, 6144, 29.02, 23.66, 0.487, 0.591),
    Table2Row(6144, 6144, 14.78, 12.21, 0.478, 0.573),
    Table2Row(8192, 6144, 12.24, 9.56, 0.433, 0.549),
    Table2Row(12288, 6144, 8.57, 6.34, 0.412, 0.552),
)


@dataclass(frozen=True)
class Table2Comparison:
    """One Table 2 row beside the predictions for the paper's layout and msjax's mesh."""

    row: Table2Row
    paper_layout: StepPrediction
    msjax_mesh: StepPrediction | None  # None when the config's mesh cannot fill the GPUs
    msjax_mesh_shape: MeshShape | None


def compare_with_table2(
    config: Config, hardware: Hardware, pipeline: PipelineLayout | None = None
) -> list[Table2Comparison]:
    """Predictions at each Table 2 GPU count and global batch, for `config`'s model."""
    pipeline = pipeline or PipelineLayout()
    comparisons = []
    for row in MEGASCALE_TABLE2:
        at_batch = dataclasses.replace(
            config, train=dataclasses.replace(config.train, global_batch=row.global_batch)
        )
        paper = predict_pipeline_step(at_batch, row.gpus, pipeline, hardware)
        mesh_shape = mesh_of_config(at_batch, row.gpus)
        own = predict_mesh_step(at_batch, mesh_shape, hardware) if mesh_shape else None
        comparisons.append(Table2Comparison(row, paper, own, mesh_shape))
    return comparisons
