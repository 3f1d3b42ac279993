"""Copies of the in-memory snapshots on a buddy (checkpoint.memory_buddy): who holds whose copy,
and the sealed transport between them. Every worker runs a BuddyServer, publishes its address in
the job's key-value store (sealed, like the votes), sends each snapshot it writes to its buddy
and, after a restart, asks its buddy for the copy it holds.

The buddy of process i is the first process past i's node in ring order: process (i + m) mod n,
where m processes share i's node (its interface address), so a job numbered node by node keeps
every copy on another node; where that is i's own node (one node, or nodes of unequal sizes),
the next process on another node, else (i + 1) mod n.

The transport: each worker's small TCP server keeps the copies of its peers' snapshots it is
sent, lists them and hands them back. Every message carries HMAC-SHA256 seals under the job's
secret (MSJAX_JOB_SECRET): its header's seal is checked before its body is read, and the body's
before anything is written, so a message without a valid seal is refused and written nowhere.
The server listens on one address only (the interface that reaches the job's coordinator:
127.0.0.1 for a job on one node), on a port the OS chooses. It answers other kinds of request
where it is given their answers (the snapshot pieces its node holds:
msjax.checkpoint.piece_transport).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from msjax.checkpoint.snapshots import SnapshotStore, held_snapshots_dir, make_private_dir
from msjax.distributed import COORDINATOR
from msjax.parallel.agreement import seal, unseal

ADDRESS_KEY = "msjax/buddy/address"  # + /RANK: a worker's server, as host:port
PEER_WAIT_S = 300.0  # a peer that never publishes its address: the job is not starting at all
MAGIC = b"msjax-buddy-1\n"  # the first bytes of every message
MAC_BYTES = 32  # an HMAC-SHA256
MAX_HEADER_BYTES = 1 << 20  # a header past this is refused before it is read
IO_TIMEOUT_S = 120.0  # a peer silent this long in the middle of a message: the connection ends
LOOPBACK = "127.0.0.1"
MAX_REFUSALS_KEPT = 100  # the newest refusals a server remembers (a flood keeps no more)

Files = list[tuple[str, bytes]]
Answer = Callable[[dict[str, Any]], tuple[dict[str, Any], Files]]  # a request's header -> reply


class Refused(Exception):
    """A message without a valid seal, or one that is not a message of this protocol."""


def _seal(secret: bytes, part: str, *pieces: bytes) -> hmac.HMAC:
    mac = hmac.new(secret, f"msjax-buddy {part}\n".encode(), hashlib.sha256)
    for piece in pieces:
        mac.update(piece)
    return mac


def send_message(sock: socket.socket, secret: bytes, header: dict[str, Any], files: Files) -> None:
    """Send header and files, sealed: the header (which names the files and their sizes) with its
    own seal, then the files and a seal over them and the header's."""
    header_bytes = json.dumps({**header, "files": [[n, len(d)] for n, d in files]}).encode()
    header_mac = _seal(secret, "header", header_bytes).digest()
    sock.sendall(MAGIC + len(header_bytes).to_bytes(4, "big") + header_bytes + header_mac)
    body_mac = _seal(secret, "body", header_mac)
    for _, data in files:
        sock.sendall(data)
        body_mac.update(data)
    sock.sendall(body_mac.digest())


