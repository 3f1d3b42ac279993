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
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_config import SMALL_RUN, assert_one_line_user_error, run_cli
from test_kernels import assert_close, normal, rounded, value_and_vjp

from msjax import ops
from msjax.config import Config, ModelConfig
from msjax.errors import ConfigError
from msjax.resolve import resolve, resolve_impl, resolve_model

REPO_ROOT = Path(__file__).resolve().parents[1]
ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="jax-triton kernels run on a GPU only")
cpu_only = pytest.mark.skipif(ON_GPU, reason="checks the refusal off GPU")

# ---- 1. off GPU: nothing imports jax-triton, and `triton` is a one-line error -------------------

# A fresh interpreter (pytest's own may hold anything) that records every attempt to import
# triton or jax_triton, failed ones too: import msjax, its models, ops, kernel context and
# resolution and every Pallas kernel module, resolve each norm impl as a run does and run the
# norm under what it resolves to, then import the jax-triton kernel module.
IMPORT_PROBE = """
import importlib, importlib.abc, json, pkgutil, sys

asked = []

class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in ("triton", "jax_triton"):
            asked.append(name)
        return None  # the ordinary finders still import it

sys.meta_path.insert(0, Watch())
import jax
import jax.numpy as jnp
import msjax, msjax.models, msjax.ops, msjax.train, pallas_kernels
import msjax.models.attention, msjax.models.transformer, msjax.parallel.context, msjax.resolve
from msjax.errors import ConfigError

for module in pkgutil.iter_modules(pallas_kernels.__path__):
    if module.name != "triton_rms_norm":
        importlib.import_module(f"pallas_kernels.{module.name}")
x = jnp.ones((2, 8))
refused = []
for impl in ("auto", "xla", "pallas", "triton"):
    try:
        resolved = msjax.resolve.resolve_impl(impl, "norm_impl", jax.default_backend())
    except ConfigError:
        refused.append(impl)
        continue
    msjax.ops.add_rms_norm(x, x, jnp.ones(8), eps=1e-5, impl=resolved)
    msjax.ops.rms_norm(x, jnp.ones(8), eps=1e-5, impl=resolved)
before = list(asked)
try:
    import pallas_kernels.triton_rms_norm
except ImportError:
    pass  # no jax-triton here, or no GPU jaxlib for it
print(json.dumps({"before": before, "refused": refused, "after": asked}))
"""


@pytest.fixture(scope="module")
def import_probe() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_importing_msjax_and_running_every_cpu_norm_never_asks_for_triton_or_jax_triton(
    import_probe,
):
    assert import_probe["before"] == []
    assert import_probe["refused"] == ["triton"]  # refused before anything is imported


def test_the_triton_kernel_module_is_what_asks_for_jax_triton(import_probe):
    # so the probe above does watch the imports that would break a CPU-only jaxlib
    assert "jax_triton" in import_probe["after"]


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


@cpu_only
def test_train_cli_with_triton_norm_off_gpu_exits_2_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(tmp_path, *SMALL_RUN, "model.norm_impl=triton", f"run.dir={run_dir}")
    assert_one_line_user_error(
        result.returncode, result.stdout, result.stderr, "model.norm_impl=triton needs a GPU"
    )
    assert not run_dir.exists()


# ---- 2. on a GPU: the kernels against the reference ---------------------------------------------


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
