"""Each compiled kernel on a GPU at llama_1b's shapes (32 query / 8 kv heads of 64, 2048 wide,
vocab 128,256), forward and gradients against the plain-JAX reference in float32.

Marked `gpu` and skipped elsewhere (`pytest -m gpu`; benchmarks/gpu_suite.py runs them). Float32
runs under `jax.default_matmul_precision("highest")`: at default precision both the Triton kernels
and XLA's reference use TF32 on a GPU, an error of about 1e-3 that is no kernel bug.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cross_entropy as ce
from pallas_kernels import flash_attention as fa
from pallas_kernels import rms_norm as rn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled kernels need a GPU"),
]
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # max error / max |reference|
DTYPES = ["float32", "bfloat16"]
# llama_1b: embed 2048, heads 32 / 8 of 64, vocab 128,256; two rows of 2048 tokens
BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM, EMBED, VOCAB = 2, 2048, 32, 8, 64, 2048, 128256


def normal(shape, dtype, seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def max_relative_error(actual, expected) -> float:
    """Max |actual - expected| over max |expected| (at least 1), over every leaf."""
    worst = 0.0
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.isfinite(got).all(), "non-finite elements"
        scale = max(1.0, float(np.max(np.abs(want))))
        worst = max(worst, float(np.max(np.abs(got - want))) / scale)
    return worst


def value_and_grads(fn, args, cotangent):
    @jax.jit
    def run(args, cotangent):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(cotangent)

    return run(args, cotangent)


def assert_matches_reference(kernel, reference, args, cotangent, dtype: str) -> None:
    with jax.default_matmul_precision("highest"):
        as32 = jax.tree.map(lambda a: a.astype(jnp.float32), (args, cotangent))
        expected = value_and_grads(reference, *as32)
    precision = "highest" if dtype == "float32" else None  # bfloat16 kernels as they run
    with jax.default_matmul_precision(precision):
        got = value_and_grads(kernel, args, cotangent)
    error = max_relative_error(got, expected)
    assert error <= TOLERANCE[dtype], f"max relative error {error:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_segments", [False, True], ids=["causal", "segments"])
def test_flash_attention_compiled_matches_reference(dtype, with_segments):
    q = normal((BATCH, SEQ, HEADS, HEAD_DIM), dtype, 0)
    k = normal((BATCH, SEQ, KV_HEADS, HEAD_DIM), dtype, 1)
    v = normal((BATCH, SEQ, KV_HEADS, HEAD_DIM), dtype, 2)
    segment_ids = None
    if with_segments:  # three packed documents per row
        segment_ids = jnp.asarray(np.repeat([np.arange(SEQ) * 3 // SEQ + 1], BATCH, axis=0))
    kernel = functools.partial(fa.flash_attention, segment_ids=segment_ids, interpret=False)
    reference = functools.partial(fa.reference, segment_ids=segment_ids)
    assert_matches_reference(kernel, reference, (q, k, v), normal(q.shape, dtype, 3), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_add_rms_norm_compiled_match_reference(dtype):
    x, residual = normal((BATCH, SEQ, EMBED), dtype, 0), normal((BATCH, SEQ, EMBED), dtype, 1)
    scale = 1.0 + 0.1 * normal((EMBED,), jnp.float32, 2)
    cotangent = normal(x.shape, dtype, 3)
    norm = functools.partial(rn.rms_norm, eps=1e-5, interpret=False)
    assert_matches_reference(norm, rn.reference, (x, scale), cotangent, dtype)
    add_norm = functools.partial(rn.add_rms_norm, eps=1e-5, interpret=False)
    assert_matches_reference(
        add_norm, rn.reference_add, (x, residual, scale), (cotangent, cotangent), dtype
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_compiled_matches_reference_at_llama_vocab(dtype):
    tokens = 4096
    hidden = normal((tokens, EMBED), dtype, 0)
    unembedding = (0.02 * normal((EMBED, VOCAB), jnp.float32, 1)).astype(dtype)
    labels = jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, tokens))
    cotangent = normal((tokens,), jnp.float32, 3)

    def kernel(h, w):
        return ce.cross_entropy(h, w, labels, interpret=False)

    def reference(h, w):
        return ce.reference(h, w, labels)

    assert_matches_reference(kernel, reference, (hidden, unembedding), cotangent, dtype)


def test_cudnn_attention_matches_reference_in_bfloat16():
    q = normal((BATCH, SEQ, HEADS, HEAD_DIM), "bfloat16", 0)
    k = normal((BATCH, SEQ, KV_HEADS, HEAD_DIM), "bfloat16", 1)
    v = normal((BATCH, SEQ, KV_HEADS, HEAD_DIM), "bfloat16", 2)

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    assert_matches_reference(
        cudnn, fa.reference, (q, k, v), normal(q.shape, "bfloat16", 3), "bfloat16"
    )
