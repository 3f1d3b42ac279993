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
import numpy as np

from benchmarks.kernel_timing import Timing, forward_and_backward, normal, relative_error, time_ms
from pallas_kernels import flash_attention as fa

BACKWARD_CONVENTIONS = {"2x": 2.0, "2.5x": 2.5}
ERROR_MAX_SEQ = 8192  # the float32 reference's [seq, seq] scores beyond this do not fit


def attention_impl(name: str, on_gpu: bool, segment_ids: jax.Array | None = None) -> Callable:
    """(query, key, value) -> causal attention out, by implementation name. With segment ids,
    cuDNN gets them as a dense [batch, 1, seq, seq] mask (JAX turns it into a dense bias)."""
    if name == "pallas":
        return lambda q, k, v: fa.flash_attention(
            q, k, v, segment_ids=segment_ids, interpret=not on_gpu
        )
    if name == "cudnn":
        mask = None
        if segment_ids is not None:  # [batch, 1, seq, seq]
            mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True, implementation="cudnn"
        )
    if name == "xla":
        return lambda q, k, v: fa.reference(q, k, v, segment_ids=segment_ids)
    raise ValueError(f"unknown attention implementation {name!r}; accepted: pallas, cudnn, xla")


def packed_segment_ids(batch: int, seq: int, documents: int) -> jax.Array:
    """[batch, seq] ids 1..documents: each row packs `documents` equal documents."""
    return jnp.asarray(np.repeat([np.arange(seq) * documents // seq + 1], batch, axis=0))


def causal_forward_flops(shape: tuple[int, int, int, int, int], documents: int = 1) -> float:
    """Useful forward FLOPs: pairs a query sees (causal, within its document) x 4 x head_dim."""
    batch, seq, heads, _, head_dim = shape
    lengths = np.bincount(np.arange(seq) * documents // seq)
    visible_pairs = int(sum(n * (n + 1) // 2 for n in lengths))
    return 4.0 * batch * heads * head_dim * visible_pairs


def max_error(name: str, on_gpu: bool, segment_ids, q, k, v, cotangent) -> float:
    """Forward and gradients on the first batch row (bfloat16, as timed) against the float32
    reference traced at full matmul precision (a GPU's default for float32 is TF32)."""
    first = None if segment_ids is None else segment_ids[:1]
    args, ct = (q[:1], k[:1], v[:1]), cotangent[:1]
    with jax.default_matmul_precision("highest"):
        as32 = jax.tree.map(lambda a: a.astype(jnp.float32), (args, ct))
        expected = forward_and_backward(attention_impl("xla", on_gpu, first))(*as32)
    got = forward_and_backward(attention_impl(name, on_gpu, first))(args, ct)
    return relative_error(got, expected)


def attention_rows(
    shape: tuple[int, int, int, int, int],
    impls: list[str],
    timing: Timing,
    on_gpu: bool,
    documents: int = 1,
) -> Iterator[dict[str, Any]]:
    """One row per implementation, cuDNN's first so the others carry their ratio to it. With
    documents > 1 each row packs that many (segment ids)."""
    batch, seq, heads, kv_heads, head_dim = shape
    q = normal((batch, seq, heads, head_dim), jnp.bfloat16, 0)  # [batch, seq, heads, head_dim]
    k = normal((batch, seq, kv_heads, head_dim), jnp.bfloat16, 1)
    v = normal((batch, seq, kv_heads, head_dim), jnp.bfloat16, 2)
    cotangent = normal(q.shape, jnp.bfloat16, 3)
    segment_ids = packed_segment_ids(batch, seq, documents) if documents > 1 else None
    forward_flops = causal_forward_flops(shape, documents)
    cudnn_ms = None
    for name in sorted(impls, key=lambda impl: impl != "cudnn"):
        row: dict[str, Any] = {"impl": name, "shape": shape, "dtype": "bfloat16", "causal": True}
        row["documents_per_row"] = documents
        if name == "cudnn" and segment_ids is not None:
            row["mask"] = "dense [batch, 1, seq, seq] from segment ids"
        try:
            impl = attention_impl(name, on_gpu, segment_ids)
            row["max_error"] = (  # None where the float32 reference does not fit
                max_error(name, on_gpu, segment_ids, q, k, v, cotangent)
                if seq <= ERROR_MAX_SEQ
                else None
            )
            forward_ms = time_ms(jax.jit(impl), q, k, v, timing=timing)
            total_ms = time_ms(forward_and_backward(impl), (q, k, v), cotangent, timing=timing)
        except Exception as error:  # a kernel that fails is a row, not the end of the part
            yield {**row, "failed": f"{type(error).__name__}: {str(error)[:500]}"}
            continue
        if name == "cudnn":
            cudnn_ms = total_ms
        row["cudnn_ms_over_this"] = cudnn_ms / total_ms if cudnn_ms else None
        yield {**row, **rates(forward_flops, forward_ms, total_ms)}


def rates(forward_flops: float, forward_ms: float, total_ms: float) -> dict[str, Any]:
    """ms and TFLOP/s of the forward, the backward (total - forward) and both, the backward
    under each convention."""
    backward_ms = total_ms - forward_ms
    row: dict[str, Any] = {
        "forward_ms": forward_ms,
        "forward_backward_ms": total_ms,
        "backward_ms": backward_ms,
        "forward_tflops": forward_flops / forward_ms / 1e9,
    }
    for label, factor in BACKWARD_CONVENTIONS.items():
        backward_flops = factor * forward_flops
        row[f"backward_tflops_{label}"] = (
            backward_flops / backward_ms / 1e9 if backward_ms > 0 else None
        )
        row[f"forward_backward_tflops_{label}"] = (forward_flops + backward_flops) / total_ms / 1e9
    return row
