"""Checkpoint fingerprints: a non-linear hash (a negation, two sign flips or another constant
change it), exact, independent of how arrays are sharded, changed by every single-bit flip, and
older formats still checked; the sealed JSON record likewise."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from msjax.checkpoint.fingerprint import _array_fingerprint, fingerprints
from msjax.checkpoint.record import record_problem, seal_record


def words_of(array: np.ndarray) -> np.ndarray:
    """The array's bits as uint64 words of 32 bits (narrower dtypes widened bit-exactly)."""
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[array.dtype.itemsize]
    return np.ascontiguousarray(array).reshape(-1).view(unsigned).astype(np.uint64)


def numpy_fingerprint_2(array: np.ndarray) -> int:
    """Format 2, written independently: sum of bits x (2 index 2654435761 + 1) mod 2**32."""
    bits = words_of(array)
    weights = (np.arange(bits.size, dtype=np.uint64) * 2654435761 % 2**32 * 2 + 1) % 2**32
    return int(np.sum(bits * weights % 2**32) % 2**32)


def numpy_fingerprint_3(array: np.ndarray) -> int:
    """Format 3, written independently: for each half, the sum mod 2**32 of
    mix((word + index x multiplier) xor seed) (arrays under 2**32 words)."""
    bits = words_of(array)
    index = np.arange(bits.size, dtype=np.uint64)
    mask = np.uint64(2**32 - 1)
    halves = []
    for multiplier, seed, (first, second, a, b, c) in [
        (0x9E3779B9, 0x243F6A88, (0x85EBCA6B, 0xC2B2AE35, 16, 13, 16)),
        (0x85EBCA77, 0x13198A2E, (0x7FEB352D, 0x846CA68B, 16, 15, 16)),
    ]:
        x = ((bits + index * np.uint64(multiplier)) & mask) ^ np.uint64(seed)
        x ^= x >> np.uint64(a)
        x = (x * np.uint64(first)) & mask
        x ^= x >> np.uint64(b)
        x = (x * np.uint64(second)) & mask
        x ^= x >> np.uint64(c)
        halves.append(int(np.sum(x) % 2**32))
    return (halves[0] << 32) | halves[1]


def test_fingerprints_equal_the_numpy_definition_for_every_dtype():
    rng = np.random.default_rng(0)
    tree = {
        "weights": rng.standard_normal((37, 129)).astype(np.float32),
        "step": np.int32(12),
        "half": rng.standard_normal(65).astype(jnp.bfloat16),
        "bytes": rng.integers(0, 256, 100).astype(np.uint8),
    }
    placed = jax.device_put(tree)
    assert fingerprints(placed) == {
        name: numpy_fingerprint_3(np.asarray(value)) for name, value in tree.items()
    }
    assert fingerprints(placed, 2) == {
        name: numpy_fingerprint_2(np.asarray(value)) for name, value in tree.items()
    }


def sign_flipped(values: np.ndarray, *positions: int) -> np.ndarray:
    flipped = values.copy()
    flipped[list(positions)] = -flipped[list(positions)]
    return flipped


def bit_flipped(values: np.ndarray, positions: tuple[int, ...], bit: int) -> np.ndarray:
    words = values.copy().view(np.uint32)
    words[list(positions)] ^= np.uint32(1 << bit)
    return words.view(np.float32)


def test_changes_a_linear_checksum_misses_change_the_fingerprint():
    values = np.random.default_rng(4).standard_normal(4096).astype(np.float32)
    changed = {
        "negated": -values,
        "two sign flips": sign_flipped(values, 10, 3000),
        "two sign flips side by side": sign_flipped(values, 7, 8),
        # bit 30, the exponent's highest, in two neighbours: 2**30 x (two odd weights) = 0
        "two adjacent exponent flips": bit_flipped(values, (100, 101), 30),
    }
    for what, array in changed.items():
        assert fingerprints({"x": array}, 2) == fingerprints({"x": values}, 2), what
        assert fingerprints({"x": array}) != fingerprints({"x": values}), what
    # an RMSNorm scale: every constant its own fingerprint (format 2 gave 0 for all four)
    scales = [np.full(256, value, np.float32) for value in (1.0, 2.0, 0.5, -1.0)]
    assert [fingerprints({"scale": scale}, 2)["scale"] for scale in scales] == [0, 0, 0, 0]
    assert len({fingerprints({"scale": scale})["scale"] for scale in scales}) == 4
    assert 0 not in {fingerprints({"scale": scale})["scale"] for scale in scales}


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


