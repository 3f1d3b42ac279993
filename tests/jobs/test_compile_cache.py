"""The per-process executable cache loads only what this user's msjax signed: a foreign or
tampered entry (here a pickle that would run code) is never unpickled, and is replaced."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import REPO, job_env

from msjax.resilience.compile_cache import (
    ENTRY_MAGIC,
    KEY_FILE,
    cache_entry,
    compile_cached,
    signing_key,
)


class RunsCode:
    """Unpickling this runs os.system: what a crafted cache file could do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def own_key_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own msjax cache folder, where the signing key is made."""
    folder = tmp_path / "user_cache"
    monkeypatch.setenv("MSJAX_CACHE_DIR", str(folder))
    return folder


def sharding() -> jax.sharding.NamedSharding:
    """Over every device, as the train step is (a loaded executable runs on all of them)."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))


def lowered_program():
    shape = jax.ShapeDtypeStruct((2 * jax.device_count(),), jnp.float32, sharding=sharding())
    return jax.jit(lambda x: jnp.sin(x) * 2.0 + 1.0).lower(shape)


def run(compiled) -> np.ndarray:
    inputs = np.arange(2 * jax.device_count(), dtype=np.float32)
    return np.asarray(compiled(jax.device_put(inputs, sharding())))


def expected() -> np.ndarray:
    return np.sin(np.arange(2 * jax.device_count(), dtype=np.float32)) * 2.0 + 1.0


def test_own_entry_is_signed_and_loaded_again(tmp_path: Path, own_key_folder: Path) -> None:
    cache = tmp_path / "compile_cache"
    cache.mkdir()
    lowered = lowered_program()
    np.testing.assert_allclose(
        run(compile_cached(lowered, cache, "f")), expected(), rtol=1e-5, atol=1e-6
    )
    entry = cache_entry(lowered, cache, "f")
    written = entry.read_bytes()
    assert written.startswith(ENTRY_MAGIC)
    stamp = entry.stat().st_mtime_ns
    np.testing.assert_allclose(
        run(compile_cached(lowered, cache, "f")), expected(), rtol=1e-5, atol=1e-6
    )
    assert entry.stat().st_mtime_ns == stamp, "a valid entry is loaded, not rewritten"
    key = own_key_folder / KEY_FILE
    assert key.stat().st_mode & 0o777 == 0o600
    assert signing_key() == key.read_bytes()


@pytest.mark.parametrize("signed_by", ["nobody", "another key"])
def test_foreign_or_tampered_entry_is_never_unpickled(
    tmp_path: Path, own_key_folder: Path, signed_by: str, capsys: pytest.CaptureFixture
) -> None:
    cache = tmp_path / "compile_cache"
    cache.mkdir()
    marker = tmp_path / "code-ran"
    lowered = lowered_program()
    entry = cache_entry(lowered, cache, "f")
    crafted = pickle.dumps(RunsCode(marker))
    if signed_by == "another key":  # a well-formed entry, signed with a key that is not ours
        import hashlib
        import hmac

        forged = hmac.new(b"x" * 32, entry.name.encode() + b"\0" + crafted, hashlib.sha256)
        crafted = ENTRY_MAGIC + forged.digest() + crafted
    entry.write_bytes(crafted)
    np.testing.assert_allclose(
        run(compile_cached(lowered, cache, "f")), expected(), rtol=1e-5, atol=1e-6
    )
    assert not marker.exists(), "the crafted entry was unpickled"
    assert "was not written by this user's msjax" in capsys.readouterr().out
    assert entry.read_bytes().startswith(ENTRY_MAGIC) and crafted not in entry.read_bytes()


def run_program(folder: Path, mode: str, key_folder: Path) -> dict:
    """One process's turn at tests/compile_cache_program.py: JAX's persistent cache and msjax's
    entries in `folder`, which outlives the process as a user's cache outlives a run."""
    # the program runs on one device
    env = job_env(MSJAX_CACHE_DIR=str(key_folder), JAX_NUM_CPU_DEVICES="1")
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "compile_cache_program.py"), str(folder), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_program_that_jax_loaded_from_its_cache_is_not_written_again(tmp_path: Path) -> None:
    """A second run on a warm JAX cache: JAX serves the program, so msjax writes no entry of its
    own (serialized again, it would lack code), and the next process gets it from JAX again."""
    folder, keys = tmp_path / "cache", tmp_path / "keys"
    cold = run_program(folder, "compile", keys)
    assert (cold["loaded"], cold["entry"]) == (False, True)
    for entry in folder.glob("layers-*.xla"):
        entry.unlink()  # a fresh run dir: JAX's cache is warm, msjax's own is empty
    warm = run_program(folder, "compile", keys)
    assert (warm["loaded"], warm["entry"]) == (False, False)
    again = run_program(folder, "compile", keys)
    assert (again["loaded"], again["entry"]) == (False, False)
    assert warm["sum"] == again["sum"] == cold["sum"] != 0.0


def test_an_entry_that_fails_at_its_first_call_is_dropped_and_never_fatal(tmp_path: Path) -> None:
    """An entry written from what JAX's cache served (as msjax did before) loads, then fails at
    its first result: it is dropped with a StaleCompileCache, and the next process compiles."""
    folder, keys = tmp_path / "cache", tmp_path / "keys"
    cold = run_program(folder, "compile", keys)
    assert run_program(folder, "as_jax_served", keys) == {"entry": True}
    stale = run_program(folder, "compile", keys)
    assert stale["entry"] is False
    assert "failed at its first step (NOT_FOUND: Function" in stale["stale"]
    recompiled = run_program(folder, "compile", keys)
    assert (recompiled["loaded"], recompiled["sum"]) == (False, cold["sum"])
