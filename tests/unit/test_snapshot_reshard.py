"""In-memory snapshots restored onto another layout, in-process: the snapshots a 4-process job
wrote on a data 2 x fsdp 2 x tensor 2 mesh (as each of its processes would, in its own
directory) put together bitwise into a shrunk or regrouped mesh's shards; a flipped byte passed
over for another replica of its slice, else refused; a missing piece makes the step not
coverable; snapshots that do not record their slices refused; the restore's own agreement
choosing them over an older checkpoint and clearing the old layout's directories."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from small_runs import QUICK_RUN

from msjax.checkpoint.commits import COMMIT_MARKER
from msjax.checkpoint.snapshot_reshard import (
    assemble_shards,
    pieces_by_step,
    uncovered,
)
from msjax.checkpoint.snapshots import (
    MANIFEST,
    SnapshotDamaged,
    SnapshotStore,
    run_snapshots_dir,
    shared_memory_root,
)
from msjax.config import load_config
from msjax.training.memory_restore import place_shards, restore_from_memory, state_layout
from msjax.training.memory_snapshots import copy_shards, host_shards

OLD_PROCESSES, STEP = 4, 7


def train_like_state(mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
    """A matrix sharded over every axis (no replicas), a bfloat16 vector over fsdp (replicated
    on the other axes), an int32 step replicated everywhere."""
    rows = ("data", "fsdp") if "data" in mesh.axis_names else "fsdp"
    matrix = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) / 7 - 3  # [embed, mlp]
    return {
        "matrix": jax.device_put(matrix, NamedSharding(mesh, P(rows, "tensor"))),
        "vector": jax.device_put(
            jnp.linspace(-2, 2, 16, dtype=jnp.bfloat16), NamedSharding(mesh, P("fsdp"))
        ),
        "step": jax.device_put(jnp.int32(STEP), NamedSharding(mesh, P())),
    }


def old_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))


def write_as_processes(run_snapshots: Path, state: dict[str, jax.Array]) -> None:
    """The step's snapshots as a job of OLD_PROCESSES processes wrote them: process p held the
    devices 2p and 2p+1, each in its own directory, with its own layout record."""
    shards = host_shards(copy_shards(jax.tree.leaves(state)))
    layout = state_layout(state)
    for process in range(OLD_PROCESSES):
        mine = [shard for shard in shards if shard.device_id // 2 == process]
        record = {
            "meta": {"data": {"samples_seen": STEP * 8}},
            "layout": {**layout, "process_count": OLD_PROCESSES, "process_index": process},
        }
        SnapshotStore(run_snapshots / f"process-{process}").write(STEP, mine, record)


def abstract(state: dict[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def new_layouts() -> dict[str, jax.sharding.Mesh]:
    devices = jax.devices()
    return {
        "fsdp2 x tensor2 on 4 devices": jax.make_mesh(
            (2, 2), ("fsdp", "tensor"), devices=devices[:4]
        ),
        "fsdp4 x tensor2 on 8 devices": jax.make_mesh((4, 2), ("fsdp", "tensor"), devices=devices),
        "fsdp1 x tensor8, devices reversed": jax.make_mesh(
            (1, 8), ("fsdp", "tensor"), devices=devices[::-1]
        ),
    }


@pytest.mark.parametrize("layout", list(new_layouts()))
def test_snapshots_of_four_processes_reshard_bitwise_onto_another_mesh(tmp_path: Path, layout):
    original = train_like_state(old_mesh())
    write_as_processes(tmp_path, original)
    target = abstract(train_like_state(new_layouts()[layout]))
    pieces = pieces_by_step(tmp_path)[STEP]
    assert (pieces.process_count, pieces.owners) == (OLD_PROCESSES, {0, 1, 2, 3})
    mesh = dict(new_layouts()[layout].shape)
    assert uncovered(pieces, target, mesh) == ""
    shards, bytes_read = assemble_shards(pieces, target)
    restored = place_shards(shards, target)
    # each slice is read once, from one of its replicas: the matrix whole, the vector whole, a step
    assert bytes_read == 16 * 8 * 4 + 16 * 2 + 4
    for name, leaf in original.items():
        assert restored[name].sharding == target[name].sharding
        assert restored[name].dtype == leaf.dtype
        assert np.asarray(restored[name]).tobytes() == np.asarray(leaf).tobytes()


def replicas_of_a_vector_slice(run_snapshots: Path) -> list[Path]:
    """The files holding the vector's first slice (its leaf is 2 in the flattened state)."""
    files = []
    for manifest_path in sorted(run_snapshots.glob(f"process-*/step-{STEP}/{MANIFEST}")):
        for entry in json.loads(manifest_path.read_text())["files"]:
            if entry["leaf"] == 2 and entry["region"] == [[0, 8]]:
                files.append(manifest_path.parent / entry["name"])
    return files


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[3] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_passed_over_for_another_replica_and_refused_where_none_is_left(
    tmp_path: Path,
):
    original = train_like_state(old_mesh())
    write_as_processes(tmp_path, original)
    target = abstract(train_like_state(new_layouts()["fsdp2 x tensor2 on 4 devices"]))
    assert jax.tree_util.tree_flatten_with_path(original)[0][2][0][0].key == "vector"
    replicas = replicas_of_a_vector_slice(tmp_path)
    assert len(replicas) == 4  # data 2 x tensor 2 devices hold it
    flip_a_byte(replicas[0])
    shards, _ = assemble_shards(pieces_by_step(tmp_path)[STEP], target)
    restored = place_shards(shards, target)
    assert np.asarray(restored["vector"]).tobytes() == np.asarray(original["vector"]).tobytes()
    for replica in replicas[1:]:
        flip_a_byte(replica)
    with pytest.raises(SnapshotDamaged, match="does not match its sha256"):
        assemble_shards(pieces_by_step(tmp_path)[STEP], target)