def params_state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": jnp.asarray(rng.standard_normal((8, 32)).astype(np.float32)),
            "scale": jnp.ones(32, jnp.float32),
        },
        "step": jnp.int32(seed),
    }


def saved_checkpoint(directory: Path, step: int, state: dict, fingerprint_format: int | None):
    """A real checkpoint of state; with a format, its record rewritten as that msjax wrote it
    (format 1: unsealed, no fingerprint_format; 2: sealed), fingerprints by that function."""
    from msjax.checkpoint.manager import META_FILE, Checkpointer
    from msjax.config import CheckpointConfig

    checkpointer = Checkpointer(directory, CheckpointConfig())
    checkpointer.save(step, state, {"data": {"samples_seen": 8 * step}})
    checkpointer.wait()
    checkpointer.close()
    record_file = directory / str(step) / "meta" / META_FILE
    if fingerprint_format is not None:
        record = json.loads(record_file.read_bytes())
        del record["record_crc32"]
        record["fingerprints"] = fingerprints(state, fingerprint_format)
        if fingerprint_format == 1:
            del record["fingerprint_format"]
            record["format_version"] = 1
            record_file.write_text(json.dumps(record))
        else:
            record["fingerprint_format"] = fingerprint_format
            record_file.write_bytes(seal_record(record))
    return record_file


def abstract_on_one_device(tree: dict) -> dict:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)


def test_new_saves_write_format_3_fingerprints(tmp_path):
    state = params_state(3)
    record = json.loads(saved_checkpoint(tmp_path, 3, state, None).read_bytes())
    assert record["fingerprint_format"] == 3
    assert record["fingerprints"] == fingerprints(state, 3) != fingerprints(state, 2)
    assert record["fingerprints"]["params/w"] == numpy_fingerprint_3(
        np.asarray(state["params"]["w"])
    )


@pytest.mark.parametrize("fingerprint_format", [1, 2])
def test_a_checkpoint_of_an_older_fingerprint_format_still_restores_in_full_and_params_only(
    tmp_path, fingerprint_format
):
    from msjax.checkpoint.manager import Checkpointer
    from msjax.config import CheckpointConfig

    state = params_state(5)
    saved_checkpoint(tmp_path, 5, state, fingerprint_format)
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(), read_only=True)
    restored = checkpointer.restore(5, abstract_on_one_device(state))
    params = checkpointer.restore_params(5, abstract_on_one_device(state["params"]))
    checkpointer.close()
    for tree in (restored.state["params"], params):
        np.testing.assert_array_equal(np.asarray(tree["w"]), np.asarray(state["params"]["w"]))
        np.testing.assert_array_equal(np.asarray(tree["scale"]), np.ones(32, np.float32))
    assert restored.meta["data"] == {"samples_seen": 40}


def test_restore_params_checks_the_records_seal_and_its_own_formats_fingerprints(tmp_path):
    from msjax.checkpoint.manager import Checkpointer
    from msjax.config import CheckpointConfig
    from msjax.errors import MsjaxError

    state = params_state(6)
    garbled_record = saved_checkpoint(tmp_path / "garbled", 6, state, None)
    text = garbled_record.read_bytes()
    assert b'"samples_seen": 48' in text
    garbled_record.write_bytes(text.replace(b'"samples_seen": 48', b'"samples_seen": 40'))
    # an RMSNorm scale saved as 1.0 and read back as 2.0: format 2's sum was 0 for both
    scaled = saved_checkpoint(tmp_path / "scaled", 6, state, 2)
    scaled_state = {**state, "params": {**state["params"], "scale": 2 * state["params"]["scale"]}}
    record = json.loads(scaled.read_bytes())
    assert record["fingerprints"] == fingerprints(scaled_state, 2)  # the linear sum cannot tell
    abstract = abstract_on_one_device(state["params"])
    checkpointer = Checkpointer(tmp_path / "garbled", CheckpointConfig(), read_only=True)
    with pytest.raises(MsjaxError, match="does not match its CRC-32"):
        checkpointer.restore_params(6, abstract)
    checkpointer.close()
    # a format 3 record of the doubled scale: the step's own arrays no longer match it
    record["fingerprints"] = fingerprints(scaled_state, 3)
    record["fingerprint_format"] = 3
    del record["record_crc32"]
    scaled.write_bytes(seal_record(record))
    checkpointer = Checkpointer(tmp_path / "scaled", CheckpointConfig(), read_only=True)
    with pytest.raises(MsjaxError, match=r"1 arrays do not match .*first: params/scale"):
        checkpointer.restore_params(6, abstract)
    checkpointer.close()
