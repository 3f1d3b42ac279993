"""Copies of the in-memory snapshots on a buddy (checkpoint.memory_buddy): the sealed transport
refuses what the job's secret did not seal and writes it nowhere, listens on loopback only for a
job on one node, and a copy handed back is verified by its manifest before a restore uses it.
The two processes of a job are two BuddyLinks here, each with its own client of a real
coordination service on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path

import jax
import numpy as np
import pytest
from test_memory_snapshot_votes import PROCESSES, clients  # noqa: F401 (a fixture)
from test_memory_snapshots import abstract, sharded_state, write

from msjax.checkpoint.buddies import (
    MAGIC,
    BuddyLink,
    BuddyServer,
    Refused,
    buddy_of,
    interface_address,
    request,
    send_message,
)
from msjax.checkpoint.snapshots import (
    SnapshotDamaged,
    SnapshotStore,
    held_snapshots_dir,
    host_memory_available_bytes,
    memory_shortfall,
)
from msjax.training.memory_restore import Candidates, read_step

SECRET = b"the job's secret"


@pytest.fixture
def server(tmp_path: Path):
    """A server holding copies for process 1 under tmp_path/held-1, on loopback."""
    serving = BuddyServer(
        "127.0.0.1", SECRET, lambda owner: SnapshotStore(tmp_path / f"held-{owner}")
    )
    yield serving
    serving.close()


def own_snapshot(tmp_path: Path, step: int = 3) -> SnapshotStore:
    store = SnapshotStore(tmp_path / "own")
    write(store, step, sharded_state())
    return store


def hung_up(sock: socket.socket) -> bool:
    """Whether the peer closed the connection without a byte of answer (a close with unread
    bytes on its side arrives as a reset)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_sealed_copy_is_kept_and_handed_back_as_it_was_sent(tmp_path: Path, server):
    store = own_snapshot(tmp_path)
    request(server.address, SECRET, {"kind": "put", "owner": 1, "step": 3}, store.files(3))
    assert SnapshotStore(tmp_path / "held-1").complete_steps() == [3]
    reply, _ = request(server.address, SECRET, {"kind": "list", "owner": 1})
    assert reply["manifests"] == {"3": store.manifest(3)}
    _, files = request(server.address, SECRET, {"kind": "get", "owner": 1, "step": 3})
    assert files == store.files(3)
    assert server.refusals == []


def test_a_copy_sealed_with_another_secret_is_refused_and_written_nowhere(tmp_path: Path, server):
    store = own_snapshot(tmp_path)
    with pytest.raises((OSError, Refused)):
        header = {"kind": "put", "owner": 1, "step": 3}
        request(server.address, b"not the job's", header, store.files(3))
    assert not (tmp_path / "held-1").exists()
    assert server.refusals == ["127.0.0.1: its header is not sealed with this job's secret"]


def test_an_unsealed_copy_is_refused_and_written_nowhere(tmp_path: Path, server):
    store = own_snapshot(tmp_path)
    files = store.files(3)
    header = json.dumps(
        {"kind": "put", "owner": 1, "step": 3, "files": [[n, len(d)] for n, d in files]}
    ).encode()
    with socket.create_connection(server.address, timeout=30) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it may hang up early
            sock.sendall(MAGIC + len(header).to_bytes(4, "big") + header + bytes(32))
            sock.sendall(b"".join(data for _, data in files) + bytes(32))
        assert hung_up(sock)  # without an answer
    assert not (tmp_path / "held-1").exists()
    assert server.refusals == ["127.0.0.1: its header is not sealed with this job's secret"]


