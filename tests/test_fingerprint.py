"""Checkpoint fingerprints: exact, position-sensitive, independent of how arrays are sharded, and
changed by every single-bit flip; the sealed JSON record likewise."""

from __future__ import annotations

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from msjax.checkpoint.fingerprint import _array_fingerprint, fingerprints
from msjax.checkpoint.record import record_problem, seal_record


def numpy_fingerprint(array: np.ndarray) -> int:
    """The definition, written independently: sum of bits x (2 index 2654435761 + 1) mod 2**32."""
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[array.dtype.itemsize]
    bits = np.ascontiguousarray(array).reshape(-1).view(unsigned).astype(np.uint64)
    weights = (np.arange(bits.size, dtype=np.uint64) * 2654435761 % 2**32 * 2 + 1) % 2**32
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


def every_single_bit_flip(array: np.ndarray) -> np.ndarray:
    """[bits, *shape]: the array once for each of its bits, with that one bit flipped."""
    raw = np.frombuffer(np.ascontiguousarray(array).tobytes(), np.uint8)
    flips = np.repeat(raw[None], raw.size * 8, axis=0)  # [bits, bytes]
    bit = np.arange(raw.size * 8)
    flips[bit, bit // 8] ^= (1 << (bit % 8)).astype(np.uint8)
    return flips.view(array.dtype).reshape(raw.size * 8, *array.shape)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32", "uint8", "float64"])
def test_every_single_bit_flip_of_an_array_changes_its_fingerprint(dtype):
    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    try:
        rng = np.random.default_rng(3)
        array = (rng.standard_normal(37) * 100).astype(jnp.dtype(dtype))  # sign bits both ways
        flipped = every_single_bit_flip(array)
        original = fingerprints({"x": array})["x"]
        changed = jax.jit(jax.vmap(_array_fingerprint))(flipped)
        assert flipped.shape[0] == array.nbytes * 8
        unchanged = np.flatnonzero(np.asarray(changed) == original)
        assert unchanged.size == 0, f"flips of bits {unchanged} leave the fingerprint as it was"
    finally:
        jax.config.update("jax_enable_x64", False)


def test_format_1_missed_a_sign_flip_at_every_odd_position():
    """Why the format changed: bit 31 times an even weight vanishes mod 2**32."""
    values = np.arange(1, 9, dtype=np.float32)
    flipped = values.copy()
    flipped[3] = -flipped[3]
    assert fingerprints({"x": flipped}, 1) == fingerprints({"x": values}, 1)
    assert fingerprints({"x": flipped}) != fingerprints({"x": values})


def test_every_single_bit_flip_of_a_sealed_record_is_detected():
    record = {
        "config": {"model": {"embed_dim": 64}, "run": {"seed": 0}},
        "data": {"next_step": 12, "samples_seen": 96},
        "fingerprints": {"params/w": 4062, "step": 12},
        "format_version": 2,
    }
    sealed = seal_record(record)
    assert record_problem(sealed) is None
    for position in range(len(sealed)):
        for bit in range(8):
            garbled = bytearray(sealed)
            garbled[position] ^= 1 << bit
            assert record_problem(bytes(garbled)) is not None, (position, bit)


def test_an_unsealed_record_is_accepted_only_as_format_1():
    old = json.dumps({"format_version": 1, "fingerprints": {}}).encode()
    assert record_problem(old) is None
    assert record_problem(old.replace(b"1", b"2")) is not None
