"""JAX's persistent compilation cache, so a restarted worker loads its programs instead of
compiling them again. Set up before the first compilation of a process."""

from __future__ import annotations

from pathlib import Path

from msjax.config import ResilienceConfig


def compile_cache_dir(resilience: ResilienceConfig, run_dir: Path, launched: bool) -> Path | None:
    """The cache directory: compile_cache_dir if set, else RUN_DIR/compile_cache for a worker
    started by msjax.launch (launched); None when off (a plain one-process run by default)."""
    if not resilience.compile_cache:
        return None
    if resilience.compile_cache_dir:
        return Path(resilience.compile_cache_dir)
    return run_dir / "compile_cache" if launched else None


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