def receive_message(sock: socket.socket, secret: bytes) -> tuple[dict[str, Any], Files]:
    """A message send_message sent under the same secret; Refused where a seal does not match
    (its body is then never read past its header's seal, or never returned)."""
    if _read_exactly(sock, len(MAGIC)) != MAGIC:
        raise Refused("not a message of msjax's snapshot copies")
    length = int.from_bytes(_read_exactly(sock, 4), "big")
    if length > MAX_HEADER_BYTES:
        raise Refused(f"a header of {length} bytes (at most {MAX_HEADER_BYTES})")
    header_bytes = _read_exactly(sock, length)
    header_mac = _read_exactly(sock, MAC_BYTES)
    if not hmac.compare_digest(header_mac, _seal(secret, "header", header_bytes).digest()):
        raise Refused("its header is not sealed with this job's secret")
    header = json.loads(header_bytes)
    body_mac = _seal(secret, "body", header_mac)
    files = []
    for name, size in header.pop("files"):
        data = _read_exactly(sock, int(size))
        body_mac.update(data)
        files.append((str(name), data))
    if not hmac.compare_digest(_read_exactly(sock, MAC_BYTES), body_mac.digest()):
        raise Refused("its files are not sealed with this job's secret")
    return header, files


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    """size bytes from sock; Refused where the peer ends the connection first."""
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise Refused(f"the connection ended {left} bytes before the message did")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def request(
    address: tuple[str, int],
    secret: bytes,
    header: dict[str, Any],
    files: Files = (),
    timeout_s: float = IO_TIMEOUT_S,
) -> tuple[dict[str, Any], Files]:
    """Send one sealed request to a peer's server and return its sealed reply; OSError or
    Refused where the peer cannot be reached or answers without a valid seal."""
    with socket.create_connection(address, timeout=timeout_s) as sock:
        send_message(sock, secret, header, list(files))
        reply, reply_files = receive_message(sock, secret)
    if reply.get("kind") != "reply":
        raise Refused(f"the peer at {address[0]}:{address[1]} answered with a request")
    if reply.get("error"):
        raise OSError(f"the peer at {address[0]}:{address[1]} answered: {reply['error']}")
    return reply, reply_files


def interface_address(coordinator: str | None) -> str:
    """The address of this host's interface that reaches the job's coordinator (host:port):
    127.0.0.1 where the coordinator is a loopback address or unknown. Finding it sends nothing
    (a UDP socket's connect only picks the route)."""
    host, _, port = (coordinator or "").rpartition(":")
    host = host.strip("[]")
    if not host or host in (LOOPBACK, "localhost", "::1"):
        return LOOPBACK
    family, kind, proto, _, target = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(target)
        return probe.getsockname()[0]


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True  # a connection's thread never keeps a worker alive
    allow_reuse_address = False


class BuddyServer:
    """This process's server of the copies it holds for its peers, in `held_store(owner)`:
    `put` keeps a peer's snapshot (double-buffered: a copy being received never replaces the
    last whole one), `list` names the whole copies held for a peer with their manifests, and
    `get` returns one; a request of another kind goes to its entry in `answers`. Runs in daemon
    threads until close()."""

    def __init__(
        self,
        host: str,
        secret: bytes,
        held_store: Callable[[int], SnapshotStore],
        answers: dict[str, Answer] | None = None,
    ):
        self.secret = secret
        self.held_store = held_store
        self.answers = dict(answers or {})
        self.refusals: list[str] = []  # why messages were refused, newest last
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        handle = lambda handler: self._handle(handler)  # noqa: E731 (bound as the handler's)
        handler = type("Handler", (socketserver.BaseRequestHandler,), {"handle": handle})
        server_class = type("Server", (_Server,), {"address_family": family})
        self._server = server_class((host, 0), handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="msjax-buddy-server",
            daemon=True,
        )
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the server listens on."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=IO_TIMEOUT_S)

    def _handle(self, handler: socketserver.BaseRequestHandler) -> None:
        sock = handler.request
        sock.settimeout(IO_TIMEOUT_S)
        try:
            header, files = receive_message(sock, self.secret)
        except (Refused, ValueError, KeyError, TypeError) as error:
            self.refusals = [
                *self.refusals[-MAX_REFUSALS_KEPT + 1 :],
                f"{handler.client_address[0]}: {error}",
            ]
            return  # nothing written, nothing answered
        except OSError:
            return
        try:
            reply, reply_files = self._answer(header, files)
        except Exception as error:  # answered, so the peer knows at once (its restore goes on)
            reply, reply_files = {"error": f"{type(error).__name__}: {error}"}, []
        with contextlib.suppress(OSError):
            send_message(sock, self.secret, {**reply, "kind": "reply"}, reply_files)

    def _answer(self, header: dict[str, Any], files: Files) -> tuple[dict[str, Any], Files]:
        kind = header["kind"]
        if kind in self.answers:
            return self.answers[kind](header)
        store = self.held_store(int(header["owner"]))
        if kind == "put":
            store.write_files(int(header["step"]), files)
            return {}, []
        if kind == "list":
            steps = store.complete_steps()
            return {"manifests": {str(step): store.manifest(step) for step in steps}}, []
        if kind == "get":
            return {}, store.files(int(header["step"]))
        raise ValueError(f"no such request: {kind!r}")


