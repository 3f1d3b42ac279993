"""Two processes' snapshot writers agree on every due snapshot: where one is still writing, both
skip it, so they never hold snapshots of different steps. In-process: two writers on threads,
each with its own client of a real jax coordination service (the key-value store the processes
of a job vote through), each writing to its own store."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest
from test_memory_snapshots import Recorded, sharded_state

from msjax.checkpoint.snapshots import SnapshotStore
from msjax.parallel.agreement import ProcessVote
from msjax.training.memory_snapshots import MemorySnapshots

PROCESSES = 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def on_threads(*calls) -> None:
    """Run the calls at once, one thread each, and re-raise the first error."""
    errors: list[BaseException] = []

    def run(call):
        try:
            call()
        except BaseException as error:  # handed to the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]


@pytest.fixture
def clients() -> Iterator[list]:
    """One client per process of a real coordination service on 127.0.0.1, all connected."""
    from jax._src.lib import _jax

    address = f"127.0.0.1:{free_port()}"
    service = _jax.get_distributed_runtime_service(address, PROCESSES)
    connected = [
        _jax.get_distributed_runtime_client(address, rank, init_timeout=60)
        for rank in range(PROCESSES)
    ]
    on_threads(*(client.connect for client in connected))
    yield connected
    on_threads(*(client.shutdown for client in connected))
    service.shutdown()


def vote_of(client, rank: int) -> ProcessVote:
    """The snapshot vote as process `rank` of the job casts it, through its own client."""
    vote = ProcessVote("memory-save", timeout_s=60)
    vote.client, vote.rank, vote.processes = client, rank, PROCESSES
    vote.prefix = "msjax/vote/memory-save"  # one name for both ranks, as in a real job
    return vote


def test_a_snapshot_one_process_is_still_writing_is_skipped_by_every_process(
    tmp_path: Path, clients: list
):
    state = sharded_state()
    release = threading.Event()
    stores = [SnapshotStore(tmp_path / f"process-{rank}") for rank in range(PROCESSES)]
    writes = stores[1].write

    def held_write(step, shards, record):  # process 1's own write, once the test lets it
        release.wait()
        return writes(step, shards, record)

    stores[1].write = held_write
    events = [Recorded() for _ in range(PROCESSES)]
    writers = [
        MemorySnapshots(1, stores[rank], lambda step: {"step": step}, events[rank], print,
                        vote=vote_of(clients[rank], rank))
        for rank in range(PROCESSES)
    ]  # fmt: skip

    def steps(rank: int) -> None:
        for step in (1, 2, 3, 4):
            writers[rank].after_step(step, state)
            if rank == 0:
                writers[0].close()  # process 0's writes end at once: it is free every step

    on_threads(*(lambda rank=rank: steps(rank) for rank in range(PROCESSES)))
    release.set()
    for writer in writers:
        writer.close()
    # process 1 was writing step 1 throughout: both skipped steps 2-4, and hold the same one
    assert [store.complete_steps() for store in stores] == [[1], [1]]
    for recorded in events:
        assert [(s, b > 0, k) for s, b, k in recorded.snapshots] == [
            (1, True, 0),
            (2, False, 1),
            (3, False, 2),
            (4, False, 3),
        ]
    assert jax.process_count() == 1  # the job's two processes were the two writers here
