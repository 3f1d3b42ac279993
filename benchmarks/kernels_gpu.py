"""Check and time every kernel of ours against its baselines, side by side, on one GPU.

Attention (forward + backward, bf16, GQA 4:1): our flash kernel vs the XLA reference, JAX's own
Pallas `mha` (kv heads repeated for it; it has no window) and cuDNN, over seq 1k/4k/16k, head
dim 64/128, window none/1k/4k. RMSNorm (alone and fused with the residual add), ours in Pallas
and in jax-triton, vs XLA and JAX's Pallas `rms_norm`, as a share of measured copy bandwidth.
Fused cross-entropy vs XLA, with the compiled temp memory of each. Every kernel is first checked
against its reference.

    python benchmarks/kernels_gpu.py [--smoke] [--max-seconds 270]

Without a GPU the script runs its smoke form: tiny shapes in the Pallas interpreter, checks
only (the times are the interpreter's and mean nothing), and no jax-triton kernel (GPU only).
TFLOP/s count useful matmul FLOPs: attention forward 4 x visible (query, key) pairs x head_dim
per head, backward twice that.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.kernel_timing import (  # noqa: E402
    SMOKE_TIMING,
    Row,
    Timing,
    failed_row,
    forward_and_backward,
    normal,
    print_checks,
    print_timings,
    relative_error,
    time_ms,
    with_speedups,
)
from pallas_kernels import cross_entropy as ce  # noqa: E402
from pallas_kernels import flash_attention as fa  # noqa: E402
from pallas_kernels import rms_norm as rn  # noqa: E402

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # max error / max |reference|, forward and grads


def jax_pallas_op(name: str):
    """JAX's own Pallas GPU op module (`attention`, `rms_norm`), or None once JAX has removed it.

    Imported here, not at the top: jax.experimental.pallas.ops.gpu is deprecated (tokamax took
    it over) and warns at import; the rows that need it are left out without it.
    """
    try:
        return importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")
    except ImportError:
        print(f"jax.experimental.pallas.ops.gpu.{name} unavailable: its rows are left out")
        return None


def check_precision(dtype):
    """float32 checks at full matmul precision: at default precision the Triton kernels and
    XLA's reference both use TF32 on a GPU, an error of about 1e-3 that is no kernel bug."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


# ---- attention ----------------------------------------------------------------------------------


def visible_pairs(seq: int, window: int | None) -> int:
    reach = np.minimum(np.arange(seq) + 1, window or seq)
    return int(reach.sum())


def attention_impls(window, segment_ids, interpret: bool, on_gpu: bool) -> dict[str, Callable]:
    def ours(q, k, v):
        return fa.flash_attention(
            q, k, v, window=window, segment_ids=segment_ids, interpret=interpret
        )

    def xla(q, k, v):
        return fa.reference(q, k, v, window=window, segment_ids=segment_ids)

    impls = {"pallas (ours)": ours, "xla": xla}
    jax_attention = jax_pallas_op("attention") if window is None else None
    if jax_attention is not None:

        def jax_mha(q, k, v):
            group = q.shape[2] // k.shape[2]
            k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
            return jax_attention.mha(
                q,
                k,
                v,
                segment_ids,
                sm_scale=q.shape[-1] ** -0.5,
                causal=True,
                interpret=interpret,
            )

        impls["jax pallas mha"] = jax_mha
    if on_gpu:

        def cudnn(q, k, v):
            mask = None
            if segment_ids is not None:
                mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
            return jax.nn.dot_product_attention(
                q,
                k,
                v,
                mask=mask,
                is_causal=True,
                implementation="cudnn",
                local_window_size=None if window is None else (window - 1, 0),
            )

        impls["cudnn"] = cudnn
    return impls


