"""Token stream -> global batches: a Grain MapDataset with random access by step, and the
prefetching iterator that places each process's rows on its devices as one global jax.Array.

The batch at step s depends only on (tokens, seq_len, global_batch, seed, s), so a run resumed at
step k sees exactly what an uninterrupted run sees. Document packing and boundaries come later.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Self

import grain
import jax
import numpy as np

from msjax.errors import MsjaxError

Batch = dict[str, np.ndarray]
EVAL_SEED = 0  # eval batches are the same for every run seed, so validation losses compare


class TokenBatches:
    """Global batches of one split, readable at any step.

    Sequence i is tokens[i*seq_len : (i+1)*seq_len + 1]. Grain shuffles the sequence ids and
    repeats them endlessly, each epoch in a new order; the rows of step s are elements
    s*global_batch ... (s+1)*global_batch - 1 of that stream.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        global_batch: int,
        seed: int,
        split: str = "train",
    ):
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.num_sequences = max(len(tokens) - 1, 0) // seq_len
        if self.num_sequences < global_batch:
            raise MsjaxError(
                f"the {split} split has {len(tokens)} tokens = {self.num_sequences} sequences of "
                f"data.seq_len={seq_len}, fewer than one global batch (train.global_batch="
                f"{global_batch}); lower train.global_batch or data.seq_len, or raise "
                "data.max_corpus_mib" + (" or data.eval_fraction" if split == "eval" else "")
            )
        if seed < 0:
            raise MsjaxError(f"run.seed={seed} must be a non-negative integer")
        # Grain folds the epoch into the shuffle seed as (seed + epoch), so seed 1 epoch 0 would
        # equal seed 0 epoch 1; a mixed seed keeps runs with nearby seeds apart.
        shuffle_seed = int(np.random.SeedSequence(seed).generate_state(1, np.uint32)[0])
        # repeat() after shuffle(): every epoch is a new permutation and covers each sequence
        # once; a batch may straddle two epochs, so no sequence is ever dropped.
        self._sequence_ids = (
            grain.MapDataset.range(self.num_sequences).shuffle(seed=shuffle_seed).repeat(None)
        )
        self._batched_ids = self._sequence_ids.batch(global_batch, drop_remainder=True)
        self._tokens = tokens
        self._offsets = np.arange(seq_len + 1)  # [seq + 1]

    @property
    def steps_per_epoch(self) -> float:
        return self.num_sequences / self.global_batch

    def global_batch_at(self, step: int) -> Batch:
        """All rows of the batch at step: arrays [global_batch, seq_len], int32."""
        return self._examples(self._batched_ids[step])

    def rows_at(self, step: int, row_blocks: list[tuple[int, int]]) -> Batch:
        """Only the rows [start, stop) of each block of the batch at step, concatenated in order."""
        first = step * self.global_batch
        rows = [first + row for start, stop in row_blocks for row in range(start, stop)]
        return self._examples(np.array([self._sequence_ids[row] for row in rows]))

    def _examples(self, sequence_ids: np.ndarray) -> Batch:
        """Each sequence's window of seq_len + 1 tokens; inputs and targets are its two views."""
        starts = sequence_ids.astype(np.int64) * self.seq_len  # [rows]
        windows = self._tokens[starts[:, None] + self._offsets].astype(np.int32)  # [rows, seq + 1]
        rows = len(sequence_ids)
        return {
            "inputs": np.ascontiguousarray(windows[:, :-1]),  # [rows, seq]
            "targets": np.ascontiguousarray(windows[:, 1:]),  # [rows, seq]
            "positions": np.tile(np.arange(self.seq_len, dtype=np.int32), (rows, 1)),  # [rows, seq]
            "segment_ids": np.ones(
                (rows, self.seq_len), dtype=np.int32
            ),  # one segment until packing
        }


def eval_batches(
    tokens: np.ndarray, seq_len: int, global_batch: int, num_batches: int
) -> list[Batch]:
    """The fixed validation set: the first batches of the eval split under EVAL_SEED.

    At most num_batches, and fewer when the split holds fewer full batches, so that no
    sequence counts twice in the validation loss.
    """
    batches = TokenBatches(tokens, seq_len, global_batch, seed=EVAL_SEED, split="eval")
    count = min(num_batches, batches.num_sequences // global_batch)
    return [batches.global_batch_at(step) for step in range(count)]


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


class ShardedBatchIterator:
    """Yields (batch of global jax.Arrays, data_wait_s) for steps start_step, start_step+1, ...

    With prefetch > 0 a daemon thread reads and places up to `prefetch` batches ahead while the
    caller's step runs; close() (or leaving a `with` block, or interpreter exit) stops it.
    """

    def __init__(
        self,
        batches: TokenBatches,
        sharding: jax.sharding.Sharding,
        start_step: int,
        prefetch: int,
    ):
        self._batches = batches
        self._sharding = sharding
        self._global_shape = (batches.global_batch, batches.seq_len)
        self._row_blocks = local_row_blocks(sharding, self._global_shape)
        self._next_step = start_step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if prefetch > 0:
            self._ready: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
            self._thread = threading.Thread(
                target=self._produce, args=(start_step,), name="msjax-batch-prefetch", daemon=True
            )
            self._thread.start()
            _LIVE_ITERATORS.add(self)

    def _batch_at(self, step: int) -> dict[str, jax.Array]:
        rows = self._batches.rows_at(step, self._row_blocks)  # [local_rows, seq] each
        return place_batch(rows, self._sharding, self._global_shape)

    def _produce(self, step: int) -> None:
        while not self._stop.is_set():
            try:
                item: Any = self._batch_at(step)
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
            step += 1

    def __iter__(self) -> Iterator[tuple[dict[str, jax.Array], float]]:
        return self

    def __next__(self) -> tuple[dict[str, jax.Array], float]:
        if self._stop.is_set():
            raise StopIteration
        started = time.perf_counter()
        if self._thread is None:
            batch = self._batch_at(self._next_step)
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
        """Stop the prefetch thread and drop the batches it had ready."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            while not self._ready.empty():
                self._ready.get_nowait()

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
    batches: TokenBatches,
    sharding: jax.sharding.NamedSharding,
    start_step: int,
    prefetch: int,
) -> ShardedBatchIterator:
    """Batches start_step, start_step+1, ... as global arrays placed with sharding (dim 0 over
    the data-parallel axes), each paired with the seconds the caller waited for it."""
    return ShardedBatchIterator(batches, sharding, start_step, prefetch)
