"""Checkpoint fingerprints: exact, position-sensitive, and independent of how arrays are sharded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from msjax.checkpoint.fingerprint import fingerprints


def numpy_fingerprint(array: np.ndarray) -> int:
    """The definition, written independently: sum of bits x (index * 2654435761 + 1) mod 2**32."""
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[array.dtype.itemsize]
    bits = np.ascontiguousarray(array).reshape(-1).view(unsigned).astype(np.uint64)
    weights = (np.arange(bits.size, dtype=np.uint64) * 2654435761 + 1) % 2**32
    return int(np.sum(bits * weights % 2**32) % 2**32)


def test_fingerprints_equal_the_numpy_definition_for_every_dtype():
    rng = np.random.default_rng(0)
    tree = {
        "weights": rng.standard_normal((37, 129)).astype(np.float32),
        "step": np.int32(12),
        "half": rng.standard_normal(65).astype(jnp.bfloat16),
    }
    assert fingerprints(jax.device_put(tree)) == {
        name: numpy_fingerprint(np.asarray(value)) for name, value in tree.items()
    }


def test_one_changed_or_swapped_element_changes_the_fingerprint():
    values = np.arange(1, 4097, dtype=np.float32)
    original = fingerprints({"x": values})["x"]
    changed = values.copy()
    changed[1000] += 1
    swapped = values.copy()
    swapped[[10, 11]] = swapped[[11, 10]]
    assert fingerprints({"x": changed})["x"] != original
    assert fingerprints({"x": swapped})["x"] != original


def test_fingerprints_do_not_depend_on_the_sharding():
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    values = np.random.default_rng(1).standard_normal((16, 24)).astype(np.float32)
    placed = [
        jax.device_put(values, NamedSharding(mesh, PartitionSpec(*spec)))
        for spec in [(None, None), ("a", "b"), ("b", None), (None, ("a", "b"))]
    ]
    assert len({fingerprints({"x": array})["x"] for array in placed}) == 1
