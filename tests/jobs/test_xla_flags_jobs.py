"""train.xla_profile: only flags the installed jaxlib knows reach XLA_FLAGS, the user's win, and
what was decided lands in the run directory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, job_env

# a newer jax installed beside the tests' own, to check its spellings (skipped when absent)
NEWER_JAXLIB_PYTHON = os.environ.get("MSJAX_NEWER_JAXLIB_PYTHON", "")


@pytest.mark.skipif(not NEWER_JAXLIB_PYTHON, reason="MSJAX_NEWER_JAXLIB_PYTHON not set")
def test_the_flags_for_a_newer_jaxlib_are_all_known_to_it() -> None:
    """Ask the newer jaxlib's own libraries which flags exist (a separate interpreter)."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import importlib.util as u, pathlib; "
        "spec = u.spec_from_file_location('f', sys.argv[1] + '/msjax/parallel/xla_flags.py'); "
        "m = u.module_from_spec(spec); sys.modules['f'] = m; spec.loader.exec_module(m); "
        "k = m.known_xla_flags(tuple(m.jaxlib_libraries())); "
        "f, miss = m.profile_flags('overlap', k); import json, jaxlib; "
        "print(json.dumps([jaxlib.__version__, f, miss, sorted(m.flag_names(' '.join(f)) - k)]))"
    )
    output = subprocess.run(
        [NEWER_JAXLIB_PYTHON, "-c", script, str(REPO)], capture_output=True, text=True, timeout=300
    )
    version, flags, missing, unknown = json.loads(output.stdout.strip().splitlines()[-1])
    assert flags and unknown == [], (version, flags, missing)
    assert "--xla_gpu_latency_hiding_scheduler=true" not in flags  # no invented spelling


def test_apply_before_the_backend_starts_sets_known_flags_only(tmp_path: Path) -> None:
    """A fresh interpreter (backend not started) pretending to be on a GPU."""
    script = (
        "import json, os; from msjax.parallel.xla_flags import apply_xla_profile; "
        "known = {'xla_gpu_enable_latency_hiding_scheduler', "
        "'xla_gpu_enable_pipelined_all_gather'}; "
        "r = apply_xla_profile('overlap', on_gpu=True, known=known); "
        "import jax; jax.numpy.ones(2).block_until_ready(); "  # XLA parses the flags: no abort
        "print(json.dumps(r.record()))"
    )
    env = job_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=false")
    output = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert output.returncode == 0, output.stderr[-2000:]
    record = json.loads(output.stdout.strip().splitlines()[-1])
    assert record["applied"]
    assert record["flags"] == ["--xla_gpu_enable_pipelined_all_gather=true"]
    assert record["overridden_by_user"] == ["--xla_gpu_enable_latency_hiding_scheduler=true"]
    assert record["xla_flags"] == (
        "--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_latency_hiding_scheduler=false"
    )
    assert "latency-hiding scheduler" not in record["unavailable"]
