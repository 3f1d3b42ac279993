"""Snapshot pieces held on other nodes, for a restore onto another layout: each worker's
BuddyServer (msjax.checkpoint.buddies) also answers `pieces` (the whole snapshots under the run's
snapshot folder on its node, with their manifests) and `piece` (one shard file of them), over
the same sealed transport; a process lists its peers' nodes and fetches the pieces its own node
lacks. Each piece is checked against its manifest's sha256 by the reader before use
(msjax.checkpoint.snapshot_reshard); when to do all this is msjax.training.memory_restore's.
"""

from __future__ import annotations

import hashlib
import re
import socket
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from msjax.checkpoint.buddies import Answer, BuddyLink, Files, Refused, request
from msjax.checkpoint.snapshot_reshard import (
    PROCESS_PREFIX,
    Holder,
    Piece,
    SnapshotAt,
    snapshots_on_node,
)
from msjax.checkpoint.snapshots import HELD_PREFIX, SNAPSHOT_PREFIX
from msjax.writable import read_no_follow

PIECES = "pieces"  # the request for the whole snapshots a server's node holds
PIECE = "piece"  # the request for one shard file of them
LIST_TIMEOUT_S = 30.0  # each socket operation of one peer's listing
LIST_WAIT_S = 60.0  # every peer's listing together: one that has not answered by then is skipped
PIECE_TIMEOUT_S = 120.0  # each socket operation of one piece's fetch
LISTING_THREADS = 16  # peers asked at once
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_STORE = rf"{PROCESS_PREFIX}\d+(/{HELD_PREFIX}\d+)?"
SNAPSHOT_PLACE = re.compile(rf"{_STORE}/{SNAPSHOT_PREFIX}\d+")  # a snapshot in the run's folder
PIECE_PLACE = re.compile(rf"{_STORE}/{SNAPSHOT_PREFIX}\d+/\d+\.bin")  # one of its shard files


def node_identity(run_snapshots: Path | None) -> str:
    """A name for the run's snapshot folder on this node (its host's name and boot, its path),
    the same from every process that shares it: a process lists each node once, its own never."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        boot = ""
    named = f"{socket.gethostname()}\n{boot}\n{run_snapshots}"
    return hashlib.sha256(named.encode()).hexdigest()[:16]


def piece_answers(run_snapshots: Path | None) -> dict[str, Answer]:
    """A server's answers to the piece requests, from the run's snapshot folder on its node
    (None: no writable /dev/shm there, so it lists none)."""
    return {
        PIECES: lambda header: list_pieces(run_snapshots),
        PIECE: lambda header: piece_file(run_snapshots, header),
    }


def list_pieces(run_snapshots: Path | None) -> tuple[dict[str, Any], Files]:
    """The whole snapshots on this node, each as [its place in the run's folder, step,
    manifest], and the node's identity."""
    found = snapshots_on_node(run_snapshots) if run_snapshots is not None else {}
    listed = [
        [snapshot.directory.relative_to(run_snapshots).as_posix(), step, snapshot.manifest]
        for step, snapshots in sorted(found.items())
        for snapshot in snapshots
    ]
    return {"node": node_identity(run_snapshots), "snapshots": listed}, []


def piece_file(run_snapshots: Path | None, header: dict[str, Any]) -> tuple[dict[str, Any], Files]:
    """One shard file, named by its place in the run's snapshot folder (a snapshot's shard file,
    nothing else: ValueError), as it is; its reader checks it against its manifest."""
    place = str(header["path"])
    if run_snapshots is None or not PIECE_PLACE.fullmatch(place):
        raise ValueError(f"not a snapshot piece on this node: {place[:200]!r}")
    return {}, [(place, read_no_follow(run_snapshots / place))]


