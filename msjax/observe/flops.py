"""Analytic parameter and FLOP counts of the msjax model, and model FLOPs utilisation (MFU).

Counts come from the config alone (nothing is traced). Device peaks come from a table of GPUs, an
override, or, on CPU, a measured matmul. JAX is imported only by the functions that need a device.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from msjax.config import Config, ModelConfig
from msjax.errors import MsjaxError

if TYPE_CHECKING:
    import jax


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one model.

    `embedding` is the token table (a lookup, no FLOPs); `matmul` is every parameter that takes
    part in a matmul (attention, MLP, output projection). With tied embeddings the table is the
    output projection too, so it is in both, and once in `total`. Norm scales are in neither.
    `active_matmul` is the matmul parameters one token runs: in a mixture of experts its top-k
    and shared experts and the router, not every expert (`matmul` when dense).
    """

    total: int
    embedding: int
    matmul: int
    active_matmul: int


def mlp_params(model: ModelConfig) -> tuple[int, int]:
    """(all, one token's active) matmul parameters of the MLPs of all layers together."""
    embed, moe = model.embed_dim, model.moe
    dense = 3 * embed * model.mlp_dim  # gate, up [embed, mlp]; down [mlp, embed]
    if not moe.enabled:
        return model.num_layers * dense, model.num_layers * dense
    expert = 3 * embed * (moe.expert_mlp_dim or model.mlp_dim)  # one SwiGLU expert
    router = embed * moe.num_experts
    moe_layers = model.num_layers - moe.first_dense_layers
    every = router + (moe.num_experts + moe.shared_experts) * expert
    active = router + (moe.experts_per_token + moe.shared_experts) * expert
    dense_part = moe.first_dense_layers * dense
    return dense_part + moe_layers * every, dense_part + moe_layers * active


def count_params(model: ModelConfig) -> ParamCounts:
    """Exact parameter counts of the Llama-style decoder that `model` describes."""
    embed, heads, kv_heads = model.embed_dim, model.num_heads, model.num_kv_heads
    head_dim = model.resolved_head_dim
    attention = (
        embed * heads * head_dim  # q [embed, heads, head_dim]
        + 2 * embed * kv_heads * head_dim  # k, v [embed, kv_heads, head_dim]
        + heads * head_dim * embed  # o [heads, head_dim, embed]
    )
    mlp, active_mlp = mlp_params(model)
    # before attention and before the MLP; the parallel block feeds both from one norm
    block_norms = (1 if model.parallel_block else 2) * embed
    table = model.vocab_size * embed  # [vocab, embed]
    output = 0 if model.tied_embeddings else embed * model.vocab_size  # [embed, vocab]
    matmul = model.num_layers * attention + mlp + model.vocab_size * embed  # + unembedding
    norms = model.num_layers * block_norms + embed  # + the final norm
    if model.qk_norm:  # a query and a key scale [head_dim] per layer
        norms += model.num_layers * 2 * head_dim
    if model.moe.bias_balancing:  # a routing bias per expert and MoE layer
        norms += (model.num_layers - model.moe.first_dense_layers) * model.moe.num_experts
    return ParamCounts(
        total=table + output + model.num_layers * attention + mlp + norms,
        embedding=table,
        matmul=matmul,
        active_matmul=matmul - mlp + active_mlp,
    )


CPU_PEAK_SIZE = 2048  # the square float32 matmul a CPU's peak is measured with
CPU_PEAK_RUNS = 3  # its best of these runs

MFU_CONVENTION = (
    "model FLOPs = 6 x matmul params + 12 x layers x heads x head_dim x mean causal context "
    "per token (no recomputation; a mixture of experts' active params), over dense bf16 peak"
)


