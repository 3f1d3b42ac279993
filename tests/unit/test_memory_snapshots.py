"""The snapshot store in-process: shards written whole and read back bitwise onto their devices,
at most two snapshots, a half-written one never listed, a flipped byte refused, the layout held
against the run's, the loop's writer skipping (and counting) a snapshot due mid-write or, with
checkpoint.memory_when_busy=wait, waiting for that write and taking it, and a plain run removing
its snapshots at its end."""

from __future__ import annotations

import io
import json
import os
import re
import stat
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from small_runs import QUICK_RUN

from msjax.checkpoint.commits import committed_steps
from msjax.checkpoint.snapshots import (
    MANIFEST,
    SHARED_MEMORY,
    UNFINISHED_PREFIX,
    SnapshotDamaged,
    SnapshotStore,
    run_snapshots_dir,
    shared_memory_root,
    usable_steps,
)
from msjax.config import load_config
from msjax.loop_events import LoopEvents
from msjax.observe.goodput import read_records
from msjax.run_dir import RunDir
from msjax.train import train
from msjax.training.memory_restore import after_corruption, place_shards, state_layout
from msjax.training.memory_snapshots import MemorySnapshots, copy_shards, host_shards


def sharded_state(scale: float = 1.0) -> dict[str, jax.Array]:
    """A small state over the 8 CPU devices: a sharded matrix, a bfloat16 vector, a step."""
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))
    matrix = jnp.arange(64, dtype=jnp.float32).reshape(8, 8) * scale - 0.0
    return {
        "matrix": jax.device_put(matrix, NamedSharding(mesh, P("data", "tensor"))),
        "vector": jax.device_put(
            jnp.linspace(-1, 1, 16, dtype=jnp.bfloat16), NamedSharding(mesh, P("tensor"))
        ),
        "step": jax.device_put(jnp.int32(7), NamedSharding(mesh, P())),
    }


def write(store: SnapshotStore, step: int, state: dict[str, jax.Array]) -> int:
    record = {"meta": {"data": {"samples_seen": step * 8}}, "layout": state_layout(state)}
    return store.write(step, host_shards(copy_shards(jax.tree.leaves(state))), record)


