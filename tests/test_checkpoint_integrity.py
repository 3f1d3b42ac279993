"""Damaged checkpoints never cost a good one: read errors are retried, damaged steps are moved
aside and not counted as kept, a garbled record is caught, format 1 still restores, and a run
whose checkpoints all fail stops (exit 2) instead of starting again from step 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
from msjax.observe.metrics import read_metrics
from tests.small_runs import QUICK_RUN

REPO = Path(__file__).resolve().parents[1]


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


def train_command(run_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "msjax.train", *QUICK_RUN, "mesh.data=2", "mesh.fsdp=1",
        "mesh.tensor=1", "train.eval_every=0", "checkpoint.every_steps=2",
        "checkpoint.max_to_keep=1", f"run.dir={run_dir}", *overrides,
    ]  # fmt: skip


def run_train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_NUM_CPU_DEVICES": "2"}
    return subprocess.run(
        train_command(run_dir, *overrides), capture_output=True, text=True, env=env, timeout=300
    )


def test_when_no_checkpoint_restores_the_run_stops_instead_of_starting_from_step_0(tmp_path):
    run_dir = tmp_path / "run"
    first = run_train(run_dir, "train.steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    assert committed_steps(checkpoints) == [4]
    garble(largest_array_file(checkpoints / "4"))
    records_before = len(read_metrics(run_dir / "metrics.jsonl"))

    refused = run_train(run_dir, "train.steps=6")
    assert refused.returncode == 2
    output = refused.stdout + refused.stderr
    skipped = [line for line in output.splitlines() if line.startswith("skipped checkpoint")]
    assert len(skipped) == 1 and f"{checkpoints}/4 is corrupted" in skipped[0]
    assert f"moved to {checkpoints}/damaged/4" in skipped[0]
    errors = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "checkpoint.if_none_valid=restart" in errors[0]
    assert "Traceback" not in refused.stderr
    assert committed_steps(checkpoints) == []  # nothing saved, nothing trained
    assert (checkpoints / "damaged" / "4" / "state").is_dir()
    assert len(read_metrics(run_dir / "metrics.jsonl")) == records_before

    again = run_train(run_dir, "train.steps=6")  # the damaged one, moved aside, still counts
    assert again.returncode == 2 and "found damaged earlier" in again.stderr

    restarted = run_train(run_dir, "train.steps=6", "checkpoint.if_none_valid=restart")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "starting from step 0 (checkpoint.if_none_valid=restart)" in restarted.stdout
    assert committed_steps(checkpoints) == [6]


def launch_job(run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "msjax.launch", "--nprocs=2", "--devices-per-proc=2", "--",
        *QUICK_RUN, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=1", f"train.steps={steps}",
        "train.eval_every=0", "checkpoint.every_steps=2", "resilience.max_restarts=0",
        f"run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.slow
def test_a_checkpoint_damaged_in_rank_1s_shards_makes_both_ranks_fall_back_to_the_same_step(
    tmp_path,
):
    run_dir = tmp_path / "run"
    first = launch_job(run_dir, 4)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    assert committed_steps(checkpoints) == [2, 4]
    rank_1_files = sorted((checkpoints / "4" / "state" / "ocdbt.process_1").rglob("*"))
    largest = max((path for path in rank_1_files if path.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])  # rank 1's shards

    second = launch_job(run_dir, 6)
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-5000:]
    assert f"skipped checkpoint {checkpoints}/4" in output
    assert f"resumed from {checkpoints}/2 (step 2)" in output
    resumes = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("event") == "resume"]
    assert [r["step"] for r in resumes] == [2]
    assert committed_steps(checkpoints) == [2, 4, 6]  # 4 saved again, from the restored 2
    assert (checkpoints / "damaged" / "4").is_dir()