def mean_causal_context(seq_len: int, window: int | None) -> float:
    """Keys each query sees on average under the causal mask (and sliding window)."""
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    # queries 1..window see 1..window keys; the rest see window each
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) model FLOPs per token, without activation recomputation.

    6 x active matmul parameters (2 forward, 4 backward per multiply-add; Kaplan et al. 2020;
    a mixture of experts counts the experts a token runs, not all of them) plus the
    attention scores and values, 12 x layers x heads x head_dim x context (Megatron-LM,
    Narayanan et al. 2021; PaLM, Chowdhery et al. 2022, App. B), counting only the (query, key)
    pairs the causal mask keeps: the context is the mean visible keys per query, (seq_len + 1)
    / 2 for full causal attention, less under a sliding window. Recomputation under `remat` is
    hardware FLOPs, not model FLOPs, so it is not counted. MFU_CONVENTION says it in one line.
    """
    context = mean_causal_context(seq_len, model.attention_window)
    attention = 12 * model.num_layers * model.num_heads * model.resolved_head_dim * context
    return 6.0 * count_params(model).active_matmul + float(attention)


def flops_per_step(config: Config) -> float:
    """Training model FLOPs of one optimizer step: global_batch x seq_len tokens."""
    seq_len = config.data.seq_len
    return flops_per_token(config.model, seq_len) * config.train.global_batch * seq_len


def mfu(
    flops_per_step: float, step_time_s: float, num_devices: int, peak_tflops_per_device: float
) -> float:
    """Model FLOPs utilisation: the fraction (0..1) of the devices' peak that the step achieved."""
    for name, value in (
        ("step time", step_time_s),
        ("device count", num_devices),
        ("peak TFLOP/s", peak_tflops_per_device),
    ):
        if not value > 0:
            raise MsjaxError(f"MFU needs a positive {name}, got {value}")
    return flops_per_step / (step_time_s * num_devices * peak_tflops_per_device * 1e12)


# Dense bf16 peaks per device (no sparsity), matched in `device_kind`, e.g. "NVIDIA H100 80GB HBM3".
PEAK_TFLOPS: dict[str, float] = {
    "A100": 312.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,  # SXM
    "H200": 989.0,
}


def peak_tflops_for_device_kind(device_kind: str) -> float | None:
    """The table's peak for a `jax.Device.device_kind` string; None if no entry matches."""
    kind = device_kind.upper()
    for name in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100"
        if name.upper() in kind:
            return PEAK_TFLOPS[name]
    return None


def device_peak(device: jax.Device, override: float | None = None) -> tuple[float, str]:
    """Peak TFLOP/s of one device, and where it came from in words (for the run record): the
    override, the GPU table, or a measured CPU share."""
    if override is not None:
        return float(override), "train.peak_tflops"
    if device.platform == "cpu":
        import jax  # here, so that counting FLOPs never loads JAX

        # Simulated CPU devices share the machine's cores.
        devices = jax.local_device_count(backend="cpu")
        source = (
            f"measured: the machine's best of {CPU_PEAK_RUNS} float32 {CPU_PEAK_SIZE} x "
            f"{CPU_PEAK_SIZE} matmuls as the run started, shared by {devices} CPU devices"
        )
        return measure_cpu_peak_tflops() / devices, source
    peak = peak_tflops_for_device_kind(device.device_kind)
    if peak is None:
        known = ", ".join(PEAK_TFLOPS)
        raise MsjaxError(
            f"no known peak TFLOP/s for device kind {device.device_kind!r} "
            f"(platform {device.platform}; known: {known}); set train.peak_tflops to its dense "
            "bf16 peak per device"
        )
    return peak, f"datasheet: dense bfloat16 for {device.device_kind}"


def peak_tflops_per_device(device: jax.Device, override: float | None = None) -> float:
    """Peak TFLOP/s of one device (`device_peak`'s figure)."""
    return device_peak(device, override)[0]


@functools.cache
def measure_cpu_peak_tflops(size: int = CPU_PEAK_SIZE, runs: int = CPU_PEAK_RUNS) -> float:
    """The whole machine's float32 matmul TFLOP/s, best of `runs` on one CPU device (cached)."""
    import jax
    import jax.numpy as jnp

    device = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), device)  # [size, size]
    b = jax.device_put(jnp.full((size, size), 0.5, jnp.float32), device)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()  # compile and warm up
    best_s = math.inf
    for _ in range(runs):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best_s = min(best_s, time.perf_counter() - start)
    return 2.0 * size**3 / best_s / 1e12
