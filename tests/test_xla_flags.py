"""train.xla_profile: only flags the installed jaxlib knows reach XLA_FLAGS, the user's win, and
what was decided lands in the run directory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from msjax.parallel.xla_flags import (
    OVERLAP,
    apply_xla_profile,
    flag_names,
    jaxlib_libraries,
    known_xla_flags,
    profile_flags,
)

REPO = Path(__file__).resolve().parents[1]
# a newer jax installed beside the tests' own, to check its spellings (skipped when absent)
NEWER_JAXLIB_PYTHON = os.environ.get("MSJAX_NEWER_JAXLIB_PYTHON", "")


def test_the_installed_jaxlib_knows_every_overlap_flag_chosen() -> None:
    known = known_xla_flags()
    assert "xla_gpu_enable_latency_hiding_scheduler" in known  # the scan reads the real library
    assert "xla_gpu_no_such_flag" not in known
    flags, missing = profile_flags("overlap", known)
    assert flags and not missing
    assert flag_names(" ".join(flags)) <= known
    if jax.__version_info__[:2] == (0, 10):  # this release spells the pipelined ones the old way
        assert "--xla_gpu_enable_pipelined_all_gather=true" in flags
        assert not any(flag.startswith("--xla_gpu_pipeline_") for flag in flags)


def test_a_newer_spelling_is_chosen_when_known_and_unknown_flags_never_pass() -> None:
    newer = {name for spellings in OVERLAP.values() for name, _ in spellings[:1]}
    flags, missing = profile_flags("overlap", newer)
    assert "--xla_gpu_pipeline_all_gather=on" in flags and not missing
    flags, missing = profile_flags("overlap", {"xla_gpu_enable_latency_hiding_scheduler"})
    assert flags == ["--xla_gpu_enable_latency_hiding_scheduler=true"]
    assert "pipelined all-gather" in missing
    assert profile_flags("none", newer) == ([], [])
    with pytest.raises(ValueError, match="accepted: none, overlap"):
        profile_flags("fast", newer)


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


def test_apply_leaves_cpu_runs_and_none_alone_and_lets_the_user_win() -> None:
    environ = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    assert not apply_xla_profile("overlap", environ, on_gpu=False).applied
    assert not apply_xla_profile("none", environ, on_gpu=True).applied
    assert environ["XLA_FLAGS"] == "--xla_gpu_enable_latency_hiding_scheduler=false"
    known = {"xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_enable_pipelined_all_gather"}
    jax.devices()  # this process's backend has started: XLA would never read a change
    late = apply_xla_profile("overlap", dict(environ), on_gpu=True, known=known)
    assert not late.applied and "already started" in late.reason


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
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false",
    }
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


def test_libraries_scanned_are_jaxlibs_own() -> None:
    libraries = jaxlib_libraries()
    assert libraries and all(path.suffix == ".so" for path in libraries)