def remote_snapshots(
    link: BuddyLink, run_snapshots: Path | None
) -> tuple[dict[int, list[SnapshotAt]], list[str]]:
    """The whole snapshots the other nodes hold, by step, as their servers list them (each node
    once, from the first of its processes that answers; this node never), and why a peer's list
    is missing (no answer in time, a refused or broken one)."""
    addresses = link.addresses()
    peers = [rank for rank in range(len(addresses)) if rank != link.rank]
    replies, problems = listings(addresses, link.secret, peers)
    nodes_seen = {node_identity(run_snapshots)}
    found: dict[int, list[SnapshotAt]] = {}
    for rank, reply in sorted(replies.items()):
        try:
            node, listed = str(reply["node"]), checked_listing(reply, addresses[rank])
        except (KeyError, TypeError, ValueError) as error:
            problems.append(f"process {rank}'s list of snapshots does not check out ({error!r})")
            continue
        if node in nodes_seen:
            continue
        nodes_seen.add(node)
        for step, snapshot in listed:
            found.setdefault(step, []).append(snapshot)
    return found, problems


def checked_listing(reply: dict[str, Any], holder: Holder) -> list[tuple[int, SnapshotAt]]:
    """A server's list as (step, snapshot) pairs; ValueError for a place that is not a
    snapshot's in a run's folder."""
    listed = []
    for place, step, manifest in reply["snapshots"]:
        if not SNAPSHOT_PLACE.fullmatch(place) or not isinstance(manifest, dict):
            raise ValueError(f"not a snapshot: {str(place)[:200]!r}")
        listed.append((int(step), SnapshotAt(Path(place), manifest, holder)))
    return listed


def listings(
    addresses: list[Holder], secret: bytes, peers: list[int]
) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Each of `peers`' answer to `pieces` (at `addresses`, sealed with `secret`), asked at once
    and waited for LIST_WAIT_S at most, and one line for each peer without an answer."""
    pool = ThreadPoolExecutor(max(min(LISTING_THREADS, len(peers)), 1), "msjax-pieces")
    header = {"kind": PIECES}
    futures = {
        rank: pool.submit(request, addresses[rank], secret, header, (), LIST_TIMEOUT_S)
        for rank in peers
    }
    wait(futures.values(), timeout=LIST_WAIT_S)
    pool.shutdown(wait=False, cancel_futures=True)  # a silent peer's socket times out alone
    replies, problems = {}, []
    for rank, future in futures.items():
        host, port = addresses[rank]
        if not future.done():
            problems.append(f"process {rank} ({host}:{port}) did not answer in {LIST_WAIT_S:g} s")
            continue
        try:
            replies[rank] = future.result()[0]
        except (OSError, Refused) as error:
            problems.append(f"process {rank} ({host}:{port}) did not list its node's: {error}")
    return replies, problems


class PieceFetcher:
    """Fetches pieces from the servers holding them (`link`'s secret seals each request); a
    holder that could not be reached once is not tried again (OSError at once, with why)."""

    def __init__(self, link: BuddyLink):
        self.secret = link.secret
        self.unreachable: dict[Holder, str] = {}  # holder -> why

    def __call__(self, piece: Piece) -> bytes:
        """The piece's bytes as its holder sent them (unchecked: its reader checks its sha256);
        OSError naming why where they could not be had."""
        holder, place = piece.holder, piece.path.as_posix()
        if holder in self.unreachable:
            raise OSError(f"its holder did not answer before ({self.unreachable[holder]})")
        try:
            _, files = request(
                holder, self.secret, {"kind": PIECE, "path": place}, (), PIECE_TIMEOUT_S
            )
        except Refused as error:
            raise OSError(f"its holder's answer was refused ({error})") from None
        except (TimeoutError, ConnectionError) as error:
            self.unreachable[holder] = str(error) or type(error).__name__
            raise
        if [name for name, _ in files] != [place]:
            raise OSError(f"its holder answered with other files ({[n for n, _ in files][:4]})")
        return files[0][1]


class PeerPieces:
    """The pieces of the snapshots the other nodes hold, through the servers of `link`'s peers:
    listed (`snapshots`) and fetched one by one (`read`)."""

    def __init__(self, link: BuddyLink, run_snapshots: Path | None):
        self.link, self.run_snapshots = link, run_snapshots
        self.read = PieceFetcher(link)  # a piece's bytes as its holder sent them (unchecked)

    def snapshots(self) -> tuple[dict[int, list[SnapshotAt]], list[str]]:
        """The whole snapshots the other nodes hold, by step, and why a peer's list is missing."""
        return remote_snapshots(self.link, self.run_snapshots)
