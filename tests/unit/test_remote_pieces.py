"""In-memory snapshots resharded from pieces held on other nodes: each "node" is a snapshot root
of its own (a temporary directory) whose run folder the real SnapshotStore wrote, each process of
the new job a BuddyLink on 127.0.0.1 with its own client of a real coordination service, serving
its node's pieces under real seals. A shard whose pieces are split across nodes is put together
bitwise; a flipped byte in a remote piece is refused for another holder's copy, else the step is
refused; a holder that does not answer is skipped with why; a request without the job's seal, or
for a file that is not a piece, gets nothing."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest
from test_memory_snapshot_votes import free_port, on_threads
from test_snapshot_reshard import (
    OLD_PROCESSES,
    STEP,
    abstract,
    flip_a_byte,
    new_layouts,
    old_mesh,
    train_like_state,
)

from msjax.checkpoint.buddies import BuddyLink, Refused, request
from msjax.checkpoint.piece_transport import (
    PIECE,
    PIECES,
    PeerPieces,
    piece_answers,
    remote_snapshots,
)
from msjax.checkpoint.snapshot_reshard import (
    PieceReader,
    assemble_shards,
    coverable,
    pieces_by_step,
)
from msjax.checkpoint.snapshots import (
    MANIFEST,
    SnapshotDamaged,
    SnapshotStore,
    held_snapshots_dir,
    run_snapshots_dir,
)
from msjax.training.checkpoints import restore_record
from msjax.training.memory_restore import MemoryRestored, place_shards, state_layout
from msjax.training.memory_snapshots import copy_shards, host_shards

SECRET = b"the job's secret"
TARGET = "fsdp2 x tensor2 on 4 devices"  # the new job's process 0 holds every slice of it
STATE_BYTES = 16 * 8 * 4 + 16 * 2 + 4  # the matrix, the bfloat16 vector, the step: each once


@contextlib.contextmanager
def job_of(run_dir: Path, roots: list[Path]) -> Iterator[list[BuddyLink]]:
    """The links of a job of len(roots) processes, process r on the node whose snapshot root is
    roots[r], each serving its node's pieces, over a real coordination service on 127.0.0.1."""
    from jax._src.lib import _jax

    address = f"127.0.0.1:{free_port()}"
    service = _jax.get_distributed_runtime_service(address, len(roots))
    clients = [
        _jax.get_distributed_runtime_client(address, rank, init_timeout=60)
        for rank in range(len(roots))
    ]
    on_threads(*(client.connect for client in clients))
    links = []
    try:
        for rank, root in enumerate(roots):
            answers = piece_answers(run_snapshots_dir(run_dir, root))
            coordinator = "127.0.0.1:29500"
            link = BuddyLink(
                run_dir, root, SECRET, clients[rank], coordinator, rank, len(roots), answers
            )
            links.append(link)
        yield links
    finally:
        for link in links:
            link.close()
        on_threads(*(client.shutdown for client in clients))
        service.shutdown()


