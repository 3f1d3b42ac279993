"""Checkpoint fingerprints: a non-linear hash (a negation, two sign flips or another constant
change it), exact, independent of how arrays are sharded, changed by every single-bit flip, and
older formats still checked; the sealed JSON record likewise."""

from __future__ import annotations

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
from harness import job_env
from test_fingerprint import numpy_fingerprint_3

# Fingerprints of one array, laid out on several meshes of this many simulated devices.
FINGERPRINTS_ON_MESHES = """
import json, sys
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from msjax.checkpoint.fingerprint import fingerprints
values = np.random.default_rng(1).standard_normal((16, 24, 3)).astype(np.float32)
count = jax.device_count()
shapes = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 8: [(2, 4), (4, 2), (8, 1), (1, 8)]}[count]
specs = [(None, None), ("a", None), (None, "b"), ("a", "b"), ("b", "a"), (("a", "b"), None)]
seen = {"float32": [], "bfloat16": []}
for shape in shapes:
    mesh = jax.make_mesh(shape, ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    for spec in specs:
        for dtype in seen:
            array = values.astype(jax.numpy.dtype(dtype))
            placed = jax.device_put(array, NamedSharding(mesh, PartitionSpec(*spec)))
            seen[dtype].append(fingerprints({"x": placed})["x"])
print(json.dumps(seen))
"""


def test_fingerprints_do_not_depend_on_the_sharding_on_1_2_or_8_devices():
    seen: dict[str, list[int]] = {"float32": [], "bfloat16": []}
    for devices in (1, 2, 8):
        env = job_env(JAX_NUM_CPU_DEVICES=str(devices))
        result = subprocess.run(
            [sys.executable, "-c", FINGERPRINTS_ON_MESHES],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        for dtype, values in json.loads(result.stdout.splitlines()[-1]).items():
            seen[dtype] += values
    values = np.random.default_rng(1).standard_normal((16, 24, 3)).astype(np.float32)
    for dtype, fingerprints_seen in seen.items():
        assert len(fingerprints_seen) == 6 * (1 + 2 + 4)  # specs x meshes
        assert set(fingerprints_seen) == {numpy_fingerprint_3(values.astype(jnp.dtype(dtype)))}
