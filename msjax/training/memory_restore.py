"""Restoring a restarted run from the in-memory snapshots (checkpoint.memory_every_steps): every
process agrees on the newest step that each holds whole (its own snapshot, else the copy its
buddy holds for it), in the layout the run has now, and newer than the newest committed disk
checkpoint; each restores that step from wherever its own part is whole and verified, else all
go to the disk together. The state's `state_layout` and this process's `buddy_link` live here,
where the restore needs them first; the snapshots' writer (msjax.training.memory_snapshots)
takes them from here."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msjax.checkpoint.buddies import BuddyLink, Refused, coordinator_address
from msjax.checkpoint.commits import committed_steps
from msjax.checkpoint.fingerprint import leaf_name
from msjax.checkpoint.piece_transport import PeerPieces, piece_answers
from msjax.checkpoint.snapshot_reshard import (
    NoPeers,
    PieceReader,
    assemble_shards,
    coverable,
    remove_other_layouts,
)
from msjax.checkpoint.snapshots import (
    SHARED_MEMORY,
    ShardFile,
    SnapshotDamaged,
    SnapshotStore,
    process_snapshot_store,
    run_snapshots_on_node,
    usable_in,
    usable_steps,
    verified_shards,
)
from msjax.config import Config
from msjax.observe.goodput import read_records
from msjax.parallel.agreement import (
    JOB_SECRET,
    ForgedValue,
    agree_any,
    agree_max,
    agree_min,
    job_secret,
    process_vote,
)
from msjax.run_dir import RunDir

BUDDY_FAILURES = (OSError, Refused, ForgedValue, ValueError, KeyError, TypeError)


_links: dict[str, BuddyLink] = {}  # run dir -> this process's link, made at its first use


def buddy_link(config: Config, run_dir: Path) -> tuple[BuddyLink | None, str]:
    """This process's link to its buddy, or None with why there is none ("" where none is asked
    for: no snapshots, checkpoint.memory_buddy=false, or one process). Every process of the job
    decides alike (the same config, process count and job secret), so either all publish their
    server's address or none does."""
    import jax
    from jax._src.distributed import global_state

    checkpoint = config.checkpoint
    if not checkpoint.memory_every_steps or not checkpoint.memory_buddy:
        return None, ""
    if jax.process_count() < 2:
        return None, ""
    secret = job_secret()
    if secret is None:
        return None, f"no job secret to seal them with ({JOB_SECRET}; msjax.launch gives one)"
    key = str(Path(run_dir).absolute())
    if key not in _links:
        run_snapshots = run_snapshots_on_node(Path(run_dir))
        _links[key] = BuddyLink(
            Path(run_dir),
            SHARED_MEMORY,
            secret,
            global_state.client,
            coordinator_address(),
            jax.process_index(),
            jax.process_count(),
            piece_answers(run_snapshots),  # the pieces of this node's snapshots, for a reshard
        )
    return _links[key], ""


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


@dataclass(frozen=True)
class MemoryRestored:
    """A state placed from this process's snapshot, with the record it was saved with."""

    state: Any
    step: int
    meta: dict[str, Any]
    path: Path
    snapshot_bytes: int  # read from shared memory (own) or received from the buddy
    seconds: float
    source: str = "own"  # own: this process's snapshot; buddy: the copy its buddy held;
    # resharded: put together from the snapshots of another layout, on this node and others
    from_processes: int = 0  # resharded: the process count of the layout that saved them
    remote_bytes: int = 0  # resharded: of snapshot_bytes, those received from other nodes


def buddy_steps(link: BuddyLink | None, layout: dict[str, Any]) -> tuple[dict[int, Any], str]:
    """The manifests of the usable copies this process's buddy holds for it, by step, and why
    there are none where it was asked ("" when it has some, or was not asked)."""
    if link is None:
        return {}, ""
    try:
        held = link.held_manifests()
    except BUDDY_FAILURES as error:
        return {}, f"its buddy's copies could not be listed ({error})"
    usable, reason = usable_in(held, layout)
    return {step: held[step] for step in usable}, reason and f"its buddy's copies: {reason}"


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


@dataclass
class Candidates:
    """Where this process could restore from: its own usable snapshots, and the usable copies
    its buddy holds for it (their manifests, by step)."""

    store: SnapshotStore | None
    own: list[int]
    held: dict[int, Any]
    link: BuddyLink | None
    reason: str  # why the newest is not usable, where it is not
    held_here: bool  # whether this process holds any whole snapshot, usable or not

    def newest(self) -> int:
        return max([*self.own, *self.held], default=-1)


def candidates(config: Config, abstract_state: Any) -> Candidates:
    """This process's snapshots and its buddy's copies of them, in the run's present layout."""
    import jax

    run_dir = Path(config.run.dir or ".")
    store = process_snapshot_store(run_dir, jax.process_index())
    layout = state_layout(abstract_state)
    link, _ = buddy_link(config, run_dir)
    held, held_reason = buddy_steps(link, layout)
    own, reason = usable_steps(store, layout)
    if not own and not held:
        reason = "; ".join(part for part in (reason, held_reason) if part)
    corruption = after_corruption(run_dir)
    if corruption:
        own, held, reason = [], {}, corruption
    held_here = bool(store and store.complete_steps()) or bool(held)
    return Candidates(store, own, held, link, reason, held_here)


