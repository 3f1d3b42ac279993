"""In-memory snapshots restored onto another layout (a job shrunk onto fewer processes, another
mesh): the shard files of one step that the snapshots on this node hold (every process's own and
the copies kept for its peers), and those other nodes hold, are pieces of the global arrays, each
naming its slice; a new shard is assembled from the pieces that overlap it, each verified by its
sha256 before use (a damaged one is replaced by another replica of its slice). Which steps the
pieces within reach make is found here (`coverable`: this node's first, the other nodes' where
this node's fall short); how pieces on other nodes are listed and fetched is
msjax.checkpoint.piece_transport's; which step to restore, agreed by every process, is the
loop's (msjax.training.memory_restore)."""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from msjax.checkpoint.snapshots import (
    HELD_PREFIX,
    Region,
    ShardFile,
    SnapshotDamaged,
    SnapshotStore,
    is_snapshot_file,
)
from msjax.writable import read_no_follow

PROCESS_PREFIX = "process-"  # a process's own directory under the run's snapshot folder


def region_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    """A shard's index (slices, as jax gives them) as (start, stop) along each axis."""
    return tuple(tuple(part.indices(size)[:2]) for part, size in zip(index, shape, strict=True))


def overlap(first: Region, second: Region) -> Region | None:
    """The slice two slices share, None where they share nothing (a scalar's slices: ())."""
    shared = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(first, second, strict=True))
    return None if any(start >= stop for start, stop in shared) else shared


def volume(region: Region) -> int:
    """The elements a slice holds."""
    return math.prod(stop - start for start, stop in region)


def relative(inner: Region, outer: Region) -> tuple[slice, ...]:
    """inner's place inside outer, as numpy slices of outer's block."""
    return tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(inner, outer, strict=True))


Holder = tuple[str, int]  # the (host, port) of the server of the node that holds a piece


@dataclass(frozen=True)
class Piece:
    """One shard file of a snapshot: the file and its manifest entry. On this node (holder
    None) path is the file; on another node it is the file's place under that node's run
    snapshot folder, which the holder's server hands out."""

    path: Path
    entry: dict[str, Any]
    holder: Holder | None = None


@dataclass(frozen=True)
class SnapshotAt:
    """One whole snapshot within reach: its directory (on another node: its place under that
    node's run snapshot folder), its manifest, and the server holding it (None: this node)."""

    directory: Path
    manifest: dict[str, Any]
    holder: Holder | None = None


@dataclass
class StepPieces:
    """Every piece of one step within reach (the snapshots on this node, and those other nodes
    listed), by leaf and slice (each slice's replicas, this node's first: several devices, or a
    process's own file and its buddy's copy), and the layout that saved them."""

    step: int
    process_count: int  # of the job that saved them
    mesh: dict[str, int]
    meta: dict[str, Any]
    owners: set[int] = field(default_factory=set)  # the processes whose snapshots are here
    holders: set[Holder | None] = field(default_factory=set)  # the nodes holding them
    by_leaf: dict[int, dict[Region, list[Piece]]] = field(default_factory=dict)

    def describe(self) -> str:
        owners = ", ".join(map(str, sorted(self.owners)))
        nodes = len(self.holders | {None})  # this node's always looked at
        where = "this node" if nodes == 1 else f"{nodes} nodes"
        return f"process(es) {owners} of the {self.process_count}-process layout, on {where}"


def snapshot_stores(run_snapshots: Path) -> list[SnapshotStore]:
    """Every store under a run's snapshot folder: each process's own, then the copies it holds
    for its peers."""
    stores = []
    for process in sorted(listing(run_snapshots)):
        if not process.startswith(PROCESS_PREFIX):
            continue
        stores.append(SnapshotStore(run_snapshots / process))
        for held in sorted(listing(run_snapshots / process)):
            if held.startswith(HELD_PREFIX):
                stores.append(SnapshotStore(run_snapshots / process / held))
    return stores


