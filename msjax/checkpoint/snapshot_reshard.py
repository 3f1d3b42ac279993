"""In-memory snapshots restored onto another layout (a job shrunk onto fewer processes, another
mesh): the shard files of one step that the snapshots on this node hold (every process's own and
the copies kept for its peers) are pieces of the global arrays, each naming its slice; a new shard
is assembled from the pieces that overlap it, each verified by its sha256 before use (a damaged
one is replaced by another replica of its slice). Whether and when to do so, agreed by every
process, is the loop's (msjax.training.memory_restore)."""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class Piece:
    """One shard file of a snapshot: the file and its manifest entry."""

    path: Path
    entry: dict[str, Any]


@dataclass
class StepPieces:
    """Every piece of one step the snapshots on this node hold, by leaf and slice (each slice's
    replicas: several devices, or a process's own file and its buddy's copy), and the layout that
    saved them."""

    step: int
    process_count: int  # of the job that saved them
    mesh: dict[str, int]
    meta: dict[str, Any]
    owners: set[int] = field(default_factory=set)  # the processes whose snapshots are here
    by_leaf: dict[int, dict[Region, list[Piece]]] = field(default_factory=dict)

    def describe(self) -> str:
        owners = ", ".join(map(str, sorted(self.owners)))
        return f"process(es) {owners} of the {self.process_count}-process layout"


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


def pieces_by_step(run_snapshots: Path) -> dict[int, StepPieces | str]:
    """The pieces of each step whole on this node, or why a step's cannot be used (snapshots of
    two layouts, or of an msjax that did not record their slices)."""
    manifests: dict[int, list[tuple[Path, dict[str, Any]]]] = {}
    for store in snapshot_stores(run_snapshots):
        for step in store.complete_steps():
            try:
                manifests.setdefault(step, []).append((store.path(step), store.manifest(step)))
            except SnapshotDamaged:
                continue  # another replica may hold its pieces
    return {step: step_pieces(step, found) for step, found in manifests.items()}


def step_pieces(step: int, manifests: list[tuple[Path, dict[str, Any]]]) -> StepPieces | str:
    """The pieces the manifests of one step name, or why they cannot be put together."""
    layouts = {
        (m.get("layout", {}).get("process_count"), str(m.get("layout", {}).get("mesh")))
        for _, m in manifests
    }
    if len(layouts) > 1:
        return f"the snapshots of step {step} on this node were saved in {len(layouts)} layouts"
    layout = manifests[0][1].get("layout", {})
    try:
        pieces = StepPieces(
            step, int(layout.get("process_count", 0)), dict(layout.get("mesh", {})),
            dict(manifests[0][1]["meta"]),
        )  # fmt: skip
        for path, manifest in manifests:
            pieces.owners.add(int(manifest.get("layout", {}).get("process_index", -1)))
            for entry in manifest["files"]:
                if "region" not in entry or "global_shape" not in entry:
                    return f"the snapshots of step {step} do not record their shards' slices"
                leaf, region = int(entry["leaf"]), checked_region(entry)
                slices = pieces.by_leaf.setdefault(leaf, {})
                slices.setdefault(region, []).append(Piece(path / entry["name"], entry))
    except (KeyError, TypeError, ValueError) as error:
        return f"a manifest of step {step} does not check out ({error!r})"
    return pieces


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
                    f"snapshots on this node (it holds those of {pieces.describe()})"
                )
    return ""


class PieceReader:
    """Reads each slice's bytes once, from the first replica that matches its sha256."""

    def __init__(self):
        self.bytes_read = 0
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
                data = read_no_follow(piece.path)
            except OSError as error:
                problems.append(f"{piece.path} unreadable ({error.strerror})")
                continue
            self.bytes_read += len(data)
            if hashlib.sha256(data).hexdigest() != piece.entry["sha256"]:
                problems.append(f"{piece.path} does not match its sha256")
                continue
            try:
                dtype = jnp.dtype(piece.entry["dtype"])
                array = np.frombuffer(data, dtype=dtype).reshape(piece.entry["shape"])
            except (TypeError, ValueError) as error:
                problems.append(f"{piece.path} is not its manifest's array ({error})")
                continue
            self._arrays[key] = array
            return array
        raise SnapshotDamaged(
            f"no replica of leaf {leaf}'s slice checks out: {'; '.join(problems)}"
        )


def assemble_shards(pieces: StepPieces, abstract_state: Any) -> tuple[list[ShardFile], int]:
    """This process's shards of the state in its new shardings, each put together from the
    pieces that overlap it, and the bytes read; SnapshotDamaged where a slice has no good
    replica. `uncovered` must have found them whole."""
    import jax

    reader = PieceReader()
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
