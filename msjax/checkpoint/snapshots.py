"""In-memory snapshots of the train state: each process's own shards as files on the node's
shared-memory filesystem, so they outlive a killed worker; written, listed and verified here.

A snapshot is a directory `step-STEP` of raw shard files and a `manifest.json` naming each file
with its sha256, written under a temporary name and renamed once whole (a peer could later copy
such a directory as it is). Which of them were saved in the layout a run has now is
told here too (`usable_steps`, `usable_in`: a manifest records its layout). When and from which
thread they are written is the loop's (msjax.training.memory_snapshots), and so is restoring them
(msjax.training.memory_restore).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from msjax.writable import open_no_follow, read_no_follow, write_text_atomically

SHARED_MEMORY = Path("/dev/shm")  # the node's memory, as files that outlive a process
MANIFEST = "manifest.json"  # written last inside a snapshot: its files with their sha256
SNAPSHOT_PREFIX = "step-"
UNFINISHED_PREFIX = ".unfinished-"  # a snapshot being written (or left by a killed worker)
HELD_PREFIX = "held-for-process-"  # a peer's snapshots, kept for it (checkpoint.memory_buddy)
MAX_SNAPSHOTS = 2  # per process: the two newest whole ones, or the newest and one being written


class SnapshotDamaged(Exception):
    """A snapshot whose manifest or files do not check out (one line: which and why)."""


Region = tuple[tuple[int, int], ...]  # a slice of an array: (start, stop) along each axis


@dataclass(frozen=True)
class ShardFile:
    """One shard of one array, as this process holds it: the array's index in the state's leaves,
    the device that holds it, its bytes on the host, and which slice of which global shape it is
    (what a restore onto another layout assembles new shards from; None where not known)."""

    leaf: int
    device_id: int
    data: np.ndarray
    region: Region | None = None
    global_shape: tuple[int, ...] | None = None


def shared_memory_root() -> Path | None:
    """/dev/shm where it exists and this user can write there, else None."""
    root = SHARED_MEMORY
    if root.is_dir() and os.access(root, os.W_OK | os.X_OK):
        return root
    return None


def run_snapshots_dir(run_dir: Path, root: Path) -> Path:
    """The run's snapshot directory under root: the user's id and the run dir's identity (its
    name and a hash of its absolute path) in its name, so two runs never mix."""
    absolute = str(Path(run_dir).absolute())
    identity = hashlib.sha256(absolute.encode()).hexdigest()[:16]
    return root / f"msjax-snapshots-{os.getuid()}" / f"{Path(absolute).name}-{identity}"


def run_snapshots_on_node(run_dir: Path) -> Path | None:
    """The run's snapshot directory in this node's shared memory; None where it has none."""
    root = shared_memory_root()
    return run_snapshots_dir(run_dir, root) if root is not None else None


def process_snapshots_dir(run_dir: Path, root: Path, process_index: int) -> Path:
    """Where one process of the run keeps its snapshots."""
    return run_snapshots_dir(run_dir, root) / f"process-{process_index}"


def held_snapshots_dir(run_dir: Path, root: Path, holder: int, owner: int) -> Path:
    """Where process `holder` keeps the copies of process `owner`'s snapshots it holds (inside
    its own directory: a node that loses its memory loses both)."""
    return process_snapshots_dir(run_dir, root, holder) / f"{HELD_PREFIX}{owner}"


def remove_run_snapshots(run_dir: Path, root: Path | None = None) -> bool:
    """Delete the run's snapshots (every process's); whether there were any."""
    root = root if root is not None else shared_memory_root()
    if root is None:
        return False
    directory = run_snapshots_dir(run_dir, root)
    if not directory.is_dir() or directory.is_symlink():
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return True


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of the RAM this host can give without swapping (MemAvailable), or
    None where it does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                return int(value.split()[0]) * 1024  # the kernel counts kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_memory_available_bytes(directory: Path) -> int:
    """What a process's snapshots in `directory` can take on this host: the free space of the
    directory's filesystem (/dev/shm is RAM, sized apart), and no more than MemAvailable."""
    info = os.statvfs(directory)
    free = info.f_bavail * info.f_frsize
    available = mem_available_bytes()
    return free if available is None else min(free, available)


def memory_shortfall(
    store: SnapshotStore, snapshot_bytes: int, max_fraction: float, held_bytes: int = 0
) -> str:
    """Why this host cannot hold a process's snapshots of `snapshot_bytes` each, two deep
    (double-buffered), and the copies of `held_bytes` it keeps for its peers (two deep too),
    within max_fraction of the RAM it can give; "" when it can."""
    needed = 2 * (snapshot_bytes + held_bytes)
    available = host_memory_available_bytes(store.directory)
    if needed <= max_fraction * available:
        return ""
    held = f" and the {held_bytes} bytes of the copies it holds for a peer" if held_bytes else ""
    return (
        f"they need {needed} bytes of RAM on this host (this process's shards{held}, twice) "
        f"and checkpoint.memory_max_fraction={max_fraction:g} of the {available} bytes "
        f"available allows {int(max_fraction * available)}; raise "
        "checkpoint.memory_max_fraction or set checkpoint.memory_every_steps=0"
    )


