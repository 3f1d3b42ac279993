"""The Pallas flash-attention kernel against its plain-JAX reference, in the Pallas interpreter:
windows, packed documents, grouped-query heads, and the blocks it must never read. Helpers and
tolerances: test_kernels.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels import FEW, assert_close, normal, pallas_calls, rounded, value_and_vjp

from pallas_kernels import flash_attention as fa

# ---- 1. flash attention against the reference ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    batch: int
    seq: int
    kv_heads: int
    group: int
    head_dim: int
    window: int | None
    segments: str  # none | packed (sorted, like packed documents) | scattered (any order)
    blocks: fa.BlockSizes
    seed: int

    def inputs(self):
        heads = self.kv_heads * self.group
        query = normal((self.batch, self.seq, heads, self.head_dim), self.seed)
        key = normal((self.batch, self.seq, self.kv_heads, self.head_dim), self.seed + 1)
        value = normal((self.batch, self.seq, self.kv_heads, self.head_dim), self.seed + 2)
        cotangent = normal(query.shape, self.seed + 3)
        rng = np.random.default_rng(self.seed)
        segment_ids = {
            "none": None,
            "packed": np.sort(rng.integers(1, 4, (self.batch, self.seq)), axis=1),
            "scattered": rng.integers(0, 3, (self.batch, self.seq)),
        }[self.segments]
        return (query, key, value), cotangent, segment_ids


def check_attention_matches_reference(case: AttentionCase, dtype) -> None:
    (query, key, value), cotangent, segment_ids = case.inputs()
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids, jnp.int32)
    args = tuple(rounded(x, dtype) for x in (query, key, value))
    cotangent = rounded(cotangent, dtype)

    def kernel(q, k, v):
        return fa.flash_attention(
            q, k, v, window=case.window, segment_ids=segment_ids, block_sizes=case.blocks
        )

    def reference(q, k, v):
        return fa.reference(q, k, v, window=case.window, segment_ids=segment_ids)

    out, grads = value_and_vjp(
        kernel, tuple(x.astype(dtype) for x in args), cotangent.astype(dtype)
    )
    expected_out, expected_grads = value_and_vjp(reference, args, cotangent)
    assert out.dtype == dtype
    assert_close(out, expected_out, dtype, f"output of {case}")
    for name, grad, expected in zip("qkv", grads, expected_grads, strict=True):
        assert grad.dtype == dtype
        assert_close(grad, expected, dtype, f"d{name} of {case}")


@st.composite
def attention_cases(draw) -> AttentionCase:
    seq = draw(st.integers(1, 40))
    return AttentionCase(
        batch=draw(st.integers(1, 2)),
        seq=seq,
        kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 2, 8])),
        head_dim=draw(st.sampled_from([4, 8, 16, 24])),
        window=draw(st.one_of(st.none(), st.integers(1, seq + 2))),
        segments=draw(st.sampled_from(["none", "packed", "scattered"])),
        blocks=fa.BlockSizes(*(draw(st.sampled_from([8, 16])) for _ in range(4))),
        seed=draw(st.integers(0, 2**16)),
    )


@FEW
@given(case=attention_cases())
def test_flash_attention_float32_matches_reference_forward_and_gradients(case):
    check_attention_matches_reference(case, jnp.float32)


@settings(max_examples=2, deadline=None, derandomize=True)
@given(case=attention_cases())
def test_flash_attention_bfloat16_matches_reference_forward_and_gradients(case):
    check_attention_matches_reference(case, jnp.bfloat16)


# Window one short of, equal to and one past the 8-wide blocks; documents that change on a block
# edge (row 0, at 16) and inside a block (row 1, at 9); GQA groups 1, 2 and 8.
EDGE_SEGMENTS = np.array([[1] * 16 + [2] * 16, [1] * 9 + [2] * 23])


@pytest.mark.parametrize(("group", "window"), [(1, 8), (2, 9), (8, 7)])
def test_flash_attention_matches_reference_at_window_and_document_edges(group, window):
    case = AttentionCase(
        batch=2,
        seq=32,
        kv_heads=1,
        group=group,
        head_dim=8,
        window=window,
        segments="none",
        blocks=fa.BlockSizes(8, 8, 8, 8),
        seed=group,
    )
    (query, key, value), cotangent, _ = case.inputs()
    segment_ids = jnp.asarray(EDGE_SEGMENTS)

    def kernel(q, k, v):
        return fa.flash_attention(
            q, k, v, window=window, segment_ids=segment_ids, block_sizes=case.blocks
        )

    def reference(q, k, v):
        return fa.reference(q, k, v, window=window, segment_ids=segment_ids)

    out, grads = value_and_vjp(kernel, (query, key, value), cotangent)
    expected_out, expected_grads = value_and_vjp(reference, (query, key, value), cotangent)
    assert_close(out, expected_out, jnp.float32, "output")
    for name, grad, expected in zip("qkv", grads, expected_grads, strict=True):
        assert_close(grad, expected, jnp.float32, f"d{name}")


def test_key_blocks_outside_the_window_are_never_read():
    # seq 64 in blocks of 8, window 8: query block i reads key blocks i-1 and i only. NaN in
    # key block 0 reaches query blocks 0 and 1 through 0 * NaN if read, even if masked; so
    # finite outputs (and dq) from query block 2 on prove the loops skip it.
    blocks = fa.BlockSizes(8, 8, 8, 8)
    query, key, value = normal((1, 64, 2, 8), 0), normal((1, 64, 1, 8), 1), normal((1, 64, 1, 8), 2)
    poisoned_key = key.at[:, :8].set(jnp.nan)
    poisoned_value = value.at[:, :8].set(jnp.nan)
    cotangent = normal(query.shape, 3)

    def kernel(q, k, v):
        return fa.flash_attention(q, k, v, window=8, block_sizes=blocks)

    out, (dq, _, _) = value_and_vjp(kernel, (query, poisoned_key, poisoned_value), cotangent)
    expected_out, (expected_dq, _, _) = value_and_vjp(
        lambda q, k, v: fa.reference(q, k, v, window=8), (query, key, value), cotangent
    )
    assert_close(out[:, 16:], expected_out[:, 16:], jnp.float32, "output past the poison")
    assert_close(dq[:, 16:], expected_dq[:, 16:], jnp.float32, "dq past the poison")
    assert np.isnan(np.asarray(out[:, :8])).all()  # the poison is real where it is visible


def test_query_blocks_outside_the_window_are_never_read_for_key_gradients():
    # Key block 0 is seen by queries 0..14 only; NaN gradients flowing into queries 16.. would
    # reach dk, dv of keys 0..7 if the dK/dV kernel visited their blocks.
    blocks = fa.BlockSizes(8, 8, 8, 8)
    query, key, value = normal((1, 64, 2, 8), 4), normal((1, 64, 1, 8), 5), normal((1, 64, 1, 8), 6)
    cotangent = normal(query.shape, 7)
    poisoned = cotangent.at[:, 16:].set(jnp.nan)

    def kernel(q, k, v):
        return fa.flash_attention(q, k, v, window=8, block_sizes=blocks)

    _, (_, dk, dv) = value_and_vjp(kernel, (query, key, value), poisoned)
    _, (_, expected_dk, expected_dv) = value_and_vjp(
        lambda q, k, v: fa.reference(q, k, v, window=8), (query, key, value), cotangent
    )
    assert_close(dk[:, :8], expected_dk[:, :8], jnp.float32, "dk of key block 0")
    assert_close(dv[:, :8], expected_dv[:, :8], jnp.float32, "dv of key block 0")
    assert np.isnan(np.asarray(dv[:, 16:])).all()


def test_grouped_query_kernels_read_kv_heads_in_place_without_repeating_them():
    query, key, value = (
        normal((1, 16, 8, 16), 0),
        normal((1, 16, 2, 16), 1),
        normal((1, 16, 2, 16), 2),
    )

    def loss(q, k, v):
        return jnp.sum(fa.flash_attention(q, k, v, block_sizes=fa.BlockSizes(8, 8, 8, 8)))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(query, key, value).jaxpr
    calls = pallas_calls(jaxpr)
    assert [eqn.params["name"] for eqn in calls] == [
        "flash_attention_forward",
        "flash_attention_dkv",
        "flash_attention_dq",
    ]
    for eqn in calls:
        shapes = [tuple(var.aval.shape) for var in eqn.invars]
        assert shapes[1] == shapes[2] == (1, 16, 2, 16), (eqn.params["name"], shapes)


def test_flash_attention_rejects_kv_heads_that_do_not_divide_query_heads():
    with pytest.raises(ValueError, match="kv heads dividing"):
        fa.flash_attention(
            normal((1, 8, 3, 8), 0), normal((1, 8, 2, 8), 1), normal((1, 8, 2, 8), 2)
        )