def write_old_job(run_dir: Path, state: dict[str, jax.Array], places: dict[int, list[Path]]):
    """The snapshots of STEP as the OLD_PROCESSES processes of the old job (process p held
    devices 2p and 2p+1) left them: process p's written into each directory of places[p]."""
    shards = host_shards(copy_shards(jax.tree.leaves(state)))
    layout = state_layout(state)
    for process, directories in places.items():
        mine = [shard for shard in shards if shard.device_id // 2 == process]
        record = {
            "meta": {"data": {"samples_seen": STEP * 8}},
            "layout": {**layout, "process_count": OLD_PROCESSES, "process_index": process},
        }
        for directory in directories:
            SnapshotStore(directory).write(STEP, mine, record)


def own_dir(run_dir: Path, root: Path, process: int) -> Path:
    return run_snapshots_dir(run_dir, root) / f"process-{process}"


def slices_of(directories: list[Path]) -> dict[tuple[int, str], int]:
    """(leaf, slice) -> bytes, for every piece the snapshots of STEP in directories hold."""
    found = {}
    for directory in directories:
        manifest = json.loads((directory / f"step-{STEP}" / MANIFEST).read_text())
        for entry in manifest["files"]:
            found[(entry["leaf"], json.dumps(entry["region"]))] = entry["bytes"]
    return found


def assert_bitwise(restored: dict, original: dict, target: dict) -> None:
    for name, leaf in original.items():
        assert restored[name].sharding == target[name].sharding
        assert np.asarray(restored[name]).tobytes() == np.asarray(leaf).tobytes()


def test_a_reshard_puts_together_pieces_split_across_two_nodes_bitwise(tmp_path: Path):
    run_dir, node_a, node_b = tmp_path / "run", tmp_path / "node-a", tmp_path / "node-b"
    original = train_like_state(old_mesh())
    places = {p: [own_dir(run_dir, node_a if p < 2 else node_b, p)] for p in range(4)}
    write_old_job(run_dir, original, places)
    target = abstract(train_like_state(new_layouts()[TARGET]))
    on_a = run_snapshots_dir(run_dir, node_a)
    # alone, node a's pieces make half of the matrix
    whole, reason = coverable(on_a, target, "")
    assert whole == {} and "is not whole in the snapshots within reach" in reason
    assert "process(es) 0, 1 of the 4-process layout, on this node" in reason
    # the new job: process 0 on node a, processes 1 and 2 on node b
    with job_of(run_dir, [node_a, node_b, node_b]) as links:
        elsewhere, unanswered = remote_snapshots(links[0], on_a)
        assert unanswered == []
        # node b listed once (by process 1), whichever of its processes could have: two snapshots
        assert [(s.directory.as_posix(), s.holder) for s in elsewhere[STEP]] == [
            (f"process-{p}/step-{STEP}", links[1].server.address) for p in (2, 3)
        ]
        whole, reason = coverable(on_a, target, "", PeerPieces(links[0], on_a))
        assert (sorted(whole), reason) == ([STEP], "")
        assert (
            whole[STEP].describe() == "process(es) 0, 1, 2, 3 of the 4-process layout, on 2 nodes"
        )
        reader = PieceReader(PeerPieces(links[0], on_a).read)
        shards, bytes_read = assemble_shards(whole[STEP], target, reader)
    assert_bitwise(place_shards(shards, target), original, target)
    # each slice read once, from this node where it is here: the others came over the network
    only_on_b = (
        slices_of([places[2][0], places[3][0]]).items()
        - slices_of([places[0][0], places[1][0]]).items()
    )
    assert bytes_read == STATE_BYTES
    assert reader.remote_bytes == sum(size for _, size in only_on_b) == 16 * 8 * 4 // 2


def two_nodes_with_buddies(run_dir: Path, node_b: Path, node_c: Path, state: dict) -> dict:
    """The old job's memory as it left it on two nodes: processes 0, 1 on node b and 2, 3 on
    node c, each with its own snapshot and its buddy's copy on the other node."""
    places = {}
    for process in range(OLD_PROCESSES):
        home, other = (node_b, node_c) if process < 2 else (node_c, node_b)
        buddy = (process + 2) % OLD_PROCESSES
        places[process] = [
            own_dir(run_dir, home, process),
            held_snapshots_dir(run_dir, other, buddy, process),
        ]
    write_old_job(run_dir, state, places)
    return places


def first_matrix_piece(directory: Path) -> Path:
    manifest = json.loads((directory / f"step-{STEP}" / MANIFEST).read_text())
    entry = next(e for e in manifest["files"] if e["leaf"] == 0)
    return directory / f"step-{STEP}" / entry["name"]


def test_a_flipped_byte_in_a_remote_piece_is_refused_for_another_holders_copy(tmp_path: Path):
    run_dir = tmp_path / "run"
    node_a, node_b, node_c = (tmp_path / f"node-{name}" for name in "abc")
    original = train_like_state(old_mesh())
    places = two_nodes_with_buddies(run_dir, node_b, node_c, original)
    target = abstract(train_like_state(new_layouts()[TARGET]))
    on_a = run_snapshots_dir(run_dir, node_a)  # a spare's node: nothing of the run here
    own_on_b, copy_on_c = (first_matrix_piece(directory) for directory in places[0])
    flip_a_byte(own_on_b)
    with job_of(run_dir, [node_a, node_b, node_c]) as links:
        whole, reason = coverable(on_a, target, "", PeerPieces(links[0], on_a))
        assert (sorted(whole), reason) == ([STEP], "")
        reader = PieceReader(PeerPieces(links[0], on_a).read)
        shards, _ = assemble_shards(whole[STEP], target, reader)
        assert_bitwise(place_shards(shards, target), original, target)
        # everything came over the network, and the flipped piece (an eighth of the matrix) too
        assert reader.remote_bytes == reader.bytes_read == STATE_BYTES + 16 * 8 * 4 // 8
        flip_a_byte(copy_on_c)
        with pytest.raises(SnapshotDamaged) as refused:
            assemble_shards(
                pieces_by_step(on_a, remote_snapshots(links[0], on_a)[0])[STEP],
                target,
                PieceReader(PeerPieces(links[0], on_a).read),
            )
    (b_host, b_port), (c_host, c_port) = (link.server.address for link in links[1:])
    why = str(refused.value)
    own = f"process-0/step-{STEP}/{own_on_b.name}"
    held = f"process-2/held-for-process-0/step-{STEP}/{copy_on_c.name}"
    assert f"{b_host}:{b_port}: {own} does not match its sha256" in why
    assert f"{c_host}:{c_port}: {held} does not match its sha256" in why


def test_a_holder_that_does_not_answer_is_skipped_with_why(tmp_path: Path):
    run_dir = tmp_path / "run"
    node_a, node_b, node_c = (tmp_path / f"node-{name}" for name in "abc")
    original = train_like_state(old_mesh())
    two_nodes_with_buddies(run_dir, node_b, node_c, original)
    target = abstract(train_like_state(new_layouts()[TARGET]))
    on_a = run_snapshots_dir(run_dir, node_a)
    with job_of(run_dir, [node_a, node_b, node_c]) as links:
        whole, _ = coverable(on_a, target, "", PeerPieces(links[0], on_a))
        host, port = links[1].server.address
        links[1].server.close()  # node b goes away once its pieces were listed
        reader = PieceReader(PeerPieces(links[0], on_a).read)
        shards, _ = assemble_shards(whole[STEP], target, reader)
        assert_bitwise(place_shards(shards, target), original, target)
        assert reader.remote_bytes == STATE_BYTES  # all from node c
        assert list(reader.fetch.unreachable) == [(host, port)]
        # listed now, node b's pieces are missing, and why
        elsewhere, unanswered = remote_snapshots(links[0], on_a)
        assert {s.holder for s in elsewhere[STEP]} == {links[2].server.address}
        assert len(unanswered) == 1
        assert unanswered[0].startswith(f"process 1 ({host}:{port}) did not list its node's: ")


def test_a_server_gives_nothing_to_a_request_without_the_seal_or_for_what_is_not_a_piece(
    tmp_path: Path,
):
    run_dir, node_b = tmp_path / "run", tmp_path / "node-b"
    write_old_job(run_dir, train_like_state(old_mesh()), {2: [own_dir(run_dir, node_b, 2)]})
    with job_of(run_dir, [tmp_path / "node-a", node_b]) as links:
        server = links[1].server
        piece = {"kind": PIECE, "path": f"process-2/step-{STEP}/0.bin"}
        for header in ({"kind": PIECES}, piece):
            with pytest.raises((OSError, Refused)):
                request(server.address, b"not the job's secret", header)
        assert server.refusals == ["127.0.0.1: its header is not sealed with this job's secret"] * 2
        for place in (f"process-2/step-{STEP}/{MANIFEST}", "../../../etc/passwd"):
            with pytest.raises(OSError, match="not a snapshot piece on this node"):
                request(server.address, SECRET, {"kind": PIECE, "path": place})
        # sealed, it answers
        _, files = request(server.address, SECRET, piece)
        assert files == [
            (piece["path"], (own_dir(run_dir, node_b, 2) / f"step-{STEP}" / "0.bin").read_bytes())
        ]


def test_the_restore_record_says_how_many_bytes_came_from_other_nodes():
    memory = MemoryRestored(
        state=None, step=STEP, meta={}, path=Path("."), snapshot_bytes=STATE_BYTES, seconds=0.25,
        source="resharded", from_processes=4, remote_bytes=256,
    )  # fmt: skip
    assert restore_record(memory, None, 0.0) == {
        "source": "resharded",
        "bytes": STATE_BYTES,
        "from_processes": 4,
        "remote_bytes": 256,
        "seconds": 0.25,
    }
