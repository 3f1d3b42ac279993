"""The Pallas grouped matmul against jax.lax.ragged_dot (forward and gradients, interpreted on
CPU), and its dispatch through msjax.ops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax import ops
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


def test_reference_is_each_row_times_its_groups_weights():
    x, w, sizes, _ = _inputs()
    groups = np.repeat(np.arange(len(GROUP_SIZES)), GROUP_SIZES)
    expected = np.zeros((ROWS, N), np.float32)
    for row, group in enumerate(groups):
        expected[row] = np.asarray(x[row]) @ np.asarray(w[group])
    np.testing.assert_allclose(gm.reference(x, w, sizes), expected, atol=1e-4)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_ops_dispatch_runs_the_chosen_grouped_matmul(impl):
    x, w, sizes, _ = _inputs()
    np.testing.assert_allclose(
        ops.grouped_matmul(x, w, sizes, impl=impl), gm.reference(x, w, sizes), atol=1e-5
    )


def test_ops_refuse_an_unresolved_grouped_matmul():
    x, w, sizes, _ = _inputs()
    with pytest.raises(ValueError, match=r"model\.moe\.matmul_impl=.auto. reached msjax\.ops"):
        ops.grouped_matmul(x, w, sizes, impl="auto")
