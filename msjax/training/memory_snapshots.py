"""The loop's in-memory snapshots (checkpoint.memory_every_steps), both ways. Saving: after a
due step the state is copied on its devices, and a background thread brings this process's
shards to the host and writes them to the snapshot store (msjax.checkpoint.snapshots),
overlapping the next steps. Restoring a restarted run: every process agrees on the newest step
that all hold whole, in the layout the run has now, and newer than the newest committed disk
checkpoint; else all go to the disk together. Both hold a snapshot against the same
`state_layout`, so it lives here once."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msjax.checkpoint.commits import committed_steps
from msjax.checkpoint.fingerprint import leaf_name
from msjax.checkpoint.snapshots import (
    ShardFile,
    SnapshotDamaged,
    SnapshotStore,
    memory_shortfall,
    process_snapshot_store,
    writable_snapshot_store,
)
from msjax.config import Config
from msjax.loop_events import LoopEvents
from msjax.observe.goodput import read_records
from msjax.parallel.agreement import (
    ProcessVote,
    agree_any,
    agree_max,
    agree_min,
    process_vote,
)
from msjax.run_dir import RunDir


def state_layout(tree: Any) -> dict[str, Any]:
    """How this process holds the state: the process count and index, the mesh, and a hash of
    every leaf's shape, dtype and the index each local device holds. Works on arrays and on
    jax.ShapeDtypeStruct leaves with a sharding alike, so a snapshot's layout can be held
    against the state a run is about to restore into."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    described = []
    for path, leaf in leaves:
        indices = leaf.sharding.addressable_devices_indices_map(leaf.shape)
        local = sorted(
            (
                device.id,
                [
                    list(part.indices(size))[:2]
                    for part, size in zip(index, leaf.shape, strict=True)
                ],
            )
            for device, index in indices.items()
        )
        described.append([leaf_name(path), list(leaf.shape), str(leaf.dtype), local])
    mesh = getattr(leaves[0][1].sharding, "mesh", None) if leaves else None
    return {
        "process_count": jax.process_count(),
        "process_index": jax.process_index(),
        "mesh": dict(mesh.shape) if mesh is not None else {},
        "leaves_sha256": hashlib.sha256(json.dumps(described).encode()).hexdigest(),
    }


def host_shards(copied_leaves: list[Any]) -> list[ShardFile]:
    """Every addressable shard of the copied leaves, brought to the host (blocks on the copy)."""
    import numpy as np

    return [
        ShardFile(number, shard.device.id, np.asarray(shard.data))
        for number, leaf in enumerate(copied_leaves)
        for shard in leaf.addressable_shards
    ]


