"""Global batches -> devices: each process prepares only the rows its devices hold (in Grain
worker processes or a thread), and places them as one global jax.Array per field.

One loader per process feeds all of its local devices (as MegaScale's one loader per node); what a
row holds depends only on the global sample order in data.batches, never on the number of
processes or workers.
"""

from __future__ import annotations

import atexit
import os
import queue
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Self

import grain
import jax
import numpy as np

from msjax.data.batches import Batch, GlobalBatches

_NO_END = 2**62  # steps of the row stream: it ends when training does
ORPHAN_CHECK_S = 0.5  # how often a Grain data process checks that its worker is still there


def local_row_blocks(
    sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]
) -> list[tuple[int, int]]:
    """Row ranges [start, stop) of dim 0 that this process's devices hold, sorted and merged."""
    rows = global_shape[0]
    spans = set()
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        start, stop, _ = index[0].indices(rows) if index else (0, rows, 1)
        spans.add((start, stop))
    blocks: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if blocks and start <= blocks[-1][1]:
            blocks[-1] = (blocks[-1][0], max(blocks[-1][1], stop))
        else:
            blocks.append((start, stop))
    return blocks


def place_batch(
    rows: Batch,
    sharding: jax.sharding.Sharding,
    global_shape: tuple[int, int],
) -> dict[str, jax.Array]:
    """This process's rows (the blocks of local_row_blocks, concatenated) as global arrays."""
    return {
        key: jax.make_array_from_process_local_data(sharding, value, global_shape)
        for key, value in rows.items()
    }