def abstract(state: dict[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def test_each_shard_is_copied_on_its_own_device_and_outlives_the_states_donation():
    state = sharded_state()
    leaves = jax.tree.leaves(state)
    before = [np.asarray(leaf) for leaf in leaves]
    copies = copy_shards(leaves)
    shards = [shard for leaf in leaves for shard in leaf.addressable_shards]
    assert len(copies) == len(shards) == 8 + 8 + 8
    for copy, shard in zip(copies, shards, strict=True):
        # one device's array (never a program over every device or process), a buffer of its own
        assert copy.data.devices() == {shard.device} and copy.device_id == shard.device.id
        assert copy.data.unsafe_buffer_pointer() != shard.data.unsafe_buffer_pointer()
    for leaf in leaves:  # as the next step's donation frees them: the copies keep the values
        leaf.delete()
    for shard_file in host_shards(copies):
        leaf = before[shard_file.leaf]
        expected = leaf[tuple(slice(start, stop) for start, stop in shard_file.region)]
        np.testing.assert_array_equal(shard_file.data, expected)


def test_a_snapshot_reads_back_bitwise_onto_the_states_shardings(tmp_path: Path):
    state = sharded_state()
    store = SnapshotStore(tmp_path / "process-0")
    written = write(store, 3, state)
    manifest, shards = store.read(3)
    restored = place_shards(shards, abstract(state))
    assert manifest["meta"] == {"data": {"samples_seen": 24}}
    # every device's shard of each leaf: 8 floats, 8 bfloat16 (half the vector), one int32
    assert written == 8 * (8 * 4) + 8 * (8 * 2) + 8 * 4
    for name, leaf in state.items():
        assert restored[name].sharding == leaf.sharding
        assert restored[name].dtype == leaf.dtype
        assert np.array_equal(np.asarray(restored[name]), np.asarray(leaf))


def test_at_most_two_snapshots_exist_and_the_newest_two_are_kept(tmp_path: Path):
    store = SnapshotStore(tmp_path / "process-0")
    for step in (1, 2, 3, 4):
        write(store, step, sharded_state(step))
        assert len(os.listdir(store.directory)) <= 2
    assert store.complete_steps() == [3, 4]


def test_a_snapshot_of_an_earlier_step_drops_those_of_the_timeline_the_run_left(tmp_path: Path):
    store = SnapshotStore(tmp_path / "process-0")
    for step in (6, 7):
        write(store, step, sharded_state(step))
    write(store, 5, sharded_state(0.5))  # a replay from an older checkpoint
    assert store.complete_steps() == [5]
    manifest, shards = store.read(5)
    assert manifest["step"] == 5
    assert np.asarray(shards[0].data)[0, 1] == 0.5


def test_a_half_written_snapshot_is_never_listed_and_is_cleared(tmp_path: Path):
    store = SnapshotStore(tmp_path / "process-0")
    write(store, 1, sharded_state())
    left = store.directory / f"{UNFINISHED_PREFIX}2-abcd"
    left.mkdir()
    (left / "0.bin").write_bytes(b"half")
    no_manifest = store.path(5)
    no_manifest.mkdir()
    assert store.complete_steps() == [1]
    store.remove_unfinished()
    assert not left.exists() and store.complete_steps() == [1]


def test_a_flipped_byte_in_a_shard_is_refused_by_its_sha256(tmp_path: Path):
    store = SnapshotStore(tmp_path / "process-0")
    write(store, 2, sharded_state())
    shard = store.path(2) / "3.bin"
    data = bytearray(shard.read_bytes())
    data[1] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(SnapshotDamaged, match=r"3\.bin does not match its sha256"):
        store.read(2)


def test_a_garbled_manifest_is_refused(tmp_path: Path):
    store = SnapshotStore(tmp_path / "process-0")
    write(store, 2, sharded_state())
    (store.path(2) / MANIFEST).write_text("{not json")
    with pytest.raises(SnapshotDamaged, match="manifest unreadable"):
        store.read(2)


def test_the_directories_are_private_and_named_after_the_run(tmp_path: Path):
    store = SnapshotStore(run_snapshots_dir(tmp_path / "runs" / "a", tmp_path / "shm") / "p0")
    write(store, 1, sharded_state())
    for directory in (store.directory, store.directory.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    other = run_snapshots_dir(tmp_path / "elsewhere" / "a", tmp_path / "shm")
    assert other != store.directory.parent and other.name.startswith("a-")


def test_a_snapshot_of_another_layout_is_not_usable_and_says_why(tmp_path: Path):
    store = SnapshotStore(tmp_path / "process-0")
    state = sharded_state()
    write(store, 1, state)
    assert usable_steps(store, state_layout(state)) == ([1], "")
    mesh = jax.make_mesh((8,), ("data",))
    other = {**state, "matrix": jax.device_put(state["matrix"], NamedSharding(mesh, P("data")))}
    steps, reason = usable_steps(store, state_layout(other))
    assert steps == [] and "the mesh changed" in reason


class Recorded(LoopEvents):
    def __init__(self):
        self.snapshots: list[tuple[int, int, int]] = []
        self.stalls_s: dict[int, float] = {}

    def memory_snapshot(self, step, stall_s, snapshot_bytes, skipped_total):
        self.snapshots.append((step, snapshot_bytes, skipped_total))
        self.stalls_s[step] = stall_s


def test_a_snapshot_due_while_the_last_is_written_is_skipped_and_counted(tmp_path: Path):
    store = SnapshotStore(tmp_path / "process-0")
    release = threading.Event()
    writes = store.write

    def held_write(step, shards, record):  # the store's own write, once the test lets it
        release.wait()
        return writes(step, shards, record)

    store.write = held_write
    events = Recorded()
    snapshots = MemorySnapshots(2, store, lambda step: {"step": step}, events, print)
    state = sharded_state()
    for step in (1, 2, 3, 4):
        snapshots.after_step(step, state)
    release.set()
    snapshots.close()
    assert [(s, b > 0, k) for s, b, k in events.snapshots] == [(2, True, 0), (4, False, 1)]
    assert store.complete_steps() == [2]
    assert store.manifest(2)["meta"] == {"step": 2}


class SnapshotWatch(LoopEvents):
    """The snapshot events of a run, and whether its snapshot directory existed at each."""

    def __init__(self, run_dir: Path):
        self.directory = run_snapshots_dir(run_dir, SHARED_MEMORY)
        self.heard: list[tuple[int, bool, bool]] = []
        self.snapshot_bytes: list[int] = []

    def memory_snapshot(self, step, stall_s, snapshot_bytes, skipped_total):
        self.heard.append((step, snapshot_bytes > 0 or skipped_total > 0, self.directory.is_dir()))
        self.snapshot_bytes.append(snapshot_bytes)


@pytest.mark.skipif(shared_memory_root() is None, reason="no writable /dev/shm")
def test_a_plain_run_snapshots_as_configured_and_removes_its_snapshots_at_its_end(tmp_path: Path):
    run_dir = tmp_path / "run"
    overrides = [
        *QUICK_RUN,
        "train.steps=4",
        "train.eval_every=0",
        "checkpoint.memory_every_steps=2",
        f"run.dir={run_dir}",
    ]
    watch = SnapshotWatch(run_dir)
    output = io.StringIO()
    train(load_config(None, overrides), output, listeners=[watch])
    assert watch.heard == [(2, True, True), (4, True, True)]
    assert not watch.directory.exists()
    # the start-up line: the RAM they take, this process's shards twice (double-buffered)
    taken = [line for line in output.getvalue().splitlines() if "bytes of RAM" in line]
    assert taken == [
        f"in-memory snapshots every 2 steps take {2 * watch.snapshot_bytes[0]} bytes of RAM on "
        "this host for this process (its shards, twice)"
    ]


@pytest.mark.skipif(shared_memory_root() is None, reason="no writable /dev/shm")
def test_too_little_memory_turns_snapshots_off_and_the_run_trains_on_saving_to_disk(
    tmp_path: Path,
):
    run_dir = tmp_path / "run"
    overrides = [
        *QUICK_RUN,
        "train.steps=4",
        "train.eval_every=0",
        "checkpoint.every_steps=2",
        "checkpoint.memory_every_steps=1",
        "checkpoint.memory_max_fraction=1e-15",  # far less than the state's bytes twice
        f"run.dir={run_dir}",
    ]
    watch = SnapshotWatch(run_dir)
    output = io.StringIO()
    train(load_config(None, overrides), output, listeners=[watch])
    refused = [line for line in output.getvalue().splitlines() if "snapshots are off" in line]
    assert len(refused) == 1, output.getvalue()[-3000:]
    needed, available = (int(n) for n in re.findall(r"(\d+) bytes", refused[0])[:2])
    assert needed > 1e-15 * available and needed > 0
    assert "raise checkpoint.memory_max_fraction" in refused[0]
    assert watch.heard == [] and not watch.directory.exists()
    assert committed_steps(RunDir(run_dir).checkpoints) == [2, 4]
    steps = [r["step"] for r in read_records(RunDir(run_dir).metrics) if "loss" in r]
    assert steps == [0, 1, 2, 3]  # every step trained (metrics count steps from 0)


def test_snapshots_are_passed_over_after_an_incident_of_silent_corruption(tmp_path: Path):
    incidents = RunDir(tmp_path).incidents_log
    assert after_corruption(tmp_path) == ""
    incidents.write_text(json.dumps({"incident": 1, "cause": "crash"}) + "\n")
    assert after_corruption(tmp_path) == ""
    corrupt = {"incident": 2, "cause": "corruption", "corruption": {"event": "transient"}}
    incidents.write_text(incidents.read_text() + json.dumps(corrupt) + "\n")
    assert after_corruption(tmp_path) == "incident 2 was silent data corruption"


class HeldStore(SnapshotStore):
    """A real snapshot store whose writes each wait for `release` first; `rest_s` is how long
    each write took once released (the rest of it: the shards written to their files)."""

    def __init__(self, directory: Path):
        super().__init__(directory)
        self.release = threading.Event()
        self.rest_s: dict[int, float] = {}

    def write(self, step, shards, record):
        self.release.wait()
        started = time.perf_counter()
        written = super().write(step, shards, record)
        self.rest_s[step] = time.perf_counter() - started
        return written


class ReleasingVote:
    """One process's vote (the maximum of its own values) that lets the store's held write go
    once this process votes that it is still writing: the write is then certainly unfinished
    when the snapshot after it is due, and finishes only after that step's decision is cast."""

    def __init__(self, store: HeldStore):
        self.store = store

    def agree(self, values):
        if values[0]:  # busy: the write before is still held
            self.store.release.set()
        return tuple(int(value) for value in values)


def snapshot_steps_1_to_4(store: HeldStore, when_busy: str) -> Recorded:
    """Steps 1 to 4 with a snapshot due every 2, the snapshot of step 2 still being written
    when that of step 4 is due."""
    events = Recorded()
    vote = ReleasingVote(store)
    snapshots = MemorySnapshots(
        2, store, lambda step: {"step": step}, events, print, vote=vote, when_busy=when_busy
    )
    state = sharded_state()
    for step in (1, 2, 3, 4):
        snapshots.after_step(step, state)
    store.release.set()
    snapshots.close()
    return events


def test_a_snapshot_due_mid_write_is_skipped_by_default_even_if_the_write_ends_just_after(
    tmp_path: Path,
):
    store = HeldStore(tmp_path / "process-0")
    events = snapshot_steps_1_to_4(store, "skip")
    assert [(s, b > 0, k) for s, b, k in events.snapshots] == [(2, True, 0), (4, False, 1)]
    assert store.complete_steps() == [2]


def test_with_memory_when_busy_wait_a_snapshot_due_mid_write_waits_for_it_and_is_taken(
    tmp_path: Path,
):
    store = HeldStore(tmp_path / "process-0")
    events = snapshot_steps_1_to_4(store, "wait")
    assert [(s, b > 0, k) for s, b, k in events.snapshots] == [(2, True, 0), (4, True, 0)]
    assert store.complete_steps() == [2, 4]
    assert store.manifest(4)["meta"] == {"step": 4}
    # step 4's stall holds the rest of step 2's write: released by step 4's vote, joined after
    assert events.stalls_s[4] >= store.rest_s[2] > 0