def read_step(
    found: Candidates, step: int, abstract_state: Any
) -> tuple[Any, dict[str, Any], Path, str]:
    """(state, manifest, path, source) of `step` from the own snapshot, else the buddy's copy,
    each verified by its manifest's sha256; SnapshotDamaged naming why neither could be used."""
    problems = []
    if step in found.own:
        try:
            manifest, shards = found.store.read(step)
            state = place_shards(shards, abstract_state)
            return state, manifest, found.store.path(step), "own"
        except SnapshotDamaged as error:
            problems.append(str(error))
    if step in found.held and found.link is not None:
        try:
            buddy = found.link.buddy()
            where = f"{found.link.addresses()[buddy][0]}: process {buddy}'s copy of step {step}"
            files = found.link.fetch(step)
            manifest = found.held[step]
            missing = SnapshotDamaged(f"snapshot {where}: a file is missing")
            shards = verified_shards(
                manifest, lambda name: files.get(name) or _raise(missing), where
            )
            state = place_shards(shards, abstract_state)
            return state, manifest, Path(where), "buddy"
        except (SnapshotDamaged, *BUDDY_FAILURES) as error:
            problems.append(f"its buddy's copy: {error}")
    raise SnapshotDamaged(
        "; ".join(problems) or f"this process holds no whole snapshot of step {step}"
    )


def _raise(error: Exception) -> bytes:
    raise error


def restore_from_memory(
    config: Config, checkpoints: Path, abstract_state: Any
) -> tuple[MemoryRestored | None, str]:
    """The newest snapshot every process holds whole and verified (its own, else its buddy's
    copy), in the run's layout and newer than the newest committed checkpoint in `checkpoints`;
    else the newest every process can put together from the snapshots of another layout within
    its reach, on its node or others (`restore_resharded`); else None (the disk's turn, for
    every process alike), with why where snapshots were there ("" where none were)."""
    if not config.checkpoint.memory_every_steps:
        return None, ""
    started = time.perf_counter()
    vote = process_vote("memory-restore")
    found = candidates(config, abstract_state)
    step = agree_min(vote, found.newest())
    disk_step = agree_max(vote, [max(committed_steps(checkpoints), default=-1)])[0]
    held_anywhere = agree_any(vote, found.held_here)
    if step < 0 or step <= disk_step:
        if not held_anywhere:
            return None, ""
        if step >= 0:
            return (
                None,
                f"the newest whole one (step {step}) is not newer than checkpoint {disk_step}",
            )
        resharded, not_resharded = restore_resharded(config, abstract_state, disk_step, started)
        if resharded is not None:
            return resharded, ""
        reason = found.reason or "not every process holds a whole snapshot"
        return None, f"{reason}; resharding: {not_resharded}"
    problem, state = None, None
    try:
        state, manifest, path, source = read_step(found, step, abstract_state)
    except SnapshotDamaged as error:
        problem = str(error)
    if agree_any(vote, problem is not None):
        refused = problem or "a snapshot on another process failed its check"
        return None, f"the snapshot of step {step} is refused: {refused}"
    snapshot_bytes = sum(entry["bytes"] for entry in manifest["files"])
    seconds = time.perf_counter() - started
    restored = MemoryRestored(state, step, manifest["meta"], path, snapshot_bytes, seconds, source)
    return restored, ""


def restore_resharded(
    config: Config, abstract_state: Any, disk_step: int, started: float
) -> tuple[MemoryRestored | None, str]:
    """The newest step every process can put together whole from the snapshots within its reach
    (of whatever layout saved them: a job shrunk onto fewer processes reads those of the
    processes it no longer has; the pieces its node lacks come from the nodes that hold them,
    over the sealed transport of the snapshots' copies), newer than checkpoint `disk_step`;
    else None with why, every process alike. The snapshots of processes the job no longer has
    go once every process has restored, from memory or not."""
    import jax

    run_dir = Path(config.run.dir or ".")
    run_snapshots = run_snapshots_on_node(run_dir)
    link, _ = buddy_link(config, run_dir)
    peers = PeerPieces(link, run_snapshots) if link is not None else NoPeers()
    vote = process_vote("memory-reshard")
    corruption = after_corruption(run_dir)
    whole, reason = coverable(run_snapshots, abstract_state, corruption, peers)
    step = agree_min(vote, max(whole, default=-1))
    pieces = whole.get(step)
    problem, state = None, None
    reader = PieceReader(peers.read)  # the pieces on other nodes come through their servers
    if step < 0 or step <= disk_step:
        problem = reason if step < 0 else f"step {step} is not newer than checkpoint {disk_step}"
        problem = problem or "another process cannot put its shards together"
    elif pieces is None:  # this process could only for a newer step
        problem = f"this process cannot put its shards of step {step} together"
    else:
        try:
            shards, _ = assemble_shards(pieces, abstract_state, reader)
            state = place_shards(shards, abstract_state)
        except SnapshotDamaged as error:
            problem = str(error)
    refused = agree_any(vote, problem is not None)
    if run_snapshots is not None:  # every process has its state now: the old layout's go
        remove_other_layouts(run_snapshots, jax.process_count())
    if refused:
        return None, problem or "a process could not put its shards together"
    seconds = time.perf_counter() - started
    restored = MemoryRestored(
        state, step, pieces.meta, run_snapshots, reader.bytes_read, seconds, "resharded",
        pieces.process_count, reader.remote_bytes,
    )  # fmt: skip
    return restored, ""
