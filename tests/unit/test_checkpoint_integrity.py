"""Damaged checkpoints never cost a good one: read errors are retried, damaged steps are moved
aside and not counted as kept, a garbled record is caught, format 1 still restores, and a run
whose checkpoints all fail stops (exit 2) instead of starting again from step 0."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax.checkpoint.fingerprint import fingerprints
from msjax.checkpoint.manager import META_FILE, Checkpointer, committed_steps
from msjax.config import CheckpointConfig
from msjax.errors import MsjaxError


def small_state(seed: int) -> dict[str, jax.Array]:
    values = np.random.default_rng(seed).standard_normal((16, 64)).astype(np.float32)
    return {"weights": jnp.asarray(values), "step": jnp.int32(seed)}


def abstract_of(state: dict[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def largest_array_file(step_dir: Path) -> Path:
    files = [path for path in (step_dir / "state").rglob("*") if path.is_file()]
    return max(files, key=lambda path: path.stat().st_size)


def garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(byte ^ 0xFF for byte in data[middle : middle + 64])
    path.write_bytes(data)


def record_path(directory: Path, step: int) -> Path:
    return directory / str(step) / "meta" / META_FILE


def test_a_save_never_deletes_the_only_intact_checkpoint_for_a_damaged_newer_one(tmp_path):
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(max_to_keep=1))
    checkpointer.save(1, small_state(1), {"note": "first"})
    checkpointer.save(2, small_state(2), {"note": "second"})
    checkpointer.wait()
    assert committed_steps(tmp_path) == [2]  # 2 is intact: 1 goes
    record = record_path(tmp_path, 2)
    record.write_bytes(record.read_bytes().replace(b"second", b"secoNd"))
    checkpointer.save(3, small_state(3), {"note": "third"})  # retention runs before each save
    assert 2 in committed_steps(tmp_path)
    checkpointer.wait()
    assert committed_steps(tmp_path) == [2, 3]  # the damaged 2 is not counted as the one kept
    garble(record_path(tmp_path, 3))
    checkpointer.save(4, small_state(4), {"note": "fourth"})
    checkpointer.wait()
    # 3 was never counted as kept while damaged; once 4 is intact, only 4 counts
    assert committed_steps(tmp_path) == [2, 3, 4]
    checkpointer.close()


def test_a_garbled_record_is_caught_on_restore(tmp_path):
    state = small_state(5)
    checkpointer = Checkpointer(tmp_path, CheckpointConfig())
    checkpointer.save(5, state, {"data": {"samples_seen": 40}})
    checkpointer.wait()
    record = record_path(tmp_path, 5)
    text = record.read_bytes()
    record.write_bytes(text.replace(b'"samples_seen": 40', b'"samples_seen": 48'))  # still JSON
    with pytest.raises(MsjaxError, match="does not match its CRC-32"):
        checkpointer.restore(5, abstract_of(state))
    checkpointer.close()


def test_a_checkpoint_of_format_1_still_restores(tmp_path):
    state = small_state(7)
    checkpointer = Checkpointer(tmp_path, CheckpointConfig())
    checkpointer.save(7, state, {"data": {"samples_seen": 56}})
    checkpointer.wait()
    # rewrite the record as format 1 wrote it: plain JSON, no seal, format-1 fingerprints
    record = json.loads(record_path(tmp_path, 7).read_bytes())
    for key in ("record_crc32", "fingerprint_format"):
        del record[key]
    record["format_version"] = 1
    record["fingerprints"] = fingerprints(state, 1)
    assert record["fingerprints"] != fingerprints(state)
    record_path(tmp_path, 7).write_text(json.dumps(record))
    restored = checkpointer.restore(7, abstract_of(state))
    np.testing.assert_array_equal(
        np.asarray(restored.state["weights"]), np.asarray(state["weights"])
    )
    assert restored.meta["data"] == {"samples_seen": 56}
    checkpointer.close()


def test_a_read_error_that_passes_is_retried_not_taken_for_damage(tmp_path):
    state = small_state(9)
    checkpointer = Checkpointer(tmp_path, CheckpointConfig())
    checkpointer.save(9, state, {})
    checkpointer.wait()
    array_file = largest_array_file(tmp_path / "9")
    away = array_file.with_name(array_file.name + ".away")
    array_file.rename(away)  # gone for a moment, as on a file system that hiccups
    back = threading.Timer(0.2, away.rename, args=(array_file,))
    back.start()
    restored = checkpointer.restore(9, abstract_of(state))
    back.join()
    np.testing.assert_array_equal(
        np.asarray(restored.state["weights"]), np.asarray(state["weights"])
    )
    checkpointer.close()
