"""The Pallas grouped matmul (interpreted on CPU) and the padded row blocks of plain JAX against
jax.lax.ragged_dot (forward and gradients), the blocks' compiled FLOPs, and the dispatch through
msjax.ops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax import ops
from msjax.observe.compiled_flops import compiled_flops
from msjax.ops.grouped_matmul_blocks import block_count, grouped_matmul_blocks
from pallas_kernels import grouped_matmul as gm

# 37 rows over blocks of 16: group 1 empty, groups cross block boundaries, 3 rows past the
# groups (ragged_dot gives them zeros)
GROUP_SIZES = (5, 0, 13, 9, 7)
ROWS, K, N = 37, 8, 12


def _inputs():
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (ROWS, K), jnp.float32)
    w = jax.random.normal(keys[1], (len(GROUP_SIZES), K, N), jnp.float32)
    cotangent = jax.random.normal(keys[2], (ROWS, N), jnp.float32)
    return x, w, jnp.array(GROUP_SIZES, jnp.int32), cotangent


def test_kernel_forward_and_gradients_match_ragged_dot():
    x, w, sizes, cotangent = _inputs()

    def loss(matmul, x, w):
        return jnp.sum(matmul(x, w, sizes) * cotangent)

    kernel = lambda x, w, sizes: gm.grouped_matmul(x, w, sizes, interpret=True)  # noqa: E731
    np.testing.assert_allclose(kernel(x, w, sizes), gm.reference(x, w, sizes), atol=1e-5)
    assert float(jnp.abs(kernel(x, w, sizes)[-3:]).max()) == 0.0
    kernel_grads = jax.grad(loss, argnums=(1, 2))(kernel, x, w)
    reference_grads = jax.grad(loss, argnums=(1, 2))(gm.reference, x, w)
    for got, want in zip(kernel_grads, reference_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    assert float(jnp.abs(kernel_grads[1][1]).max()) == 0.0  # the empty group's weights


@pytest.mark.parametrize("block_rows", [4, 16, 64])
def test_blocks_forward_and_gradients_match_ragged_dot(block_rows):
    """Blocks of 4 split groups over several blocks; of 64, one block holds a whole group."""
    x, w, sizes, cotangent = _inputs()

    def loss(matmul, x, w):
        return jnp.sum(matmul(x, w, sizes) * cotangent)

    blocks = lambda x, w, sizes: grouped_matmul_blocks(x, w, sizes, block_rows)  # noqa: E731
    np.testing.assert_allclose(blocks(x, w, sizes), gm.reference(x, w, sizes), atol=1e-5)
    assert float(jnp.abs(blocks(x, w, sizes)[-3:]).max()) == 0.0  # rows past every group
    block_grads = jax.grad(loss, argnums=(1, 2))(blocks, x, w)
    reference_grads = jax.grad(loss, argnums=(1, 2))(gm.reference, x, w)
    for got, want in zip(block_grads, reference_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    assert float(jnp.abs(block_grads[1][1]).max()) == 0.0  # the empty group's weights


@pytest.mark.parametrize("sizes", [(0, 0, 0, 0, 0), (37, 0, 0, 0, 0), (0, 0, 0, 0, 37)])
def test_blocks_take_all_rows_in_one_group_or_none(sizes):
    x, w, _, _ = _inputs()
    group_sizes = jnp.array(sizes, jnp.int32)
    np.testing.assert_allclose(
        grouped_matmul_blocks(x, w, group_sizes, 8), gm.reference(x, w, group_sizes), atol=1e-5
    )


def test_blocks_compile_to_the_padded_rows_alone_forward_and_backward():
    """block_count x block_rows rows times k x n once forward, twice more backward (dx, dw): not
    every group on every row as XLA's CPU ragged_dot."""
    x, w, sizes, cotangent = _inputs()

    def loss(x, w):
        return jnp.sum(grouped_matmul_blocks(x, w, sizes, 8) * cotangent)

    padded = block_count(ROWS, len(GROUP_SIZES), 8) * 8  # ceil((37 + 5 * 7) / 8) = 9 blocks
    assert padded == 72
    forward = jax.jit(grouped_matmul_blocks, static_argnums=3).lower(x, w, sizes, 8).compile()
    assert compiled_flops(forward.as_text()).total == 2 * padded * K * N
    both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).compile()
    assert compiled_flops(both.as_text()).total == 3 * 2 * padded * K * N


def test_reference_is_each_row_times_its_groups_weights():
    x, w, sizes, _ = _inputs()
    groups = np.repeat(np.arange(len(GROUP_SIZES)), GROUP_SIZES)
    expected = np.zeros((ROWS, N), np.float32)
    for row, group in enumerate(groups):
        expected[row] = np.asarray(x[row]) @ np.asarray(w[group])
    np.testing.assert_allclose(gm.reference(x, w, sizes), expected, atol=1e-4)


@pytest.mark.parametrize("impl", ["xla", "blocks", "pallas"])
def test_ops_dispatch_runs_the_chosen_grouped_matmul(impl):
    x, w, sizes, _ = _inputs()
    np.testing.assert_allclose(
        ops.grouped_matmul(x, w, sizes, impl=impl), gm.reference(x, w, sizes), atol=1e-5
    )


def test_ops_refuse_an_unresolved_grouped_matmul():
    x, w, sizes, _ = _inputs()
    with pytest.raises(ValueError, match=r"model\.moe\.matmul_impl=.auto. reached msjax\.ops"):
        ops.grouped_matmul(x, w, sizes, impl="auto")