def place_global_batch(batch: Batch, sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
    """A whole global batch (e.g. from eval_batches) placed with sharding, each process
    copying only the rows its devices hold."""
    global_shape = batch["inputs"].shape
    blocks = local_row_blocks(sharding, global_shape)
    rows = {
        key: np.concatenate([value[start:stop] for start, stop in blocks])
        for key, value in batch.items()
    }
    return place_batch(rows, sharding, global_shape)


class LocalRowsAtStep:
    """Grain map: step -> this process's rows of that step's global batch (numpy).

    The batch at step s starts at sample first_sample + (s - first_step) * global_batch: the
    position a checkpoint recorded, so a run resumed with another batch size continues the order.
    """

    def __init__(
        self, batches: GlobalBatches, row_indices: np.ndarray, first_step: int, first_sample: int
    ):
        self.batches = batches
        self.row_indices = row_indices
        self.first_step = first_step
        self.first_sample = first_sample

    def __call__(self, step: int) -> Batch:
        position = self.first_sample + (int(step) - self.first_step) * self.batches.global_batch
        return self.batches.rows(position, self.row_indices)


def local_rows_dataset(
    batches: GlobalBatches,
    row_indices: np.ndarray,
    start_step: int,
    first_sample: int,
    num_workers: int,
) -> grain.IterDataset:
    """Steps start_step, start_step+1, ... as this process's rows, prepared by num_workers Grain
    processes (each takes every num_workers-th step; Grain returns them in order) or, with 0,
    by whoever iterates."""
    steps = grain.MapDataset.range(start_step, _NO_END)
    rows = steps.map(LocalRowsAtStep(batches, row_indices, start_step, first_sample))
    dataset = rows.to_iter_dataset()
    if num_workers > 0:
        _absl_flags_parsed()
        # A step's rows are small: copied through the worker queue rather than shared memory,
        # whose blocks still in flight when the iterator closes would leak until exit.
        copied = grain.experimental.DatasetOptions(min_shm_size=2**62)
        dataset = grain.experimental.WithOptionsIterDataset(dataset, copied)
        dataset = dataset.mp_prefetch(
            grain.MultiprocessingOptions(num_workers=num_workers),
            worker_init_fn=bound_to_worker,
        )
    return dataset


def bound_to_worker(index: int, count: int) -> None:
    """Run first in each Grain data process. SIGTERM and SIGINT are its worker's to act on (a
    scheduler signals every process: the worker saves, then closes this pipeline), and the data
    process ends as soon as its worker is gone, however the worker died, so no orphan is left."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = os.getppid()

    def exit_when_orphaned() -> None:
        # watched by process id: PR_SET_PDEATHSIG would fire when the *thread* that started
        # this process ends, which need not be the worker's end
        while os.getppid() == worker:
            time.sleep(ORPHAN_CHECK_S)
        os._exit(1)

    threading.Thread(target=exit_when_orphaned, name="msjax-orphan-check", daemon=True).start()


def _absl_flags_parsed() -> None:
    """Grain's worker processes read absl flags, which only absl.app.run parses otherwise."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class ShardedBatchIterator:
    """Yields (batch of global jax.Arrays, data_wait_s) for steps start_step, start_step+1, ...

    Grain prepares each step's local rows (in worker processes when num_workers > 0); with
    prefetch > 0 a daemon thread also places up to `prefetch` batches on the devices ahead of
    the caller's step. close() (or leaving a `with` block, or interpreter exit) stops both.
    """

    def __init__(
        self,
        batches: GlobalBatches,
        sharding: jax.sharding.Sharding,
        start_step: int,
        prefetch: int,
        num_workers: int = 0,
        first_sample: int | None = None,
    ):
        self._sharding = sharding
        self._global_shape = (batches.global_batch, batches.seq_len)
        blocks = local_row_blocks(sharding, self._global_shape)
        row_indices = np.concatenate([np.arange(start, stop) for start, stop in blocks])
        if first_sample is None:
            first_sample = start_step * batches.global_batch
        dataset = local_rows_dataset(batches, row_indices, start_step, first_sample, num_workers)
        self._rows = iter(dataset)
        self._next_step = start_step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if prefetch > 0:
            self._ready: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
            self._thread = threading.Thread(
                target=self._produce, name="msjax-batch-prefetch", daemon=True
            )
            self._thread.start()
        _LIVE_ITERATORS.add(self)

    def _next_batch(self) -> dict[str, jax.Array]:
        rows = next(self._rows)  # [local_rows, seq] each
        return place_batch(rows, self._sharding, self._global_shape)

    def _produce(self) -> None:
        while not self._stop.is_set():
            try:
                item: Any = self._next_batch()
            except Exception as error:
                item = _Failure(error)
            while not self._stop.is_set():
                try:
                    self._ready.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failure):
                return

    def __iter__(self) -> Iterator[tuple[dict[str, jax.Array], float]]:
        return self

    def __next__(self) -> tuple[dict[str, jax.Array], float]:
        if self._stop.is_set():
            raise StopIteration
        started = time.perf_counter()
        if self._thread is None:
            batch = self._next_batch()
        else:
            item = self._next_ready()
            if isinstance(item, _Failure):
                self.close()
                raise item.error
            batch = item
        self._next_step += 1
        return batch, time.perf_counter() - started

    def _next_ready(self) -> Any:
        while True:
            try:
                return self._ready.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set() or not self._thread.is_alive():  # closed meanwhile
                    raise StopIteration from None

    @property
    def next_step(self) -> int:
        """The step whose batch the next __next__ returns."""
        return self._next_step

    def close(self) -> None:
        """Stop the prefetch thread and the Grain workers; drop the batches they had ready."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            while not self._ready.empty():
                self._ready.get_nowait()
        close_rows = getattr(self._rows, "close", None)
        if close_rows is not None:
            close_rows()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


_LIVE_ITERATORS: weakref.WeakSet[ShardedBatchIterator] = weakref.WeakSet()


@atexit.register
def _close_live_iterators() -> None:
    for iterator in list(_LIVE_ITERATORS):
        iterator.close()


def sharded_batches(
    batches: GlobalBatches,
    sharding: jax.sharding.NamedSharding,
    start_step: int,
    prefetch: int,
    num_workers: int = 0,
    first_sample: int | None = None,
) -> ShardedBatchIterator:
    """Batches start_step, start_step+1, ... as global arrays placed with sharding (dim 0 over
    the data-parallel axes), each paired with the seconds the caller waited for it.

    first_sample: the global sample position of start_step's batch (a checkpoint's record);
    None: start_step * global_batch.
    """
    return ShardedBatchIterator(batches, sharding, start_step, prefetch, num_workers, first_sample)