def make_private_dir(path: Path) -> None:
    """path and its missing parents made (0700); OSError when path or its parent is a link, not
    a directory, or not this user's (a planted directory is never written into)."""
    for directory in reversed([path, *path.parents]):
        if directory.exists() and not directory.is_symlink():
            continue
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
    for directory in (path, path.parent):
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise OSError(f"{directory} is not a directory of this user")
        if info.st_mode & 0o077:
            os.chmod(directory, 0o700)


def process_snapshot_store(run_dir: Path, process_index: int) -> SnapshotStore | None:
    """This process's snapshot store of the run, or None where /dev/shm cannot be written."""
    root = shared_memory_root()
    if root is None:
        return None
    return SnapshotStore(process_snapshots_dir(run_dir, root, process_index))


def writable_snapshot_store(run_dir: Path, process_index: int) -> SnapshotStore | None:
    """process_snapshot_store made ready to write into: its directory made private (OSError
    where it is planted) and the snapshots a killed writer left half written removed."""
    store = process_snapshot_store(run_dir, process_index)
    if store is not None:
        make_private_dir(store.directory)
        store.remove_unfinished()
    return store


class SnapshotStore:
    """One process's snapshots of one run: `step-STEP` directories, at most MAX_SNAPSHOTS."""

    def __init__(self, directory: Path):
        self.directory = directory

    def complete_steps(self) -> list[int]:
        """Steps of the whole snapshots here (their manifest written), oldest first."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        steps = []
        for name in names:
            number = name.removeprefix(SNAPSHOT_PREFIX)
            whole = (self.directory / name / MANIFEST).is_file()
            if name.startswith(SNAPSHOT_PREFIX) and number.isdigit() and whole:
                steps.append(int(number))
        return sorted(steps)

    def path(self, step: int) -> Path:
        return self.directory / f"{SNAPSHOT_PREFIX}{step}"

    def remove_unfinished(self) -> None:
        """Delete snapshots a killed writer left half written."""
        with contextlib.suppress(OSError):
            for name in os.listdir(self.directory):
                if name.startswith(UNFINISHED_PREFIX):
                    shutil.rmtree(self.directory / name, ignore_errors=True)

    def write(self, step: int, shards: list[ShardFile], record: dict[str, Any]) -> int:
        """Write a snapshot of `step` (see `_replace_with`). Returns the bytes of its shards."""
        files = []
        entries = []
        for number, shard in enumerate(shards):
            name = f"{number}.bin"
            data = np.ascontiguousarray(shard.data).tobytes()
            files.append((name, data))
            entries.append(
                {
                    "name": name,
                    "leaf": shard.leaf,
                    "device_id": shard.device_id,
                    "dtype": str(shard.data.dtype),
                    "shape": list(shard.data.shape),
                    "bytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                    **global_place(shard),
                }
            )
        manifest = {**record, "step": step, "files": entries}
        self._replace_with(step, [*files, (MANIFEST, json.dumps(manifest).encode())])
        return sum(entry["bytes"] for entry in entries)

    def write_files(self, step: int, files: list[tuple[str, bytes]]) -> None:
        """Keep a snapshot of `step` as another process sent it: its shard files and manifest,
        written as they came (their sha256 is checked when the copy is used). ValueError for a
        file name a snapshot never has (a path, say)."""
        names = [name for name, _ in files]
        if MANIFEST not in names or not all(is_snapshot_file(name) for name in names):
            raise ValueError(f"not the files of a snapshot: {names[:8]}")
        self._replace_with(step, files)

    def _replace_with(self, step: int, files: list[tuple[str, bytes]]) -> None:
        """Write files as the snapshot of `step` under a temporary name (the manifest last),
        then rename it whole: it becomes the newest, and the one before stays as the second (a
        peer killed while writing its copy of `step` still holds that one). Older ones go
        before the write starts, so at most MAX_SNAPSHOTS exist at any moment."""
        make_private_dir(self.directory)
        steps = self.complete_steps()
        # steps past this one belong to a timeline the run left (a replay from an older
        # checkpoint); of the older ones the newest stays while this one is written
        before = [older for older in steps if older < step]
        for gone in [older for older in steps if older >= step] + before[: 1 - MAX_SNAPSHOTS]:
            shutil.rmtree(self.path(gone), ignore_errors=True)
        unfinished = self.directory / f"{UNFINISHED_PREFIX}{step}-{secrets.token_hex(4)}"
        unfinished.mkdir(mode=0o700)
        for name, data in sorted(files, key=lambda file: file[0] == MANIFEST):
            if name == MANIFEST:
                write_text_atomically(unfinished / MANIFEST, data.decode(), durable=False)
                continue
            with open_no_follow(unfinished / name, "wb") as file:
                file.write(data)
        os.rename(unfinished, self.path(step))  # now the newest; the one before stays

    def files(self, step: int) -> list[tuple[str, bytes]]:
        """A whole snapshot's files as they are (its manifest and the shards it names), to send
        to another process; SnapshotDamaged when one cannot be read."""
        try:
            manifest = read_no_follow(self.path(step) / MANIFEST)
            names = [entry["name"] for entry in json.loads(manifest)["files"]]
            return [
                (MANIFEST, manifest),
                *((name, read_no_follow(self.path(step) / name)) for name in names),
            ]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise SnapshotDamaged(f"snapshot {self.path(step)} unreadable ({error})") from None

    def manifest(self, step: int) -> dict[str, Any]:
        """The manifest of a whole snapshot; SnapshotDamaged when it cannot be read."""
        path = self.path(step) / MANIFEST
        try:
            return json.loads(read_no_follow(path))
        except (OSError, ValueError) as error:
            raise SnapshotDamaged(
                f"snapshot {self.path(step)}: manifest unreadable ({error})"
            ) from None

    def read(self, step: int) -> tuple[dict[str, Any], list[ShardFile]]:
        """The manifest and every shard of a snapshot, each checked against its sha256;
        SnapshotDamaged naming the first file that does not match."""
        manifest = self.manifest(step)

        def file_data(name: str) -> bytes:
            try:
                return read_no_follow(self.path(step) / name)
            except OSError as error:
                raise SnapshotDamaged(
                    f"snapshot file {self.path(step) / name} unreadable ({error.strerror})"
                ) from None

        return manifest, verified_shards(manifest, file_data, str(self.path(step)))


def usable_steps(store: SnapshotStore | None, layout: dict[str, Any]) -> tuple[list[int], str]:
    """The whole snapshots whose layout is the run's now, oldest first, and why the newest whole
    one is not usable ("" when it is, or there is none)."""
    if store is None:
        return [], "no writable /dev/shm on this node"
    manifests: dict[int, dict[str, Any] | SnapshotDamaged] = {}
    for step in store.complete_steps():
        try:
            manifests[step] = store.manifest(step)
        except SnapshotDamaged as error:
            manifests[step] = error
    return usable_in(manifests, layout)


def usable_in(
    manifests: dict[int, dict[str, Any] | SnapshotDamaged], layout: dict[str, Any]
) -> tuple[list[int], str]:
    """The steps of `manifests` (a damaged one as its error) saved in `layout`, oldest first,
    and why the newest is not usable ("" when it is, or there is none)."""
    usable, reason = [], ""
    for step, manifest in sorted(manifests.items()):
        if isinstance(manifest, SnapshotDamaged):
            reason = str(manifest)
            continue
        saved = manifest.get("layout", {})
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


def global_place(shard: ShardFile) -> dict[str, Any]:
    """A shard's manifest fields saying which slice of the array it holds ({} where unknown)."""
    if shard.region is None or shard.global_shape is None:
        return {}
    return {
        "region": [list(span) for span in shard.region],
        "global_shape": list(shard.global_shape),
    }


def is_snapshot_file(name: str) -> bool:
    """Whether name is one a snapshot's files have: its manifest or a numbered shard."""
    number = name.removesuffix(".bin")
    return name == MANIFEST or (name.endswith(".bin") and number.isdigit())


def verified_shards(
    manifest: dict[str, Any], file_data: Callable[[str], bytes], where: str
) -> list[ShardFile]:
    """Every shard the manifest names, its bytes from file_data(name) checked against its
    sha256; SnapshotDamaged naming (in `where`) the first file that does not match."""
    import jax.numpy as jnp  # the dtype names of bfloat16 and friends

    shards = []
    try:
        entries = list(manifest["files"])
    except (KeyError, TypeError):
        raise SnapshotDamaged(f"snapshot {where}: its manifest names no files") from None
    for entry in entries:
        data = file_data(entry["name"])
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise SnapshotDamaged(
                f"snapshot file {where}/{entry['name']} does not match its sha256"
            )
        array = np.frombuffer(data, dtype=jnp.dtype(entry["dtype"])).reshape(entry["shape"])
        shards.append(ShardFile(entry["leaf"], entry["device_id"], array))
    return shards