def listing(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


def snapshots_on_node(run_snapshots: Path) -> dict[int, list[SnapshotAt]]:
    """The whole snapshots under a run's snapshot folder on this node, by step (every process's
    own, then the copies held for its peers); one whose manifest cannot be read is left out."""
    found: dict[int, list[SnapshotAt]] = {}
    for store in snapshot_stores(run_snapshots):
        for step in store.complete_steps():
            try:
                found.setdefault(step, []).append(
                    SnapshotAt(store.path(step), store.manifest(step))
                )
            except SnapshotDamaged:
                continue  # another replica may hold its pieces
    return found


def pieces_by_step(
    run_snapshots: Path | None, elsewhere: dict[int, list[SnapshotAt]] | None = None
) -> dict[int, StepPieces | str]:
    """The pieces of each step within reach (the snapshots on this node, then those `elsewhere`
    on other nodes), or why a step's cannot be used (snapshots of two layouts, or of an msjax
    that did not record their slices)."""
    found = snapshots_on_node(run_snapshots) if run_snapshots is not None else {}
    for step, snapshots in (elsewhere or {}).items():
        found[step] = [*found.get(step, []), *snapshots]
    return {step: step_pieces(step, snapshots) for step, snapshots in found.items()}


def step_pieces(step: int, snapshots: list[SnapshotAt]) -> StepPieces | str:
    """The pieces the manifests of one step name, or why they cannot be put together."""
    layouts = {
        (saved_layout(s).get("process_count"), str(saved_layout(s).get("mesh"))) for s in snapshots
    }
    if len(layouts) > 1:
        return f"the snapshots of step {step} within reach were saved in {len(layouts)} layouts"
    layout = saved_layout(snapshots[0])
    try:
        pieces = StepPieces(
            step, int(layout.get("process_count", 0)), dict(layout.get("mesh", {})),
            dict(snapshots[0].manifest["meta"]),
        )  # fmt: skip
        for snapshot in snapshots:
            pieces.owners.add(int(saved_layout(snapshot).get("process_index", -1)))
            pieces.holders.add(snapshot.holder)
            for entry in snapshot.manifest["files"]:
                if "region" not in entry or "global_shape" not in entry:
                    return f"the snapshots of step {step} do not record their shards' slices"
                leaf, region = int(entry["leaf"]), checked_region(entry)
                piece = Piece(snapshot.directory / entry["name"], entry, snapshot.holder)
                pieces.by_leaf.setdefault(leaf, {}).setdefault(region, []).append(piece)
    except (KeyError, TypeError, ValueError) as error:
        return f"a manifest of step {step} does not check out ({error!r})"
    return pieces


def saved_layout(snapshot: SnapshotAt) -> dict[str, Any]:
    """The layout a snapshot's manifest records ({} where it records none)."""
    layout = snapshot.manifest.get("layout", {})
    return layout if isinstance(layout, dict) else {}


def checked_region(entry: dict[str, Any]) -> Region:
    """A manifest entry's slice, once its file name is a snapshot's and the slice fits its own
    shape and its array's; ValueError where not."""
    region = tuple((int(start), int(stop)) for start, stop in entry["region"])
    spans = [stop - start for start, stop in region]
    inside = all(
        0 <= start <= stop <= size
        for (start, stop), size in zip(region, entry["global_shape"], strict=True)
    )
    if not is_snapshot_file(entry["name"]) or spans != list(entry["shape"]) or not inside:
        raise ValueError(f"{entry['name']}: slice {entry['region']} of {entry['global_shape']}")
    return region


def uncovered(pieces: StepPieces, abstract_state: Any, mesh: dict[str, int]) -> str:
    """Why the pieces do not make every shard this process holds of the state (its leaves with
    the new shardings) on `mesh`; "" where they do."""
    import jax

    if pieces.mesh.get("pipe", 1) != mesh.get("pipe", 1):
        return (
            f"the pipeline changed ({pieces.mesh} -> now {mesh}): its layers are in another order"
        )
    leaves = jax.tree.leaves(abstract_state)
    if max(pieces.by_leaf, default=-1) >= len(leaves):
        return f"the snapshots of step {pieces.step} hold more arrays than the state"
    for number, leaf in enumerate(leaves):
        slices = pieces.by_leaf.get(number, {})
        entries = [replicas[0].entry for replicas in slices.values()]
        if any(
            e["global_shape"] != list(leaf.shape) or e["dtype"] != str(leaf.dtype) for e in entries
        ):
            return f"leaf {number} was saved with another shape or dtype"
        for index in leaf.sharding.addressable_devices_indices_map(leaf.shape).values():
            needed = region_of(index, leaf.shape)
            # the slices of one layout are equal or apart, so their overlaps add up
            shared = [overlap(needed, region) for region in slices]
            if sum(volume(part) for part in shared if part is not None) != volume(needed):
                return (
                    f"leaf {number}'s slice {[list(s) for s in needed]} is not whole in the "
                    f"snapshots within reach (those of {pieces.describe()})"
                )
    return ""


class Peers(Protocol):
    """The other nodes' pieces within this process's reach: a `PeerPieces`
    (msjax.checkpoint.piece_transport), or `NoPeers`."""

    def snapshots(self) -> tuple[dict[int, list[SnapshotAt]], list[str]]:
        """The whole snapshots the other nodes hold, by step, and why a node's are not listed."""
        ...

    def read(self, piece: Piece) -> bytes:
        """The bytes of a piece another node holds; OSError where it cannot be read."""
        ...


def mesh_shape(abstract_state: Any) -> dict[str, int]:
    """The mesh the state's leaves are sharded over, by axis ({} where none is named)."""
    import jax

    leaves = jax.tree.leaves(abstract_state)
    mesh = getattr(leaves[0].sharding, "mesh", None) if leaves else None
    return dict(mesh.shape) if mesh is not None else {}


def coverable(
    run_snapshots: Path | None,
    abstract_state: Any,
    corruption: str,
    peers: Peers | None = None,
) -> tuple[dict[int, StepPieces], str]:
    """The steps whose pieces within reach make every shard this process holds in the run's
    layout, and why the newest step does not where it does not. The pieces on this node come
    first; where they do not make the newest step they hold (or there are none), those the
    other nodes hold are listed too, through `peers` (None: none within reach)."""
    if run_snapshots is None:
        return {}, "no writable /dev/shm on this node"
    if corruption:
        return {}, corruption
    local = pieces_by_step(run_snapshots)
    whole, reason = covered_steps(local, abstract_state)
    if peers is None or (local and max(local) in whole):
        return whole, reason
    elsewhere, unanswered = peers.snapshots()
    whole, reason = covered_steps(pieces_by_step(run_snapshots, elsewhere), abstract_state)
    if reason and unanswered:
        reason += f" (not listed: {'; '.join(unanswered)})"
    return whole, reason


def covered_steps(
    by_step: dict[int, StepPieces | str], abstract_state: Any
) -> tuple[dict[int, StepPieces], str]:
    """The steps whose pieces make every shard this process holds, and why the newest does not
    where it does not."""
    mesh = mesh_shape(abstract_state)
    whole, reason = {}, "no snapshots within reach"
    for step in sorted(by_step):
        pieces = by_step[step]
        reason = pieces if isinstance(pieces, str) else uncovered(pieces, abstract_state, mesh)
        if not reason:
            whole[step] = pieces
    return whole, reason


class NoPeers:
    """The other nodes' pieces where this process cannot reach them (no servers for the snapshots'
    copies: checkpoint.memory_buddy off, or no job secret): none listed, none read."""

    def snapshots(self) -> tuple[dict[int, list[SnapshotAt]], list[str]]:
        """The whole snapshots the other nodes hold, by step, and why a node's are not listed."""
        return {}, []

    def read(self, piece: Piece) -> bytes:
        """A piece another node holds: OSError, since none can be reached."""
        host, port = piece.holder or ("?", 0)
        raise OSError(f"held on another node ({host}:{port})")


class PieceReader:
    """Reads each slice's bytes once, from the first replica that matches its sha256: a piece on
    this node from its file, one on another node through `fetch` (its bytes as its holder sent
    them; OSError naming why where they cannot be had)."""

    def __init__(self, fetch: Callable[[Piece], bytes] | None = None):
        self.fetch = fetch if fetch is not None else NoPeers().read
        self.bytes_read = 0  # wherever from
        self.remote_bytes = 0  # of them, received from other nodes
        self._arrays: dict[tuple[int, Region], np.ndarray] = {}

    def array(self, leaf: int, region: Region, replicas: list[Piece]) -> np.ndarray:
        """The slice's block; SnapshotDamaged naming every replica's fault where none checks out."""
        import jax.numpy as jnp  # the dtype names of bfloat16 and friends

        key = (leaf, region)
        if key in self._arrays:
            return self._arrays[key]
        problems = []
        for piece in replicas:
            try:
                data = self.piece_bytes(piece)
            except OSError as error:
                problems.append(f"{where(piece)} unreadable ({error.strerror or error})")
                continue
            if hashlib.sha256(data).hexdigest() != piece.entry["sha256"]:
                problems.append(f"{where(piece)} does not match its sha256")
                continue
            try:
                dtype = jnp.dtype(piece.entry["dtype"])
                array = np.frombuffer(data, dtype=dtype).reshape(piece.entry["shape"])
            except (TypeError, ValueError) as error:
                problems.append(f"{where(piece)} is not its manifest's array ({error})")
                continue
            self._arrays[key] = array
            return array
        raise SnapshotDamaged(
            f"no replica of leaf {leaf}'s slice checks out: {'; '.join(problems)}"
        )

    def piece_bytes(self, piece: Piece) -> bytes:
        """A piece's bytes as they are (unchecked), counted."""
        if piece.holder is None:
            data = read_no_follow(piece.path)
        else:
            data = self.fetch(piece)
            self.remote_bytes += len(data)
        self.bytes_read += len(data)
        return data


def where(piece: Piece) -> str:
    """A piece's file, and the node holding it where that is not this one."""
    if piece.holder is None:
        return str(piece.path)
    return f"{piece.holder[0]}:{piece.holder[1]}: {piece.path}"


def assemble_shards(
    pieces: StepPieces, abstract_state: Any, reader: PieceReader | None = None
) -> tuple[list[ShardFile], int]:
    """This process's shards of the state in its new shardings, each put together from the
    pieces that overlap it (read by `reader`: by default only this node's), and the bytes read;
    SnapshotDamaged where a slice has no good replica. `uncovered` must have found them whole."""
    import jax

    reader = reader if reader is not None else PieceReader()
    shards = []
    for number, leaf in enumerate(jax.tree.leaves(abstract_state)):
        slices = pieces.by_leaf[number]
        for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
            needed = region_of(index, leaf.shape)
            block = np.empty([stop - start for start, stop in needed], dtype=leaf.dtype)
            for region, replicas in slices.items():
                shared = overlap(needed, region)
                if shared is not None:
                    source = reader.array(number, region, replicas)
                    block[relative(shared, needed)] = source[relative(shared, region)]
            shards.append(ShardFile(number, device.id, block, needed, tuple(leaf.shape)))
    return shards, reader.bytes_read


def remove_other_layouts(run_snapshots: Path, process_count: int) -> None:
    """Delete the snapshots of processes a job of `process_count` no longer has (their own
    directories, and the copies kept for them): once the job has restored, they are its past."""
    import shutil

    for process in listing(run_snapshots):
        number = process.removeprefix(PROCESS_PREFIX)
        if process.startswith(PROCESS_PREFIX) and number.isdigit():
            if int(number) >= process_count:
                shutil.rmtree(run_snapshots / process, ignore_errors=True)
                continue
            for held in listing(run_snapshots / process):
                owner = held.removeprefix(HELD_PREFIX)
                if held.startswith(HELD_PREFIX) and owner.isdigit() and int(owner) >= process_count:
                    shutil.rmtree(run_snapshots / process / held, ignore_errors=True)
