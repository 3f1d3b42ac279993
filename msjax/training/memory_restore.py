"""Restoring a restarted run from its in-memory snapshots (msjax.training.memory_snapshots wrote
them): every process agrees on the newest step that all hold whole, in the layout the run has
now, and newer than the newest committed disk checkpoint; else all go to the disk together."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msjax.checkpoint.commits import committed_steps
from msjax.checkpoint.snapshots import ShardFile, SnapshotDamaged, SnapshotStore
from msjax.config import Config
from msjax.observe.goodput import read_records
from msjax.parallel.agreement import agree_any, agree_max, agree_min, process_vote
from msjax.run_dir import RunDir
from msjax.training.memory_snapshots import process_snapshot_store, state_layout


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