def check_attention(shape, window, with_segments, dtype, interpret, on_gpu, timing) -> list[Row]:
    """Every attention implementation against the float32 XLA reference, forward and grads."""
    batch, seq, heads, kv_heads, head_dim = shape
    q = normal((batch, seq, heads, head_dim), dtype, 0)
    k = normal((batch, seq, kv_heads, head_dim), dtype, 1)
    v = normal((batch, seq, kv_heads, head_dim), dtype, 2)
    cotangent = normal(q.shape, dtype, 3)
    segment_ids = None
    if with_segments:
        segment_ids = jnp.asarray(np.repeat([np.arange(seq) * 3 // seq + 1], batch, axis=0))
    as32 = [x.astype(jnp.float32) for x in (q, k, v, cotangent)]
    expected = forward_and_backward(
        lambda q, k, v: fa.reference(q, k, v, window=window, segment_ids=segment_ids)
    )(tuple(as32[:3]), as32[3])
    rows = []
    for name, impl in attention_impls(window, segment_ids, interpret, on_gpu).items():
        if name == "cudnn" and dtype == jnp.float32:
            continue  # cuDNN flash attention takes 16-bit inputs only
        step = forward_and_backward(impl)
        got = step((q, k, v), cotangent)
        rows.append(
            {
                "kernel": "flash_attention",
                "check": f"{shape} window={window} segments={with_segments}",
                "impl": name,
                "dtype": jnp.dtype(dtype).name,
                "max_error": relative_error(got, expected),
                "tolerance": TOLERANCE[jnp.dtype(dtype).name],
                "ms": time_ms(step, (q, k, v), cotangent, timing=timing),
            }
        )
    return rows


def time_attention(shape, window, interpret, on_gpu, timing) -> list[Row]:
    batch, seq, heads, kv_heads, head_dim = shape
    dtype = jnp.bfloat16
    q = normal((batch, seq, heads, head_dim), dtype, 0)
    k = normal((batch, seq, kv_heads, head_dim), dtype, 1)
    v = normal((batch, seq, kv_heads, head_dim), dtype, 2)
    cotangent = normal(q.shape, dtype, 3)
    flops = 3 * 4 * batch * heads * head_dim * visible_pairs(seq, window)  # forward + backward
    rows = []
    for name, impl in attention_impls(window, None, interpret, on_gpu).items():
        try:
            ms = time_ms(forward_and_backward(impl), (q, k, v), cotangent, timing=timing)
        except Exception as error:
            rows.append(failed_row("flash_attention", shape, window, name, error))
            continue
        rows.append(
            {
                "kernel": "flash_attention",
                "case": f"seq={seq} d={head_dim} window={window}",
                "impl": name,
                "ms": ms,
                "rate": f"{flops / ms / 1e9:.1f} TFLOP/s",
            }
        )
    return with_speedups(rows)


# ---- RMSNorm ------------------------------------------------------------------------------------


def norm_kernels(interpret: bool, on_gpu: bool) -> dict[str, tuple[Callable, Callable]]:
    """Our (rms_norm, add_rms_norm) by impl: Pallas, and on a GPU the jax-triton kernel."""
    impls = {
        "pallas (ours)": (
            functools.partial(rn.rms_norm, eps=1e-5, interpret=interpret),
            functools.partial(rn.add_rms_norm, eps=1e-5, interpret=interpret),
        )
    }
    if on_gpu:
        from pallas_kernels import triton_rms_norm as trn  # imports jax-triton: GPU only

        impls["triton (ours)"] = (
            functools.partial(trn.rms_norm, eps=1e-5),
            functools.partial(trn.add_rms_norm, eps=1e-5),
        )
    return impls


def check_norms(shape, dtype, interpret, on_gpu, timing) -> list[Row]:
    x, residual = normal(shape, dtype, 0), normal(shape, dtype, 1)
    scale = 1.0 + 0.1 * normal(shape[-1:], jnp.float32, 2)
    cotangent = normal(shape, dtype, 3)
    rows = []
    cases = {
        # kernel: (which of our pair, reference, arguments, cotangent)
        "rms_norm": (0, rn.reference, (x, scale), cotangent),
        "add_rms_norm": (1, rn.reference_add, (x, residual, scale), (cotangent, cotangent)),
    }
    for kernel, (which, reference, args, ct) in cases.items():
        as32 = jax.tree.map(lambda a: a.astype(jnp.float32), (args, ct))
        expected = forward_and_backward(reference)(*as32)
        for name, pair in norm_kernels(interpret, on_gpu).items():
            step = forward_and_backward(pair[which])
            got = step(args, ct)
            rows.append(
                {
                    "kernel": kernel,
                    "check": f"{shape}",
                    "impl": name,
                    "dtype": jnp.dtype(dtype).name,
                    "max_error": relative_error(got, expected),
                    "tolerance": TOLERANCE[jnp.dtype(dtype).name],
                    "ms": time_ms(step, args, ct, timing=timing),
                }
            )
    return rows


def copy_bandwidth_gbps(shape, timing) -> float:
    """Measured memory bandwidth: XLA reading and writing a bf16 array of this shape."""
    x = normal(shape, jnp.bfloat16, 0)
    ms = time_ms(jax.jit(lambda x: x * 2), x, timing=timing)
    return 2 * x.nbytes / ms / 1e6


def time_norms(shape, interpret, on_gpu, timing, bandwidth_gbps) -> list[Row]:
    x, residual = normal(shape, jnp.bfloat16, 0), normal(shape, jnp.bfloat16, 1)
    scale = jnp.ones(shape[-1:], jnp.float32)
    zeros = jnp.zeros(shape[-1:], jnp.float32)
    ours = norm_kernels(interpret, on_gpu)
    jax_rms_norm = jax_pallas_op("rms_norm")
    theirs = {}
    if jax_rms_norm is not None:
        theirs["jax pallas rms_norm"] = lambda x, s: jax_rms_norm.rms_norm(
            x, s, zeros, interpret=interpret
        )
    rows = []
    cases = {
        # case: (arguments, bytes read + written, {impl: function})
        "rms_norm forward": (
            (x, scale),
            2 * x.nbytes,
            {
                **{name: pair[0] for name, pair in ours.items()},
                "xla": rn.reference,
                **theirs,
            },
        ),
        "add_rms_norm forward": (
            (x, residual, scale),
            4 * x.nbytes,
            {
                **{name: pair[1] for name, pair in ours.items()},
                "xla": rn.reference_add,
            },
        ),
    }
    for case, (arguments, moved, impls) in cases.items():
        case_rows = []
        for name, fn in impls.items():
            try:
                ms = time_ms(jax.jit(fn), *arguments, timing=timing)
            except Exception as error:
                case_rows.append(failed_row(case, shape, None, name, error))
                continue
            gbps = moved / ms / 1e6
            case_rows.append(
                {
                    "kernel": case,
                    "case": f"{shape}",
                    "impl": name,
                    "ms": ms,
                    "rate": f"{gbps:.0f} GB/s = {100 * gbps / bandwidth_gbps:.0f}% of copy",
                }
            )
        rows.extend(with_speedups(case_rows))
    return rows


# ---- cross-entropy ------------------------------------------------------------------------------


def check_cross_entropy(tokens, embed, vocab, dtype, interpret, block_sizes, timing) -> list[Row]:
    hidden = normal((tokens, embed), dtype, 0)
    unembedding = (0.1 * normal((embed, vocab), jnp.float32, 1)).astype(dtype)
    labels = jnp.asarray(np.random.default_rng(2).integers(0, vocab, tokens))
    cotangent = normal((tokens,), jnp.float32, 3)

    def ours(h, w):
        return ce.cross_entropy(h, w, labels, block_sizes=block_sizes, interpret=interpret)

    def reference(h, w):
        return ce.reference(h, w, labels)

    as32 = (hidden.astype(jnp.float32), unembedding.astype(jnp.float32))
    expected = forward_and_backward(reference)(as32, cotangent)
    step = forward_and_backward(ours)
    got = step((hidden, unembedding), cotangent)
    return [
        {
            "kernel": "cross_entropy",
            "check": f"tokens={tokens} embed={embed} vocab={vocab}",
            "impl": "pallas (ours)",
            "dtype": jnp.dtype(dtype).name,
            "max_error": relative_error(got, expected),
            "tolerance": TOLERANCE[jnp.dtype(dtype).name],
            "ms": time_ms(step, (hidden, unembedding), cotangent, timing=timing),
        }
    ]


def time_cross_entropy(tokens, embed, vocab, interpret, timing) -> list[Row]:
    hidden = normal((tokens, embed), jnp.bfloat16, 0)
    unembedding = (0.02 * normal((embed, vocab), jnp.float32, 1)).astype(jnp.bfloat16)
    labels = jnp.asarray(np.random.default_rng(2).integers(0, vocab, tokens))
    cotangent = jnp.ones((tokens,), jnp.float32)
    impls = {
        "pallas (ours)": lambda h, w: ce.cross_entropy(h, w, labels, interpret=interpret),
        "xla": lambda h, w: ce.reference(h, w, labels),
    }
    rows = []
    for name, impl in impls.items():
        step = forward_and_backward(impl)
        try:
            compiled = step.lower((hidden, unembedding), cotangent).compile()
            analysis = compiled.memory_analysis()
            temp_mib = getattr(analysis, "temp_size_in_bytes", 0) / 2**20 if analysis else 0
            ms = time_ms(compiled, (hidden, unembedding), cotangent, timing=timing)
        except Exception as error:
            rows.append(failed_row("cross_entropy", (tokens, embed, vocab), None, name, error))
            continue
        flops = 4 * 2 * tokens * embed * vocab  # forward, recomputed logits, dhidden, dunembed
        rows.append(
            {
                "kernel": "cross_entropy",
                "case": f"tokens={tokens} embed={embed} vocab={vocab}",
                "impl": name,
                "ms": ms,
                "rate": f"{flops / ms / 1e9:.1f} TFLOP/s, temp {temp_mib:.0f} MiB",
            }
        )
    return with_speedups(rows)


# ---- the run ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; forced without GPU")
    parser.add_argument("--max-seconds", type=float, default=270.0, help="stop timing after")
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    smoke = args.smoke or not on_gpu
    interpret = not on_gpu
    started = time.perf_counter()
    print(f"devices: {jax.devices()}; {'smoke form' if smoke else 'full sweep'}")

    if smoke:  # one check per kernel, float32; the interpreter compiles slowly
        attention_checks = [((1, 64, 4, 2, 16), None, True, (jnp.float32,))]  # mha: seq % 32
        norm_shapes, norm_dtypes = [(2, 8, 48)], (jnp.float32,)
        ce_shape, ce_blocks, ce_dtypes = (
            (24, 32, 100),
            ce.BlockSizes(16, 32, 16, 64),
            (jnp.float32,),
        )
        attention_timings = []
        timing = SMOKE_TIMING
    else:
        both = (jnp.float32, jnp.bfloat16)
        attention_checks = [
            ((2, 2048, 16, 4, 128), None, True, both),
            ((2, 2048, 16, 4, 64), 512, True, both),
        ]
        norm_shapes, norm_dtypes = [(8, 2048, 4096)], both
        ce_shape, ce_blocks, ce_dtypes = (4096, 2048, 32768), ce.BlockSizes(), both
        attention_timings = []
        for seq in (1024, 4096, 16384):
            for head_dim in (64, 128):
                heads = 2048 // head_dim  # embed 2048, GQA 4:1, 16k tokens a step
                for window in (None, 1024, 4096):
                    if window is None or window < seq:
                        attention_timings.append(
                            ((16384 // seq, seq, heads, heads // 4, head_dim), window)
                        )
        timing = Timing()

    checks: list[Row] = []
    for shape, window, segments, dtypes in attention_checks:
        for dtype in dtypes:
            with check_precision(dtype):
                checks += check_attention(shape, window, segments, dtype, interpret, on_gpu, timing)
    for shape in norm_shapes:
        for dtype in norm_dtypes:
            with check_precision(dtype):
                checks += check_norms(shape, dtype, interpret, on_gpu, timing)
    tokens, embed, vocab = ce_shape
    for dtype in ce_dtypes:
        with check_precision(dtype):
            checks += check_cross_entropy(tokens, embed, vocab, dtype, interpret, ce_blocks, timing)
    print_checks(checks)
    if smoke:
        print(f"total {time.perf_counter() - started:.0f} s")
        if not on_gpu:
            print("no GPU: the ms above are the Pallas interpreter's, not kernel speeds")
        return checks

    timings: list[Row] = []
    bandwidth = copy_bandwidth_gbps(norm_shapes[0], timing)
    print(f"measured copy bandwidth: {bandwidth:.0f} GB/s")
    for shape in norm_shapes:
        timings += time_norms(shape, interpret, on_gpu, timing, bandwidth)
    for shape, window in attention_timings:
        if time.perf_counter() - started > args.max_seconds:
            print(f"time budget spent: skipped attention {shape} window={window}")
            continue
        timings += time_attention(shape, window, interpret, on_gpu, timing)
    if time.perf_counter() - started <= args.max_seconds:
        timings += time_cross_entropy(tokens, embed, vocab, interpret, timing)
    print_timings(timings)
    print(f"total {time.perf_counter() - started:.0f} s")
    return checks


if __name__ == "__main__":
    failed = [row for row in main() if not row["max_error"] <= row["tolerance"]]
    sys.exit(1 if failed else 0)
