"""The loop's in-memory snapshots (checkpoint.memory_every_steps): after a due step the state is
copied on its devices, and a background thread brings this process's shards to the host, writes
them to the snapshot store (msjax.checkpoint.snapshots) and sends a copy to the process's buddy
(checkpoint.memory_buddy), overlapping the next steps. Restoring them is
msjax.training.memory_restore's, which also holds what both use: the state's `state_layout` and
this process's `buddy_link`."""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msjax.checkpoint.buddies import BuddyLink
from msjax.checkpoint.snapshot_reshard import Region, region_of
from msjax.checkpoint.snapshots import (
    ShardFile,
    SnapshotStore,
    memory_shortfall,
    writable_snapshot_store,
)
from msjax.config import Config
from msjax.loop_events import LoopEvents
from msjax.parallel.agreement import (
    ProcessVote,
    agree_any,
    agree_max,
    process_vote,
)
from msjax.training.memory_restore import buddy_link, state_layout


@dataclass(frozen=True)
class ShardCopy:
    """A copy of one of this process's shards of a state leaf, on the shard's own device."""

    leaf: int  # the leaf's number in the state's leaves
    data: Any  # a single-device jax.Array
    device_id: int
    region: Region  # the global slice it holds
    global_shape: tuple[int, ...]


def copy_shards(leaves: list[Any]) -> list[ShardCopy]:
    """Every addressable shard of `leaves`, each copied on its own device (dispatched, not waited
    for): a copy the next step's donation cannot take away, made without any program across
    processes. Copying a global array whole would run one (JAX copies an array that spans
    processes with a compiled identity on every process), beside the next step's collectives,
    which XLA:CPU can deadlock on."""
    import jax

    shards = [
        (number, leaf, shard)
        for number, leaf in enumerate(leaves)
        for shard in leaf.addressable_shards
    ]
    copies = jax.device_put(
        [shard.data for _, _, shard in shards],
        [shard.device for _, _, shard in shards],
        may_alias=False,
    )
    return [
        ShardCopy(
            number, copy, shard.device.id, region_of(shard.index, leaf.shape), tuple(leaf.shape)
        )
        for (number, leaf, shard), copy in zip(shards, copies, strict=True)
    ]


def host_shards(copies: list[ShardCopy]) -> list[ShardFile]:
    """The copies brought to the host (blocks until each copy is made)."""
    import numpy as np

    return [
        ShardFile(copy.leaf, copy.device_id, np.asarray(copy.data), copy.region, copy.global_shape)
        for copy in copies
    ]


