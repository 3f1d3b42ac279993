"""Shared pytest setup, applied before anything imports jax.

- 8 simulated CPU devices, so every mesh of the test suite fits.
- A fresh token cache directory, so tests never write into ~/.cache/msjax.
- XLA's CPU backend at optimisation level 0: tests run few steps, and this cuts compile time
  about threefold without changing what is computed beyond float rounding (each test compares
  programs compiled the same way). Only where the tests run on CPU: `JAX_PLATFORMS` names cpu
  alone, or no CUDA plugin is installed (read from package metadata, so no backend starts here).
- One JAX persistent compilation cache for every process the tests start, in that token cache
  directory (where msjax.launch's workers keep theirs): the same small program compiled by
  dozens of `python -m msjax.train` runs is compiled once. A cached program is the one XLA
  compiled, so nothing a test computes changes. This pytest process itself keeps it off: a
  pipeline program loaded from the cache and run on 8 simulated devices aborted in XLA:CPU's
  collectives on a loaded 2-core machine (tests/unit/test_pipeline.py's resume). XLA dumps no
  HLO for a program it loads from the cache (msjax.planner.aot reads that dump): start a child
  that must compile without these variables, as test_benchmarks.py does.
"""

import importlib.metadata
import os
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("MSJAX_CACHE_DIR", tempfile.mkdtemp(prefix="msjax-test-cache-"))
CUDA_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")


def runs_on_cpu() -> bool:
    """Whether jax will pick the CPU backend, decided without importing jax."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    for plugin in CUDA_PLUGINS:
        try:
            importlib.metadata.distribution(plugin)
        except importlib.metadata.PackageNotFoundError:
            continue
        return False
    return True


if runs_on_cpu() and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

# msjax.resilience.compile_cache.JAX_CACHE_FOLDER, made private as msjax makes it
SHARED_JAX_CACHE = Path(os.environ["MSJAX_CACHE_DIR"]) / "jax_compile_cache"
SHARED_JAX_CACHE.mkdir(mode=0o700, parents=True, exist_ok=True)
CHILD_JAX_CACHE = {
    "JAX_COMPILATION_CACHE_DIR": str(SHARED_JAX_CACHE),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # these programs compile in seconds
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
}
for name, value in CHILD_JAX_CACHE.items():
    os.environ.setdefault(name, value)

import jax  # noqa: E402  (after the environment above, which it reads once)

jax.config.update("jax_compilation_cache_dir", None)  # this process: its in-memory cache is enough

# The files that take longest start first, longest first (each file's wall time in one tier,
# summed over the tiers it has tests in, measured on 2 cores on 2026-12-05): pytest-xdist hands
# out whole files in collection order (--dist loadfile, and --no-loadscope-reorder in
# pyproject.toml, so it keeps this order rather than its own by test count), and a long file
# started last would leave the other worker idle while it runs.
LONGEST_FILES_FIRST = (
    "test_benchmarks.py",  # about 590 s
    "test_pipeline.py",
    "test_doctor.py",
    "test_shrink.py",
    "test_slurm.py",
    "test_grad_accum.py",
    "test_communication_model.py",
    "test_expert_parallel.py",
    "test_plan.py",
    "test_memory_snapshots_jobs.py",
    "test_resilience.py",
    "test_stragglers.py",
    "test_moe.py",
    "test_save_hardening.py",
    "test_agreement.py",
    "test_deadlines.py",
    "test_restore_hardening.py",
    "test_bad_slots.py",
    "test_bad_inputs.py",
    "test_launch_hardening.py",
    "test_gpu_suite.py",
    "test_compiled_flops.py",
    "test_checkpoint_sigterm.py",
    "test_run_dir_trust.py",
    "test_corruption_guard.py",
    "test_checkpoint.py",
    "test_hf_qwen.py",
)
JOBS = Path(__file__).parent / "jobs"


def pytest_collection_modifyitems(items: list) -> None:
    """Collected tests in file order, except that LONGEST_FILES_FIRST's files come first; every
    test under tests/jobs/ carries the `job` marker (so `-m "slow or job"` selects all that bare
    `pytest` leaves out)."""
    rank = {name: position for position, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    for item in items:
        if JOBS in item.path.parents:
            item.add_marker("job")
