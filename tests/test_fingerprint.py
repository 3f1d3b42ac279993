"""Checkpoint fingerprints: exact, position-sensitive, and independent of how arrays are sharded."""

from __future__ import annotations

import threading

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


def test_a_prepared_checkpointer_compiles_nothing_in_its_first_save(tmp_path):
    from msjax.checkpoint.manager import Checkpointer
    from msjax.config import CheckpointConfig

    compiles: list[str] = []

    def on_event(event: str, duration_s: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    def first_save_compiles(prepare: bool, shape: tuple[int, int]) -> int:
        # a fresh shape for each run: nothing compiled by an earlier test or run is reused
        state = {"w": jnp.ones(shape, jnp.float32), "step": jnp.zeros((), jnp.int32)}
        checkpointer = Checkpointer(tmp_path / f"{prepare}", CheckpointConfig())
        if prepare:
            checkpointer.prepare(jax.eval_shape(lambda: state))
            for thread in threading.enumerate():  # let the background compile finish first
                if thread.name == "msjax-fingerprint-compile":
                    thread.join()
        compiles.clear()
        checkpointer.save(1, state, {})
        during_save = len(compiles)
        checkpointer.wait()
        checkpointer.close()
        return during_save

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        assert first_save_compiles(prepare=False, shape=(3, 37)) >= 1  # the check can see one
        assert first_save_compiles(prepare=True, shape=(3, 41)) == 0
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
