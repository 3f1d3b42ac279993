"""The jax-triton RMSNorm (`model.norm_impl=triton`): never imported off GPU, refused there in one
line; on a GPU, held to the plain-JAX reference, forward and every gradient.

GPU tolerances are test_kernels.TOLERANCE, as a fraction of the largest expected magnitude:
float32 1e-5 (only summation order differs); bfloat16 2e-2 (inputs are rounded to bfloat16 once,
and kernel and reference are held against a float32 reference on those rounded inputs). The
kernels run with `zero_outputs=True`: every output buffer is cleared first, so an element a
kernel never writes reads 0, not what an earlier computation (the reference, say) left there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels import assert_close, normal, rounded, value_and_vjp

from msjax import ops
from msjax.config import Config, ModelConfig
from msjax.errors import ConfigError
from msjax.resolve import resolve, resolve_impl, resolve_model

ON_GPU = jax.default_backend() == "gpu"


gpu_only = pytest.mark.skipif(not ON_GPU, reason="jax-triton kernels run on a GPU only")


cpu_only = pytest.mark.skipif(ON_GPU, reason="checks the refusal off GPU")


@cpu_only
@pytest.mark.parametrize("step", ["resolve_impl", "resolve_model", "resolve"])
def test_triton_norm_off_gpu_is_a_one_line_config_error(step):
    # Refused where a run chooses its kernels, before any op could import jax-triton.
    backend = jax.default_backend()
    model = ModelConfig(norm_impl="triton")
    calls = {
        "resolve_impl": lambda: resolve_impl("triton", "norm_impl", backend),
        "resolve_model": lambda: resolve_model(model, backend),
        "resolve": lambda: resolve(Config(model=model), jax.device_count(), backend),
    }
    with pytest.raises(ConfigError, match=r"model.norm_impl=triton needs a GPU") as error:
        calls[step]()
    assert "\n" not in str(error.value)
    assert "auto, xla, pallas" in str(error.value)  # what would run instead


@gpu_only
def test_zeroed_outputs_read_zero_where_a_kernel_writes_nothing():
    # What `zero_outputs=True` relies on: jax-triton clears the buffer even when the allocator
    # hands back memory an earlier computation filled.
    import jax_triton
    import triton
    import triton.language as tl

    @triton.jit
    def write_first_half(x_ptr, out_ptr, HALF: tl.constexpr):
        offsets = tl.arange(0, HALF)
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets))

    def first_half(x):
        return jax_triton.triton_call(
            x,
            kernel=write_first_half,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(1,),
            zeroed_outputs=(0,),
            HALF=x.shape[0] // 2,
        )

    jax.block_until_ready(jnp.full((1024,), jnp.nan)).delete()  # leave NaNs in freed memory
    out = np.asarray(jax.jit(first_half)(jnp.ones(1024)))
    np.testing.assert_array_equal(out[:512], 1.0)
    np.testing.assert_array_equal(out[512:], 0.0)


NORM_SHAPES = [
    (1, 3),  # one row, dim far below one warp
    (3, 7, 33),  # dim not a power of two
    (2, 5, 96),
    (2500, 64),  # backward programs walk 3 rows each, the last program 1
    (2, 512, 5120),  # a model's rows: 1024 backward programs of one row
    (4, 8192),  # a wide row: 8 warps, 16-32 KiB in registers
]


@gpu_only
@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_triton_rms_norm_matches_reference_forward_and_gradients(shape, dtype, fused):
    from pallas_kernels import triton_rms_norm as trn

    x, residual = rounded(normal(shape, 0), dtype), rounded(normal(shape, 1), dtype)
    scale = 1.0 + 0.5 * normal(shape[-1:], 2)
    cotangent = rounded(normal(shape, 3), dtype)
    if fused:
        args = (x, residual, scale)
        cotangent = (cotangent, rounded(normal(shape, 4), dtype))

        def kernel(x, residual, scale):
            return trn.add_rms_norm(x, residual, scale, eps=1e-5, zero_outputs=True)

        reference = trn.reference_add
    else:
        args = (x, scale)

        def kernel(x, scale):
            return trn.rms_norm(x, scale, eps=1e-5, zero_outputs=True)

        reference = trn.reference
    low = tuple(a.astype(dtype) if a.ndim == len(shape) else a for a in args)
    out, grads = value_and_vjp(kernel, low, jax.tree.map(lambda c: c.astype(dtype), cotangent))
    expected_out, expected_grads = value_and_vjp(reference, args, cotangent)
    what = f"{shape} {jnp.dtype(dtype).name}"
    for i, (got, expected) in enumerate(
        zip(jax.tree.leaves(out), jax.tree.leaves(expected_out), strict=True)
    ):
        assert got.dtype == dtype
        assert_close(got, expected, dtype, f"output {i} of {what}")
    for i, (got, expected) in enumerate(zip(grads, expected_grads, strict=True)):
        assert got.dtype == low[i].dtype
        assert_close(got, expected, dtype, f"gradient {i} of {what}")


@gpu_only
def test_triton_dispatch_runs_the_jax_triton_kernel_and_pallas_does_not():
    x, scale = normal((4, 16, 64), 0), 1.0 + normal((64,), 1)

    def lowered(impl: str) -> str:
        def loss(x, scale):
            total, normed = ops.add_rms_norm(x, x, scale, eps=1e-5, impl=impl)
            return jnp.sum(total + normed + ops.rms_norm(x, scale, eps=1e-5, impl=impl))

        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, scale).as_text()

    assert lowered("triton").count("@triton_kernel_call") == 4  # two forwards, two backwards
    assert "@triton_kernel_call" not in lowered("pallas")


@gpu_only
def test_tiny_model_trains_five_steps_with_the_triton_norm_like_xla():
    # The kernel inside the sharded train step: per shard under shard_map, in the model's blocks.
    from test_parallel import small_config, train_losses

    def losses(norm_impl: str) -> list[float]:
        config = small_config(1, 1, 1)
        model = dataclasses.replace(config.model, norm_impl=norm_impl)
        with jax.default_matmul_precision("highest"):  # no TF32: only the norms differ
            return train_losses(dataclasses.replace(config, model=model))

    xla, triton = losses("xla"), losses("triton")
    np.testing.assert_allclose(triton, xla, rtol=1e-4)
    assert xla[-1] < xla[0]  # the model really trains
