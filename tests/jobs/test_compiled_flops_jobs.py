"""The compiled step's dot FLOPs (msjax.observe.compiled_flops) against the planner's compute model
(msjax.planner.compute): compiled FLOPs / model FLOPs per mesh, schedule and remat policy.

Programs compile on the eight simulated devices, cached per process with the other planner tests.
"""

from __future__ import annotations

import re
import sys

from harness import REPO, run_to_end


def test_the_plans_xla_check_counts_a_step_that_jaxs_persistent_cache_already_holds(tmp_path):
    """A second `msjax.plan --xla` sharing a JAX compilation cache with the first still counts
    the program (a cache hit dumps no HLO), and counts the same FLOPs."""
    env = {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    argv = ["--config", "configs/tiny.yaml", "--devices", "1", "--xla", "train.global_batch=8"]
    rows = []
    for _ in range(2):
        result = run_to_end([sys.executable, "-m", "msjax.plan", *argv], 300, REPO, **env)
        assert result.returncode == 0, result.stderr[-2000:]
        rows.append(re.findall(r"compiled/model FLOPs [\d.]+", result.stdout))
    assert rows[0] and rows[0] == rows[1]
