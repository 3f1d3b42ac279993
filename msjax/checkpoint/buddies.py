"""Which process holds a copy of whose in-memory snapshots (checkpoint.memory_buddy), and the link
to them: every worker runs a BuddyServer, publishes its address in the job's key-value store
(sealed, like the votes), sends each snapshot it writes to its buddy and, after a restart, asks
its buddy for the copy it holds.

The buddy of process i is the first process past i's node in ring order: process (i + m) mod n,
where m processes share i's node (its interface address), so a job numbered node by node keeps
every copy on another node; where that is i's own node (one node, or nodes of unequal sizes),
the next process on another node, else (i + 1) mod n.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from msjax.checkpoint.buddy_transport import BuddyServer, Files, interface_address, request
from msjax.checkpoint.snapshots import SnapshotStore, held_snapshots_dir, make_private_dir
from msjax.distributed import COORDINATOR
from msjax.parallel.agreement import seal, unseal

ADDRESS_KEY = "msjax/buddy/address"  # + /RANK: a worker's server, as host:port
PEER_WAIT_S = 300.0  # a peer that never publishes its address: the job is not starting at all


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
    """This process's server of the copies it holds, and its way to its buddy's."""

    def __init__(
        self,
        run_dir: Path,
        root: Path,
        secret: bytes,
        client: Any,
        coordinator: str | None,
        rank: int,
        processes: int,
    ):
        self.rank, self.processes = rank, processes  # this process's index, the job's count
        self.secret = secret
        self.client = client  # jax.distributed's key-value store
        self.run_dir, self.root = run_dir, root
        self._addresses: list[tuple[str, int]] | None = None  # before the server answers
        self.server = BuddyServer(interface_address(coordinator), secret, self.held_store)
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
                host, port = json.loads(
                    unseal(key, self.client.blocking_key_value_get(key, wait_ms), self.secret)
                )
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
