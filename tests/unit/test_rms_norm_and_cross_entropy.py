"""The Pallas RMSNorm (alone and fused with the residual add) and the fused unembedding +
cross-entropy kernels against their plain-JAX references, in the Pallas interpreter. Helpers and
tolerances: test_kernels.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels import FEW, assert_close, normal, outside_kernel_shapes, rounded, value_and_vjp

from pallas_kernels import cross_entropy as ce
from pallas_kernels import rms_norm as rn

# ---- 1. RMSNorm, alone and fused with the residual add ------------------------------------------


@st.composite
def norm_cases(draw):
    leading = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=2)))
    dim = draw(st.sampled_from([3, 8, 24, 33, 64, 96]))  # dim 1: ill-conditioned dx
    return {
        "shape": (*leading, dim),
        "dtype": draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
        "fused": draw(st.booleans()),
        "block_rows": draw(st.sampled_from([None, 1, 2, 4])),
        "seed": draw(st.integers(0, 2**16)),
    }


def check_norm_matches_reference(shape, dtype, fused, block_rows, seed) -> None:
    x, residual = rounded(normal(shape, seed), dtype), rounded(normal(shape, seed + 1), dtype)
    scale = 1.0 + 0.5 * normal(shape[-1:], seed + 2)
    cotangent = rounded(normal(shape, seed + 3), dtype)
    if fused:
        args = (x, residual, scale)
        cotangent = (cotangent, rounded(normal(shape, seed + 4), dtype))

        def kernel(x, residual, scale):
            return rn.add_rms_norm(x, residual, scale, eps=1e-5, block_rows=block_rows)

        reference = rn.reference_add
    else:
        args = (x, scale)

        def kernel(x, scale):
            return rn.rms_norm(x, scale, eps=1e-5, block_rows=block_rows)

        reference = rn.reference
    low = tuple(a.astype(dtype) if a.ndim == len(shape) else a for a in args)
    out, grads = value_and_vjp(kernel, low, jax.tree.map(lambda c: c.astype(dtype), cotangent))
    expected_out, expected_grads = value_and_vjp(reference, args, cotangent)
    for i, (got, expected) in enumerate(
        zip(jax.tree.leaves(out), jax.tree.leaves(expected_out), strict=True)
    ):
        assert got.dtype == dtype
        assert_close(got, expected, dtype, f"output {i} of {shape} {dtype.__name__}")
    for i, (got, expected) in enumerate(zip(grads, expected_grads, strict=True)):
        assert_close(got, expected, dtype, f"gradient {i} of {shape} {dtype.__name__}")


@FEW
@given(case=norm_cases())
def test_rms_norm_matches_reference_forward_and_gradients(case):
    check_norm_matches_reference(**case)


def test_rms_norm_backward_walking_many_row_blocks_per_program_matches_reference():
    # 4100 rows of one-row blocks: each backward program walks 8 blocks; the last is partial.
    check_norm_matches_reference((4100, 8), jnp.float32, True, 1, seed=11)


# ---- 2. fused unembedding + cross-entropy -------------------------------------------------------


@st.composite
def cross_entropy_cases(draw):
    return {
        "tokens": draw(st.integers(1, 40)),
        "embed": draw(st.sampled_from([8, 24, 40])),
        "vocab": draw(st.integers(1, 300)),
        "dtype": draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
        "blocks": ce.BlockSizes(
            block_tokens=draw(st.sampled_from([8, 16])),
            block_vocab=draw(st.sampled_from([8, 32])),
            block_embed=draw(st.sampled_from([8, 16])),
            backward_chunk=draw(st.sampled_from([32, 64, 8192])),
        ),
        "seed": draw(st.integers(0, 2**16)),
    }


def cross_entropy_inputs(tokens, embed, vocab, dtype, seed):
    hidden = rounded(normal((tokens, embed), seed), dtype)
    unembedding = rounded(0.3 * normal((embed, vocab), seed + 1), dtype)
    labels = jnp.asarray(np.random.default_rng(seed).integers(0, vocab, tokens), jnp.int32)
    return hidden, unembedding, labels, normal((tokens,), seed + 2)


def check_cross_entropy_matches_reference(case) -> None:
    dtype, blocks = case["dtype"], case["blocks"]
    hidden, unembedding, labels, cotangent = cross_entropy_inputs(
        case["tokens"], case["embed"], case["vocab"], dtype, case["seed"]
    )

    def kernel(h, w):
        return ce.cross_entropy(h, w, labels, block_sizes=blocks)

    out, grads = value_and_vjp(kernel, (hidden.astype(dtype), unembedding.astype(dtype)), cotangent)
    expected_out, expected_grads = value_and_vjp(
        lambda h, w: ce.reference(h, w, labels), (hidden, unembedding), cotangent
    )
    assert out.dtype == jnp.float32
    assert_close(out, expected_out, dtype, f"losses of {case}")
    for name, grad, expected in zip(("hidden", "unembedding"), grads, expected_grads, strict=True):
        assert grad.dtype == dtype
        assert_close(grad, expected, dtype, f"d{name} of {case}")


@settings(max_examples=3, deadline=None, derandomize=True)
@given(case=cross_entropy_cases())
def test_cross_entropy_matches_reference_forward_and_gradients(case):
    check_cross_entropy_matches_reference(case)


def test_cross_entropy_merges_vocab_splits_of_several_tiles_each():
    # 16 token blocks want 32 vocab splits of the 38 tiles: 19 splits of 2 tiles, one partial.
    blocks = ce.BlockSizes(block_tokens=8, block_vocab=8, block_embed=8, backward_chunk=64)
    case = {"tokens": 128, "embed": 8, "vocab": 300, "dtype": jnp.float32, "blocks": blocks}
    check_cross_entropy_matches_reference({**case, "seed": 5})


def test_cross_entropy_never_holds_logits_for_all_tokens_and_the_whole_vocab():
    tokens, embed, vocab, chunk = 24, 16, 256, 64
    hidden, unembedding, labels, _ = cross_entropy_inputs(tokens, embed, vocab, jnp.float32, 0)
    blocks = ce.BlockSizes(8, 32, 8, backward_chunk=chunk)

    def loss(h, w):
        return jnp.sum(ce.cross_entropy(h, w, labels, block_sizes=blocks))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(hidden, unembedding).jaxpr
    shapes = set(outside_kernel_shapes(jaxpr))
    assert (tokens, chunk) in shapes  # one backward chunk of d_logits at a time
    assert not any(tokens in shape and vocab in shape for shape in shapes), sorted(shapes)
