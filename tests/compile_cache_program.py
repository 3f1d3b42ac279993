"""One process's use of msjax's compile cache, for tests/jobs/test_compile_cache.py: a program of
fusions (enough for XLA:CPU to split its code), compiled with JAX's persistent cache and msjax's
signed executables in one folder, then run once.

    python compile_cache_program.py FOLDER compile        # compile_cached, then run it
    python compile_cache_program.py FOLDER as_jax_served  # write an entry from what JAX's cache
                                                          # served, unchecked (what msjax did)

Prints one JSON line: the result's sum, how the step was loaded, and whether the entry is there.
"""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import serialize_executable

from msjax.config import ResilienceConfig
from msjax.resilience.compile_cache import (
    CheckedOnFirstCall,
    StaleCompileCache,
    cache_entry,
    compile_cached,
    enable_compile_cache,
    signing_key,
    write_signed,
)


def layers(x: jax.Array, w: jax.Array) -> jax.Array:
    for i in range(40):  # [64, 64] throughout
        x = jnp.tanh(x @ w) ** (i % 3 + 2) * (1.0 + i) + jnp.sum(x**2, axis=0) * 1e-3
        x = x / (jnp.max(jnp.abs(x)) + 1e-6)
    return jnp.sum(x)


def main() -> None:
    folder, mode = Path(sys.argv[1]), sys.argv[2]
    cache = enable_compile_cache(ResilienceConfig(compile_cache_dir=str(folder)), folder, True)
    assert cache == folder
    x = jnp.linspace(0.1, 1.0, 64 * 64).reshape(64, 64)  # [64, 64]
    w = jnp.eye(64) * 0.5 + 0.01
    lowered = jax.jit(layers).lower(x, w)
    entry = cache_entry(lowered, folder, "layers")
    if mode == "as_jax_served":
        compiled = lowered.compile()
        write_signed(entry, signing_key(), serialize_executable.serialize(compiled)[0])
        print(json.dumps({"entry": entry.exists()}))
        return
    step = compile_cached(lowered, folder, "layers")
    try:
        total = float(step(x, w))
    except StaleCompileCache as error:
        print(json.dumps({"stale": str(error), "entry": entry.exists()}))
        return
    loaded = isinstance(step, CheckedOnFirstCall)
    print(json.dumps({"sum": total, "loaded": loaded, "entry": entry.exists()}))


if __name__ == "__main__":
    main()
