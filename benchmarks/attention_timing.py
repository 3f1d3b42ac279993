"""Causal attention rows for benchmarks/gpu_suite.py: our flash kernel, cuDNN and XLA's reference
at one shape, each with its error against the float32 reference and its forward and backward
time and TFLOP/s.

FLOPs count useful matmul work: forward 4 x visible (query, key) pairs x head_dim per head. The
backward is reported under both conventions in use: 2x the forward (msjax's MFU) and 2.5x
(FlashAttention-2 and cuDNN count the recomputed scores too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.kernel_timing import Timing, forward_and_backward, normal, relative_error, time_ms
from pallas_kernels import flash_attention as fa

BACKWARD_CONVENTIONS = {"2x": 2.0, "2.5x": 2.5}
ERROR_MAX_SEQ = 8192  # the float32 reference's [seq, seq] scores beyond this do not fit


def attention_impl(name: str, on_gpu: bool) -> Callable:
    """(query, key, value) -> causal attention out, by implementation name."""
    if name == "pallas":
        return lambda q, k, v: fa.flash_attention(q, k, v, interpret=not on_gpu)
    if name == "cudnn":
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"
        )
    if name == "xla":
        return lambda q, k, v: fa.reference(q, k, v)
    raise ValueError(f"unknown attention implementation {name!r}; accepted: pallas, cudnn, xla")


def causal_forward_flops(shape: tuple[int, int, int, int, int]) -> float:
    batch, seq, heads, _, head_dim = shape
    visible_pairs = seq * (seq + 1) // 2
    return 4.0 * batch * heads * head_dim * visible_pairs


def max_error(impl: Callable, q, k, v, cotangent) -> float:
    """Forward and gradients on the first batch row (bfloat16, as timed) against the float32
    reference traced at full matmul precision (a GPU's default for float32 is TF32)."""
    args, ct = (q[:1], k[:1], v[:1]), cotangent[:1]
    with jax.default_matmul_precision("highest"):
        as32 = jax.tree.map(lambda a: a.astype(jnp.float32), (args, ct))
        expected = forward_and_backward(fa.reference)(*as32)
    return relative_error(forward_and_backward(impl)(args, ct), expected)


def attention_rows(
    shape: tuple[int, int, int, int, int], impls: list[str], timing: Timing, on_gpu: bool
) -> Iterator[dict[str, Any]]:
    """One row per implementation, cuDNN's first so the others carry their ratio to it."""
    batch, seq, heads, kv_heads, head_dim = shape
    q = normal((batch, seq, heads, head_dim), jnp.bfloat16, 0)  # [batch, seq, heads, head_dim]
    k = normal((batch, seq, kv_heads, head_dim), jnp.bfloat16, 1)
    v = normal((batch, seq, kv_heads, head_dim), jnp.bfloat16, 2)
    cotangent = normal(q.shape, jnp.bfloat16, 3)
    forward_flops = causal_forward_flops(shape)
    cudnn_ms = None
    for name in sorted(impls, key=lambda impl: impl != "cudnn"):
        row: dict[str, Any] = {"impl": name, "shape": shape, "dtype": "bfloat16", "causal": True}
        try:
            impl = attention_impl(name, on_gpu)
            row["max_error"] = max_error(impl, q, k, v, cotangent) if seq <= ERROR_MAX_SEQ else None
            forward_ms = time_ms(jax.jit(impl), q, k, v, timing=timing)
            total_ms = time_ms(forward_and_backward(impl), (q, k, v), cotangent, timing=timing)
        except Exception as error:  # a kernel that fails is a row, not the end of the part
            yield {**row, "failed": f"{type(error).__name__}: {str(error)[:500]}"}
            continue
        backward_ms = total_ms - forward_ms
        row.update(forward_ms=forward_ms, forward_backward_ms=total_ms, backward_ms=backward_ms)
        row["forward_tflops"] = forward_flops / forward_ms / 1e9
        for label, factor in BACKWARD_CONVENTIONS.items():
            backward_flops = factor * forward_flops
            row[f"backward_tflops_{label}"] = (
                backward_flops / backward_ms / 1e9 if backward_ms > 0 else None
            )
            row[f"forward_backward_tflops_{label}"] = (
                (forward_flops + backward_flops) / total_ms / 1e9
            )
        if name == "cudnn":
            cudnn_ms = total_ms
        row["cudnn_ms_over_this"] = cudnn_ms / total_ms if cudnn_ms else None
        yield row