def buddy_of(process: int, hosts: list[str]) -> int:
    """The process that holds process's copies, from every process's host (see the module)."""
    count = len(hosts)
    on_node = sum(host == hosts[process] for host in hosts)
    candidates = [(process + on_node) % count]
    candidates += [(process + step) % count for step in range(1, count)]
    for candidate in candidates:
        if hosts[candidate] != hosts[process]:
            return candidate
    return (process + 1) % count


class BuddyLink:
    """This process's server of the copies it holds (and of what `answers` answers), and its
    way to its buddy's."""

    def __init__(
        self,
        run_dir: Path,
        root: Path,
        secret: bytes,
        client: Any,
        coordinator: str | None,
        rank: int,
        processes: int,
        answers: dict[str, Answer] | None = None,
    ):
        self.rank, self.processes = rank, processes  # this process's index, the job's count
        self.secret = secret
        self.client = client  # jax.distributed's key-value store
        self.run_dir, self.root = run_dir, root
        self._addresses: list[tuple[str, int]] | None = None  # before the server answers
        host = interface_address(coordinator)
        self.server = BuddyServer(host, secret, self.held_store, answers)
        key = f"{ADDRESS_KEY}/{self.rank}"
        host, port = self.server.address
        client.key_value_set(key, seal(key, json.dumps([host, port]), secret))

    def held_store(self, owner: int) -> SnapshotStore:
        """Where this process keeps its copies of owner's snapshots; ValueError for a process
        that is not the job's or whose buddy this process is not."""
        if owner not in self.owners():
            raise ValueError(f"process {self.rank} holds no copies for process {owner}")
        directory = held_snapshots_dir(self.run_dir, self.root, self.rank, owner)
        make_private_dir(directory)
        return SnapshotStore(directory)

    def addresses(self) -> list[tuple[str, int]]:
        """Every process's server (host, port), in rank order, once all have published."""
        if self._addresses is None:
            deadline = time.monotonic() + PEER_WAIT_S
            found = []
            for rank in range(self.processes):
                key = f"{ADDRESS_KEY}/{rank}"
                wait_ms = max(int((deadline - time.monotonic()) * 1000), 1)
                try:
                    sealed = self.client.blocking_key_value_get(key, wait_ms)
                except Exception as error:  # the client's own timeout or a closed service
                    raise TimeoutError(
                        f"process {rank} published no snapshot-copy address within "
                        f"{PEER_WAIT_S:g} s ({error})"
                    ) from error
                host, port = json.loads(unseal(key, sealed, self.secret))
                found.append((str(host), int(port)))
            self._addresses = found
        return self._addresses

    def buddy(self) -> int:
        """The process that holds this process's copies."""
        return buddy_of(self.rank, [host for host, _ in self.addresses()])

    def owners(self) -> list[int]:
        """The processes whose copies this process holds."""
        hosts = [host for host, _ in self.addresses()]
        return [
            p for p in range(self.processes) if p != self.rank and buddy_of(p, hosts) == self.rank
        ]

    def send(self, step: int, files: Files) -> None:
        """Give the buddy a copy of this process's snapshot of `step` (OSError, Refused)."""
        header = {"kind": "put", "owner": self.rank, "step": step}
        request(self.addresses()[self.buddy()], self.secret, header, files)

    def held_manifests(self) -> dict[int, dict[str, Any]]:
        """The manifests of the whole copies the buddy holds for this process, by step."""
        header = {"kind": "list", "owner": self.rank}
        reply, _ = request(self.addresses()[self.buddy()], self.secret, header)
        return {int(step): manifest for step, manifest in reply["manifests"].items()}

    def fetch(self, step: int) -> dict[str, bytes]:
        """The files of the buddy's copy of this process's snapshot of `step`, by name."""
        header = {"kind": "get", "owner": self.rank, "step": step}
        _, files = request(self.addresses()[self.buddy()], self.secret, header)
        return dict(files)

    def close(self) -> None:
        self.server.close()


def coordinator_address() -> str | None:
    """The job's coordinator (host:port): MSJAX_COORDINATOR, else jax.distributed's."""
    from jax._src.distributed import global_state

    return os.environ.get(COORDINATOR) or global_state.coordinator_address