def test_a_missing_process_makes_the_step_not_coverable_and_says_whose_are_here(tmp_path: Path):
    write_as_processes(tmp_path, train_like_state(old_mesh()))
    for path in sorted((tmp_path / "process-3").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    target = abstract(train_like_state(new_layouts()["fsdp2 x tensor2 on 4 devices"]))
    reason = uncovered(pieces_by_step(tmp_path)[STEP], target, {"fsdp": 2, "tensor": 2})
    assert "is not whole in the snapshots within reach" in reason
    assert "process(es) 0, 1, 2 of the 4-process layout, on this node" in reason


def test_snapshots_that_do_not_record_their_slices_are_refused(tmp_path: Path):
    write_as_processes(tmp_path, train_like_state(old_mesh()))
    manifest_path = tmp_path / "process-1" / f"step-{STEP}" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["files"]:
        del entry["region"]
    manifest_path.write_text(json.dumps(manifest))
    assert pieces_by_step(tmp_path)[STEP] == (
        f"the snapshots of step {STEP} do not record their shards' slices"
    )


def test_a_manifest_whose_slice_does_not_fit_its_shard_is_refused(tmp_path: Path):
    write_as_processes(tmp_path, train_like_state(old_mesh()))
    manifest_path = tmp_path / "process-2" / f"step-{STEP}" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][0]["region"][0] = [0, 16]  # the whole axis, for a shard of half of it
    manifest_path.write_text(json.dumps(manifest))
    refused = pieces_by_step(tmp_path)[STEP]
    assert isinstance(refused, str) and refused.startswith(f"a manifest of step {STEP}")
    assert "0.bin: slice [[0, 16]" in refused


def test_a_changed_pipeline_is_not_resharded(tmp_path: Path):
    write_as_processes(tmp_path, train_like_state(old_mesh()))
    target = abstract(train_like_state(new_layouts()["fsdp2 x tensor2 on 4 devices"]))
    reason = uncovered(pieces_by_step(tmp_path)[STEP], target, {"fsdp": 2, "pipe": 2})
    assert reason.startswith("the pipeline changed")


@pytest.mark.skipif(shared_memory_root() is None, reason="no writable /dev/shm")
def test_the_restore_reshards_a_shrunk_jobs_snapshots_and_then_removes_the_old_ones(
    tmp_path: Path,
):
    run_dir = tmp_path / "run"
    config = load_config(
        None, [*QUICK_RUN, "checkpoint.memory_every_steps=1", f"run.dir={run_dir}"]
    )
    run_snapshots = run_snapshots_dir(run_dir, shared_memory_root())
    try:
        original = train_like_state(old_mesh())
        write_as_processes(run_snapshots, original)
        target = abstract(train_like_state(new_layouts()["fsdp2 x tensor2 on 4 devices"]))
        checkpoints = tmp_path / "checkpoints"
        (checkpoints / "3").mkdir(parents=True)  # an older committed checkpoint
        (checkpoints / "3" / COMMIT_MARKER).touch()
        restored, not_used = restore_from_memory(config, checkpoints, target)
        assert not_used == "" and restored is not None
        assert (restored.step, restored.source, restored.from_processes) == (7, "resharded", 4)
        assert restored.meta == {"data": {"samples_seen": STEP * 8}}
        for name, leaf in original.items():
            assert np.asarray(restored.state[name]).tobytes() == np.asarray(leaf).tobytes()
        # this one-process run keeps process 0's directory; those of processes 1-3 are gone
        assert sorted(p.name for p in run_snapshots.iterdir()) == ["process-0"]
    finally:
        import shutil

        shutil.rmtree(run_snapshots, ignore_errors=True)


@pytest.mark.skipif(shared_memory_root() is None, reason="no writable /dev/shm")
def test_a_newer_checkpoint_wins_over_resharded_snapshots_and_says_why(tmp_path: Path):
    run_dir = tmp_path / "run"
    config = load_config(
        None, [*QUICK_RUN, "checkpoint.memory_every_steps=1", f"run.dir={run_dir}"]
    )
    run_snapshots = run_snapshots_dir(run_dir, shared_memory_root())
    try:
        write_as_processes(run_snapshots, train_like_state(old_mesh()))
        target = abstract(train_like_state(new_layouts()["fsdp2 x tensor2 on 4 devices"]))
        checkpoints = tmp_path / "checkpoints"
        (checkpoints / "8").mkdir(parents=True)
        (checkpoints / "8" / COMMIT_MARKER).touch()
        restored, not_used = restore_from_memory(config, checkpoints, target)
        assert restored is None
        assert not_used == (
            "the process count changed (4 -> now 1); resharding: step 7 is not newer than "
            "checkpoint 8"
        )
    finally:
        import shutil

        shutil.rmtree(run_snapshots, ignore_errors=True)
