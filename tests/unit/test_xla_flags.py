"""train.xla_profile: only flags the installed jaxlib knows reach XLA_FLAGS, the user's win, and
what was decided lands in the run directory."""

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


def test_apply_leaves_cpu_runs_and_none_alone_and_lets_the_user_win() -> None:
    environ = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    assert not apply_xla_profile("overlap", environ, on_gpu=False).applied
    assert not apply_xla_profile("none", environ, on_gpu=True).applied
    assert environ["XLA_FLAGS"] == "--xla_gpu_enable_latency_hiding_scheduler=false"
    known = {"xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_enable_pipelined_all_gather"}
    jax.devices()  # this process's backend has started: XLA would never read a change
    late = apply_xla_profile("overlap", dict(environ), on_gpu=True, known=known)
    assert not late.applied and "already started" in late.reason


def test_libraries_scanned_are_jaxlibs_own() -> None:
    libraries = jaxlib_libraries()
    assert libraries and all(path.suffix == ".so" for path in libraries)
