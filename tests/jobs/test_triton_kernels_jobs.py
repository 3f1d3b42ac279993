"""The jax-triton RMSNorm (`model.norm_impl=triton`): never imported off GPU, refused there in one
line; on a GPU, held to the plain-JAX reference, forward and every gradient.

GPU tolerances are test_kernels.TOLERANCE, as a fraction of the largest expected magnitude:
float32 1e-5 (only summation order differs); bfloat16 2e-2 (inputs are rounded to bfloat16 once,
and kernel and reference are held against a float32 reference on those rounded inputs). The
kernels run with `zero_outputs=True`: every output buffer is cleared first, so an element a
kernel never writes reads 0, not what an earlier computation (the reference, say) left there.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from harness import REPO, job_env
from test_config import SMALL_RUN, assert_one_line_user_error
from test_config_jobs import run_cli
from test_triton_kernels import cpu_only

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
    env = job_env(JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE],
        cwd=REPO,
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
def test_train_cli_with_triton_norm_off_gpu_exits_2_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(tmp_path, *SMALL_RUN, "model.norm_impl=triton", f"run.dir={run_dir}")
    assert_one_line_user_error(
        result.returncode, result.stdout, result.stderr, "model.norm_impl=triton needs a GPU"
    )
    assert not run_dir.exists()