def test_a_copy_whose_files_are_not_the_sealed_ones_is_refused(tmp_path: Path, server):
    store = own_snapshot(tmp_path)
    files = store.files(3)

    class Tampering(socket.socket):
        """Sends the sealed header as it is and one flipped byte in the files after it."""

        def sendall(self, data: bytes) -> None:
            if data == files[-1][1]:
                data = bytes([data[0] ^ 1]) + data[1:]
            super().sendall(data)

    with Tampering(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(server.address)
        send_message(sock, SECRET, {"kind": "put", "owner": 1, "step": 3}, files)
        assert hung_up(sock)
    assert not (tmp_path / "held-1").exists()
    assert server.refusals == ["127.0.0.1: its files are not sealed with this job's secret"]


def test_nothing_listens_beyond_loopback_when_the_coordinator_is_on_loopback(server):
    assert interface_address("127.0.0.1:29500") == "127.0.0.1"
    assert interface_address("localhost:29500") == "127.0.0.1"
    assert interface_address(None) == "127.0.0.1"
    bound_host, bound_port = server._server.socket.getsockname()[:2]
    assert (bound_host, bound_port) == server.address and bound_host == "127.0.0.1"


def test_the_buddy_is_on_another_node_where_there_is_one():
    assert [buddy_of(p, ["a"] * 3) for p in range(3)] == [1, 2, 0]
    assert [buddy_of(p, ["a", "a", "b", "b"]) for p in range(4)] == [2, 3, 0, 1]
    assert [buddy_of(p, ["a", "a", "a", "b"]) for p in range(4)] == [3, 3, 3, 0]


def test_the_memory_budget_counts_the_copies_held_for_a_peer(tmp_path: Path):
    store = own_snapshot(tmp_path)
    snapshot_bytes = host_memory_available_bytes(store.directory) // 8
    # its own snapshots, twice, are a quarter of what the host can give: within 0.4 of it
    assert memory_shortfall(store, snapshot_bytes, 0.4) == ""
    # with a peer's copies, twice, as large as its own: half, past 0.4
    why = memory_shortfall(store, snapshot_bytes, 0.4, held_bytes=snapshot_bytes)
    assert f"they need {4 * snapshot_bytes} bytes of RAM on this host" in why
    assert f"the {snapshot_bytes} bytes of the copies it holds for a peer" in why


def linked(tmp_path: Path, clients: list) -> list[BuddyLink]:  # noqa: F811
    """The job's two processes' links, their snapshots under tmp_path, on loopback."""
    coordinator = "127.0.0.1:29500"
    return [
        BuddyLink(tmp_path, tmp_path, SECRET, clients[rank], coordinator, rank, PROCESSES)
        for rank in range(PROCESSES)
    ]


def test_a_restore_uses_its_buddys_copy_bitwise_and_refuses_a_flipped_byte(
    tmp_path: Path,
    clients: list,  # noqa: F811
):
    links = linked(tmp_path, clients)
    try:
        assert [link.buddy() for link in links] == [1, 0]
        assert [link.server.address[0] for link in links] == ["127.0.0.1", "127.0.0.1"]
        state = sharded_state()
        store = SnapshotStore(tmp_path / "own-0")
        write(store, 4, state)
        links[0].send(4, store.files(4))
        held = links[0].held_manifests()
        assert held == {4: store.manifest(4)}
        # process 0's own snapshot is gone (its node's memory): the copy process 1 holds is used
        found = Candidates(None, [], held, links[0], "", held_here=True)
        restored, manifest, _, source = read_step(found, 4, abstract(state))
        assert (source, manifest) == ("buddy", store.manifest(4))
        for name, leaf in state.items():
            assert restored[name].sharding == leaf.sharding
            assert np.array_equal(np.asarray(restored[name]), np.asarray(leaf))
        copy = SnapshotStore(held_snapshots_dir(tmp_path, tmp_path, 1, 0))
        shard = copy.path(4) / "0.bin"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        with pytest.raises(SnapshotDamaged, match=r"its buddy's copy: .*0\.bin does not match"):
            read_step(found, 4, abstract(state))
    finally:
        for link in links:
            link.close()
    assert jax.process_count() == 1  # the job's two processes were the two links here
