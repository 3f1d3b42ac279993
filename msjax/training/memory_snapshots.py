"""The loop's in-memory snapshots (checkpoint.memory_every_steps): after a due step the state is
copied on its devices, and a background thread brings this process's shards to the host and
writes them to the snapshot store (msjax.checkpoint.snapshots), overlapping the next steps."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from msjax.checkpoint.fingerprint import leaf_name
from msjax.checkpoint.snapshots import (
    ShardFile,
    SnapshotStore,
    make_private_dir,
    process_snapshots_dir,
    shared_memory_root,
)
from msjax.config import Config
from msjax.loop_events import LoopEvents


def process_snapshot_store(run_dir: Path, process_index: int) -> SnapshotStore | None:
    """This process's snapshot store of the run, or None where /dev/shm cannot be written."""
    root = shared_memory_root()
    if root is None:
        return None
    return SnapshotStore(process_snapshots_dir(run_dir, root, process_index))


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
    """Snapshots every `every_steps` steps, one written at a time by a background thread; one
    due while the last is still being written is skipped (and counted), never waited for."""

    def __init__(
        self,
        every_steps: int,
        store: SnapshotStore,
        meta_of: Callable[[int], dict[str, Any]],
        events: LoopEvents,
        warn: Callable[[str], None],
    ):
        self.every_steps = every_steps
        self.store = store
        self.meta_of = meta_of  # step -> the record a restore needs beside the arrays
        self.events = events
        self.warn = warn
        self.skipped = 0  # snapshots not taken: the one before was still being written
        self._writer: threading.Thread | None = None
        self._error: str | None = None
        self._layout: dict[str, Any] | None = None  # the state's, the same every step
        make_private_dir(store.directory)
        store.remove_unfinished()

    def after_step(self, step: int, state: Any) -> None:
        """Snapshot `state` (which has `step` updates) when due: the device copy is dispatched
        here, everything else happens in the background."""
        if not self.every_steps or step % self.every_steps:
            return
        import jax

        if self._error is not None:
            self.warn(f"warning: {self._error}; in-memory snapshots are off from here on")
            self.every_steps, self._error = 0, None
            return
        started = time.perf_counter()
        if self._writer is not None and self._writer.is_alive():
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
        snapshot_bytes = sum(
            shard.data.nbytes for leaf in copied for shard in leaf.addressable_shards
        )
        stall_s = time.perf_counter() - started
        self.events.memory_snapshot(step, stall_s, snapshot_bytes, self.skipped)

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


def build_memory_snapshots(
    config: Config,
    run_dir: Path,
    meta_of: Callable[[int], dict[str, Any]],
    events: LoopEvents,
    warn: Callable[[str], None],
) -> MemorySnapshots | None:
    """The run's snapshots as configured, or None (off, or no shared memory: said in one line)."""
    import jax

    every_steps = config.checkpoint.memory_every_steps
    if not every_steps:
        return None
    store = process_snapshot_store(run_dir, jax.process_index())
    if store is None:
        warn(
            f"warning: checkpoint.memory_every_steps={every_steps}: no writable /dev/shm on this "
            "node; in-memory snapshots are off"
        )
        return None
    return MemorySnapshots(every_steps, store, meta_of, events, warn)