class MemorySnapshots:
    """Snapshots every `every_steps` steps into `store` (made and cleared of unfinished writes
    by its builder), one written at a time by a background thread. Every process takes or skips
    the same snapshots: at each due step they vote (`vote`, None in a one-process run), and one
    due while the last is still being written on any process is skipped by all (and counted),
    never waited for; a write that failed on any process turns them off on all."""

    def __init__(
        self,
        every_steps: int,
        store: SnapshotStore,
        meta_of: Callable[[int], dict[str, Any]],
        events: LoopEvents,
        warn: Callable[[str], None],
        vote: ProcessVote | None = None,
    ):
        self.every_steps = every_steps
        self.store = store
        self.meta_of = meta_of  # step -> the record a restore needs beside the arrays
        self.events = events
        self.warn = warn
        self.vote = vote  # the processes' per-snapshot vote: take, skip, or turn off
        self.skipped = 0  # snapshots not taken: the one before was still being written
        self._writer: threading.Thread | None = None
        self._error: str | None = None
        self._layout: dict[str, Any] | None = None  # the state's, the same every step

    def after_step(self, step: int, state: Any) -> None:
        """Snapshot `state` (which has `step` updates) when due and every process agrees: the
        device copy is dispatched here, everything else happens in the background."""
        if not self.every_steps or step % self.every_steps:
            return
        import jax

        started = time.perf_counter()
        busy = self._writer is not None and self._writer.is_alive()
        busy_anywhere, failed_anywhere = agree_max(self.vote, [busy, self._error is not None])
        if failed_anywhere:
            failure = self._error or "an in-memory snapshot failed on another process"
            self.warn(f"warning: {failure}; in-memory snapshots are off from here on")
            self.every_steps, self._error = 0, None
            return
        if busy_anywhere:
            self.skipped += 1
            self.events.memory_snapshot(step, time.perf_counter() - started, 0, self.skipped)
            return
        leaves = jax.tree.leaves(state)
        # a copy the next step's donation cannot take away; the host copy follows in the thread
        copied = jax.device_put(leaves, [leaf.sharding for leaf in leaves], may_alias=False)
        if self._layout is None:
            self._layout = state_layout(state)
        record = {"meta": self.meta_of(step), "layout": self._layout}
        self._writer = threading.Thread(
            target=self._write, args=(step, copied, record), name="msjax-snapshot", daemon=True
        )
        self._writer.start()
        stall_s = time.perf_counter() - started
        self.events.memory_snapshot(step, stall_s, addressable_bytes(copied), self.skipped)

    def _write(self, step: int, copied: list[Any], record: dict[str, Any]) -> None:
        try:
            self.store.write(step, host_shards(copied), record)
        except Exception as error:  # shared memory full, say: the run goes on without them
            self._error = f"the in-memory snapshot of step {step} failed: {error}"

    def close(self) -> None:
        """Wait for the snapshot being written."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def remove(self) -> None:
        """Delete this process's snapshots, and the run's directory once no process has any
        left (a run that ends cleanly on its own; under msjax.launch the launcher does it)."""
        self.close()
        shutil.rmtree(self.store.directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.store.directory.parent.rmdir()  # only once empty: the last process to end


def addressable_bytes(leaves: list[Any]) -> int:
    """The bytes of this process's shards of `leaves` (arrays or a state's leaves)."""
    return sum(shard.data.nbytes for leaf in leaves for shard in leaf.addressable_shards)


def build_memory_snapshots(
    config: Config,
    run_dir: Path,
    state: Any,
    meta_of: Callable[[int], dict[str, Any]],
    events: LoopEvents,
    warn: Callable[[str], None],
) -> MemorySnapshots | None:
    """The run's snapshots of `state` as configured, or None: off, or off on every process
    because one has no shared memory or too little RAM for them (said in one line)."""
    import jax

    every_steps = config.checkpoint.memory_every_steps
    if not every_steps:
        return None
    snapshot_bytes = addressable_bytes(jax.tree.leaves(state))
    store = writable_snapshot_store(run_dir, jax.process_index())
    if store is None:
        problem = "no writable /dev/shm on this node"
    else:
        problem = memory_shortfall(store, snapshot_bytes, config.checkpoint.memory_max_fraction)
    if agree_any(process_vote("memory-budget"), bool(problem)):
        if store is not None:  # made just now and written nothing into: not left behind
            for directory in (store.directory, store.directory.parent):
                with contextlib.suppress(OSError):
                    directory.rmdir()  # only where empty
        off = f"checkpoint.memory_every_steps={every_steps}: in-memory snapshots are off"
        warn(f"warning: {off}: {problem or 'another process cannot hold them'}")
        return None
    warn(
        f"in-memory snapshots every {every_steps} steps take {2 * snapshot_bytes} bytes of RAM on "
        "this host for this process (its shards, twice)"
    )
    return MemorySnapshots(
        every_steps, store, meta_of, events, warn, vote=process_vote("memory-save")
    )


@dataclass(frozen=True)
class MemoryRestored:
    """A state placed from this process's snapshot, with the record it was saved with."""

    state: Any
    step: int
    meta: dict[str, Any]
    path: Path
    snapshot_bytes: int  # read from shared memory by this process
    seconds: float