class MemorySnapshots:
    """Snapshots every `every_steps` steps into `store` (made and cleared of unfinished writes
    by its builder), one written at a time by a background thread. Every process takes or skips
    the same snapshots: at each due step they vote (`vote`, None in a one-process run), and one
    due while the last is still being written on any process is, by `when_busy`, skipped by all
    (and counted) or waited for by all (each process for its own write, then a second vote for
    the slowest) and taken; a write that failed on any process turns them off on all."""

    def __init__(
        self,
        every_steps: int,
        store: SnapshotStore,
        meta_of: Callable[[int], dict[str, Any]],
        events: LoopEvents,
        warn: Callable[[str], None],
        vote: ProcessVote | None = None,
        buddy: BuddyLink | None = None,
        when_busy: str = "skip",
    ):
        self.every_steps = every_steps
        self.store = store
        self.meta_of = meta_of  # step -> the record a restore needs beside the arrays
        self.events = events
        self.warn = warn
        self.vote = vote  # the processes' per-snapshot vote: take, skip, or turn off
        self.buddy = buddy  # where a copy of each snapshot goes (None: nowhere)
        self.when_busy = when_busy  # checkpoint.memory_when_busy: "skip" or "wait"
        self._buddy_error: str | None = None
        self.skipped = 0  # snapshots not taken: the one before was still being written
        self._writer: threading.Thread | None = None
        self._error: str | None = None
        self._layout: dict[str, Any] | None = None  # the state's, the same every step

    def after_step(self, step: int, state: Any) -> None:
        """Snapshot `state` (which has `step` updates) when due and every process agrees: the
        device copy is dispatched here, everything else happens in the background."""
        if not self.every_steps or step % self.every_steps:
            return
        import jax

        started = time.perf_counter()  # the stall counts a wait for the write before
        if not self._agree_to_take(step, started):
            return
        copied = copy_shards(jax.tree.leaves(state))  # the host copy follows in the thread
        if self._layout is None:
            self._layout = state_layout(state)
        record = {"meta": self.meta_of(step), "layout": self._layout}
        self._writer = threading.Thread(
            target=self._write, args=(step, copied, record), name="msjax-snapshot", daemon=True
        )
        self._writer.start()
        stall_s = time.perf_counter() - started
        copied_bytes = sum(copy.data.nbytes for copy in copied)
        self.events.memory_snapshot(step, stall_s, copied_bytes, self.skipped)

    def _agree_to_take(self, step: int, started: float) -> bool:
        """Whether every process takes the snapshot due at `step` (the same answer on all): not
        where a write failed on any process (snapshots then turn off) nor, with when_busy
        "skip", where the one before is still being written on any (skipped and counted)."""
        busy = self._writer is not None and self._writer.is_alive()
        busy_anywhere, failed_anywhere = agree_max(self.vote, [busy, self._error is not None])
        if busy_anywhere and not failed_anywhere and self.when_busy == "wait":
            self.close()  # this process's write; the vote below waits for every other's
            busy_anywhere, failed_anywhere = agree_max(self.vote, [0, self._error is not None])
        if failed_anywhere:
            failure = self._error or "an in-memory snapshot failed on another process"
            self.warn(f"warning: {failure}; in-memory snapshots are off from here on")
            self.every_steps, self._error = 0, None
            return False
        if self._buddy_error is not None:  # this process's copies only: a restore checks them
            self.warn(f"warning: {self._buddy_error}; copies on a buddy are off from here on")
            self.buddy, self._buddy_error = None, None
        if busy_anywhere:
            self.skipped += 1
            self.events.memory_snapshot(step, time.perf_counter() - started, 0, self.skipped)
            return False
        return True

    def _write(self, step: int, copied: list[ShardCopy], record: dict[str, Any]) -> None:
        try:
            self.store.write(step, host_shards(copied), record)
        except Exception as error:  # shared memory full, say: the run goes on without them
            self._error = f"the in-memory snapshot of step {step} failed: {error}"
            return
        if self.buddy is not None:
            try:
                self.buddy.send(step, self.store.files(step))
            except Exception as error:  # the buddy gone or full: its copy is not taken
                self._buddy_error = f"the buddy's copy of step {step} failed: {error}"

    def close(self) -> None:
        """Wait for the snapshot being written."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def remove(self) -> None:
        """Delete this process's snapshots, and the run's directory once no process has any
        left (a run that ends cleanly on its own; under msjax.launch the launcher does it)."""
        self.close()
        shutil.rmtree(self.store.directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.store.directory.parent.rmdir()  # only once empty: the last process to end


def addressable_bytes(leaves: list[Any]) -> int:
    """The bytes of this process's shards of `leaves` (arrays or a state's leaves)."""
    return sum(shard.data.nbytes for leaf in leaves for shard in leaf.addressable_shards)


def build_memory_snapshots(
    config: Config,
    run_dir: Path,
    state: Any,
    meta_of: Callable[[int], dict[str, Any]],
    events: LoopEvents,
    warn: Callable[[str], None],
) -> MemorySnapshots | None:
    """The run's snapshots of `state` as configured, or None: off, or off on every process
    because one has no shared memory or too little RAM for them (said in one line)."""
    import jax

    every_steps = config.checkpoint.memory_every_steps
    if not every_steps:
        return None
    snapshot_bytes = addressable_bytes(jax.tree.leaves(state))
    buddy, no_buddy = buddy_link(config, run_dir)
    store = writable_snapshot_store(run_dir, jax.process_index())
    budget_vote = process_vote("memory-budget")
    # a peer's copies are as large as its own snapshots: the largest of any process, per owner
    largest_bytes = agree_max(budget_vote, [snapshot_bytes])[0]
    held_bytes = len(buddy.owners()) * largest_bytes if buddy is not None else 0
    if store is None:
        problem = "no writable /dev/shm on this node"
    else:
        fraction = config.checkpoint.memory_max_fraction
        problem = memory_shortfall(store, snapshot_bytes, fraction, held_bytes)
    if agree_any(budget_vote, bool(problem)):
        if store is not None:  # made just now and written nothing into: not left behind
            for directory in (store.directory, store.directory.parent):
                with contextlib.suppress(OSError):
                    directory.rmdir()  # only where empty
        off = f"checkpoint.memory_every_steps={every_steps}: in-memory snapshots are off"
        warn(f"warning: {off}: {problem or 'another process cannot hold them'}")
        return None
    copies = (
        f"; a copy of each goes to process {buddy.buddy()}, and this host holds "
        f"{2 * held_bytes} bytes of copies for process(es) "
        f"{', '.join(map(str, buddy.owners())) or 'none'}"
        if buddy is not None
        else f"; no copies on a buddy: {no_buddy}"
        if no_buddy
        else ""
    )
    warn(
        f"in-memory snapshots every {every_steps} steps take {2 * snapshot_bytes} bytes of RAM on "
        f"this host for this process (its shards, twice){copies}"
    )
    vote = process_vote("memory-save")
    when_busy = config.checkpoint.memory_when_busy
    return MemorySnapshots(
        every_steps, store, meta_of, events, warn, vote=vote, buddy=buddy, when_busy=when_busy
    )
