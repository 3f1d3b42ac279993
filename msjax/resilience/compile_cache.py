"""Compilation caches, so a restarted worker loads its programs instead of compiling them again:
JAX's persistent cache (set up before a process's first compilation) and, for the train step,
one serialized executable per process."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from msjax.config import ResilienceConfig
from msjax.run_dir import RunDir


def compile_cache_dir(resilience: ResilienceConfig, run_dir: Path, launched: bool) -> Path | None:
    """The cache directory: compile_cache_dir if set, else RUN_DIR/compile_cache for a worker
    started by msjax.launch (launched); None when off (a plain one-process run by default)."""
    if not resilience.compile_cache:
        return None
    if resilience.compile_cache_dir:
        return Path(resilience.compile_cache_dir)
    return RunDir(run_dir).compile_cache if launched else None


def enable_compile_cache(
    resilience: ResilienceConfig, run_dir: Path, launched: bool
) -> Path | None:
    """Point JAX at the cache directory, caching every program however fast it compiled."""
    import jax

    directory = compile_cache_dir(resilience, run_dir, launched)
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory.absolute()))
    # defaults skip programs compiled in under 1 s: a restart wants every one of them
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return directory


def compile_cached(lowered: Any, directory: Path | None, name: str) -> Any:
    """lowered.compile(), or the executable this process saved for the same program before.

    JAX's persistent cache only ever writes from process 0, and other processes' keys differ
    (jax 0.10), so without this every restart recompiles on ranks > 0 and the job waits for
    them. Each process keeps its own serialized executable here, keyed by program, versions,
    process and devices.
    """
    if directory is None:
        return lowered.compile()
    import jax
    from jax.experimental import serialize_executable

    path = directory / f"{name}-process{jax.process_index()}-{_program_key(lowered)}.xla"
    if path.exists():
        try:
            return serialize_executable.deserialize_and_load(
                path.read_bytes(), lowered.in_tree, lowered.out_tree
            )
        except Exception as error:  # a stale or damaged entry: compile afresh and replace it
            print(f"msjax: compile cache entry {path} not usable ({error}); compiling")
    compiled = lowered.compile()
    payload, _, _ = serialize_executable.serialize(compiled)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_bytes(payload)
    os.replace(partial, path)
    return compiled


def _program_key(lowered: Any) -> str:
    import jax
    import jaxlib

    backend = jax.devices()[0].client
    parts = [
        lowered.as_text(),
        jax.__version__,
        jaxlib.__version__,
        backend.platform,
        backend.platform_version,
        f"{jax.process_index()}/{jax.process_count()}",
        " ".join(f"{d.id}:{d.device_kind}:{d.process_index}" for d in jax.devices()),
        os.environ.get("XLA_FLAGS", ""),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