def usable_steps(store: SnapshotStore | None, layout: dict[str, Any]) -> tuple[list[int], str]:
    """The whole snapshots whose layout is the run's now, oldest first, and why the newest whole
    one is not usable ("" when it is, or there is none)."""
    if store is None:
        return [], "no writable /dev/shm on this node"
    usable, reason = [], ""
    for step in store.complete_steps():
        try:
            saved = store.manifest(step).get("layout", {})
        except SnapshotDamaged as error:
            reason = str(error)
            continue
        if saved == layout:
            usable.append(step)
            reason = ""
        elif saved.get("process_count") != layout["process_count"]:
            reason = f"the process count changed ({saved.get('process_count')} -> now "
            reason += f"{layout['process_count']})"
        elif saved.get("mesh") != layout["mesh"]:
            reason = f"the mesh changed ({saved.get('mesh')} -> now {layout['mesh']})"
        else:
            reason = "the state's layout on this process's devices changed"
    return usable, reason


def after_corruption(run_dir: Path) -> str:
    """Why snapshots are passed over where the run's last incident was silent data corruption
    (its snapshots may hold the corrupted state; the checkpoints record whether their replicas
    agreed), else ""."""
    incidents = read_records(RunDir(run_dir).incidents_log)
    if incidents and incidents[-1].get("corruption"):
        return f"incident {incidents[-1].get('incident')} was silent data corruption"
    return ""


def place_shards(shards: list[ShardFile], abstract_state: Any) -> Any:
    """The state from this process's shards, each on its device, with the state's shardings."""
    import jax

    leaves, treedef = jax.tree.flatten(abstract_state)
    by_leaf: dict[int, dict[int, Any]] = {}
    for shard in shards:
        by_leaf.setdefault(shard.leaf, {})[shard.device_id] = shard.data
    arrays = []
    for number, leaf in enumerate(leaves):
        held = by_leaf.get(number, {})
        devices = leaf.sharding.addressable_devices_indices_map(leaf.shape)
        pieces = []
        for device in devices:
            data = held.get(device.id)
            if data is None or data.dtype != leaf.dtype:
                raise SnapshotDamaged(f"leaf {number} lacks its shard of device {device.id}")
            pieces.append(jax.device_put(data, device))
        arrays.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, pieces))
    return jax.tree.unflatten(treedef, arrays)


def restore_from_memory(
    config: Config, checkpoints: Path, abstract_state: Any
) -> tuple[MemoryRestored | None, str]:
    """The newest snapshot every process holds whole and verified, in the run's layout and newer
    than the newest committed checkpoint in `checkpoints`; else None (the disk's turn, for every
    process alike), with why where snapshots were there ("" where none were)."""
    if not config.checkpoint.memory_every_steps:
        return None, ""
    import jax

    started = time.perf_counter()
    vote = process_vote("memory-restore")
    run_dir = Path(config.run.dir or ".")
    store = process_snapshot_store(run_dir, jax.process_index())
    usable, reason = usable_steps(store, state_layout(abstract_state))
    corruption = after_corruption(run_dir)
    if corruption:
        usable, reason = [], corruption
    step = agree_min(vote, usable[-1] if usable else -1)
    disk_step = agree_max(vote, [max(committed_steps(checkpoints), default=-1)])[0]
    held_anywhere = agree_any(vote, bool(store and store.complete_steps()))
    if step < 0 or step <= disk_step:
        if not held_anywhere:
            return None, ""
        if step >= 0:
            return (
                None,
                f"the newest whole one (step {step}) is not newer than checkpoint {disk_step}",
            )
        return None, reason or "not every process holds a whole snapshot"
    problem = None if step in usable else f"this process holds no whole snapshot of step {step}"
    state, manifest = None, {}
    if problem is None:
        try:
            manifest, shards = store.read(step)
            state = place_shards(shards, abstract_state)
        except SnapshotDamaged as error:
            problem = str(error)
    if agree_any(vote, problem is not None):
        refused = problem or "a snapshot on another process failed its check"
        return None, f"the snapshot of step {step} is refused: {refused}"
    snapshot_bytes = sum(entry["bytes"] for entry in manifest["files"])
    seconds = time.perf_counter() - started
    restored = MemoryRestored(
        state, step, manifest["meta"], store.path(step), snapshot_bytes, seconds
    )
    return restored, ""
