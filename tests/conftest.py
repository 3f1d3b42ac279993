"""Shared pytest setup, applied before anything imports jax.

- 8 simulated CPU devices, so every mesh of the test suite fits.
- A fresh token cache directory, so tests never write into ~/.cache/msjax.
- XLA's CPU backend at optimisation level 0: tests run few steps, and this cuts compile time
  about threefold without changing what is computed beyond float rounding (each test compares
  programs compiled the same way).
"""

import os
import tempfile

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("MSJAX_CACHE_DIR", tempfile.mkdtemp(prefix="msjax-test-cache-"))
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()
