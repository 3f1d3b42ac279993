"""Rows and batches: each source's token pieces packed into fixed-length rows, and the global
sample order, a weighted mixture of the packed sources, each reshuffled every epoch, with the
global batches cut from it, readable by sample position from any process.

Packing cuts a source's pieces into windows of seq_len + 1 tokens, with the segment ids and
positions that keep attention and RoPE inside each document of a packed row. Sample g of the
order depends only on (seed, g, the sources and their weights), so the batch at step s is the
same for any number of processes or Grain workers.

Pure numpy and Grain (no JAX): these objects travel to Grain worker processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import grain
import numpy as np

from msjax.errors import MsjaxError

Batch = dict[str, np.ndarray]  # msjax.batch.BATCH_FIELDS: [rows, seq] int32
EVAL_SEED = 0  # eval batches are the same for every run seed, so validation losses compare


class TokenPiece(Protocol):
    """A flat run of tokens (documents, each followed by EOS), e.g. a TokenStore."""

    def tokens(self) -> np.ndarray: ...


class PackedSource:
    """One source split as sequences of seq_len + 1 tokens: inputs and targets are its two views.

    Sequence k of a piece covers its tokens [k*seq_len, (k+1)*seq_len + 1), so consecutive
    sequences share one token and every token is a target exactly once. The last sequence of a
    piece may be short; packing pads it, and the padding (segment 0) carries no loss. Sequences
    never cross pieces. Long documents simply continue into the next sequence.
    """

    def __init__(self, pieces: Sequence[TokenPiece], seq_len: int):
        self.pieces = tuple(pieces)
        self.seq_len = seq_len
        lengths = np.array([len(piece.tokens()) for piece in self.pieces], dtype=np.int64)
        counts = -(-np.maximum(lengths - 1, 0) // seq_len)  # ceil((tokens - 1) / seq_len)
        self._first_sequence = np.concatenate([[0], np.cumsum(counts)])  # [pieces + 1]
        self.num_tokens = int(lengths.sum())

    @property
    def num_sequences(self) -> int:
        return int(self._first_sequence[-1])

    def window(self, sequence_id: int) -> np.ndarray:
        """Tokens of sequence sequence_id: seq_len + 1 of them, fewer at the end of a piece."""
        piece = int(np.searchsorted(self._first_sequence, sequence_id, side="right")) - 1
        start = (sequence_id - int(self._first_sequence[piece])) * self.seq_len
        return np.asarray(self.pieces[piece].tokens()[start : start + self.seq_len + 1])


def pack_rows(
    windows: Sequence[np.ndarray], seq_len: int, eos_id: int, cross_document_attention: bool
) -> Batch:
    """Windows of up to seq_len + 1 tokens as one batch of rows, padded, with segments.

    Without cross-document attention an EOS input token opens a new segment: it ends the
    previous document as a target and acts as the beginning-of-document token of the next, whose
    positions restart at 0. With it, the row is one segment with positions 0..seq_len-1.
    Padding has segment id 0 and position 0.
    """
    rows = len(windows)
    padded = np.zeros((rows, seq_len + 1), dtype=np.int32)  # [rows, seq + 1]
    valid_lengths = np.empty(rows, dtype=np.int64)  # [rows] real input positions per row
    for row, window in enumerate(windows):
        padded[row, : len(window)] = window
        valid_lengths[row] = len(window) - 1
    inputs, targets = padded[:, :-1], padded[:, 1:]  # [rows, seq] each
    columns = np.arange(seq_len, dtype=np.int32)  # [seq]
    valid = columns[None, :] < valid_lengths[:, None]  # [rows, seq]
    if cross_document_attention:
        segment_ids = valid.astype(np.int32)
        positions = np.where(valid, columns[None, :], 0).astype(np.int32)
    else:
        starts = (inputs == eos_id) | (columns[None, :] == 0)  # [rows, seq] a document begins
        segment_ids = np.where(valid, np.cumsum(starts, axis=1), 0).astype(np.int32)
        last_start = np.maximum.accumulate(np.where(starts, columns[None, :], 0), axis=1)
        positions = np.where(valid, columns[None, :] - last_start, 0).astype(np.int32)
    return {
        "inputs": np.ascontiguousarray(np.where(valid, inputs, 0)),
        "targets": np.ascontiguousarray(np.where(valid, targets, 0)),
        "positions": positions,
        "segment_ids": segment_ids,
    }


class GlobalBatches:
    """Global batches of global_batch packed rows; row r of the batch at sample position p is
    sample p + r of the order. A run at step s with a constant batch is at position s * batch.
    """

    def __init__(
        self,
        sources: Sequence[PackedSource],
        weights: Sequence[float],
        global_batch: int,
        seed: int,
        eos_id: int,
        cross_document_attention: bool,
    ):
        if seed < 0:
            raise MsjaxError(f"run.seed={seed} must be a non-negative integer")
        if not sources or any(source.num_sequences == 0 for source in sources):
            raise ValueError("every source of a GlobalBatches needs at least one sequence")
        self.sources = tuple(sources)
        self.weights = tuple(float(weight) for weight in weights)
        self.global_batch = global_batch
        self.seq_len = sources[0].seq_len
        self.eos_id = eos_id
        self.cross_document_attention = cross_document_attention
        streams = []
        for index, source in enumerate(self.sources):
            # Grain folds the epoch into the shuffle seed as (seed + epoch), so nearby seeds
            # would share epochs; a mixed seed per (run seed, source) keeps them apart.
            shuffle_seed = int(np.random.SeedSequence([seed, index]).generate_state(1)[0])
            # repeat() after shuffle(): each epoch is a new permutation covering every sequence
            # once; a batch may straddle two epochs, so no sequence is ever dropped.
            stream = grain.MapDataset.range(source.num_sequences).shuffle(seed=shuffle_seed)
            streams.append(stream.repeat(None).map(_TagWithSource(index)))
        # A deterministic interleave in proportion to the weights: over any stretch of samples
        # each source's share is within one sample of its weight's share.
        self._order = streams[0] if len(streams) == 1 else grain.MapDataset.mix(streams, weights)

    def sample(self, position: int) -> tuple[int, int]:
        """(source index, sequence id) of sample `position` of the global order."""
        return self._order[position]

    def rows(self, first_sample: int, row_indices: Sequence[int]) -> Batch:
        """Rows row_indices of the global batch that starts at sample position first_sample."""
        windows = []
        for row in row_indices:
            source, sequence_id = self._order[first_sample + int(row)]
            windows.append(self.sources[source].window(sequence_id))
        return pack_rows(windows, self.seq_len, self.eos_id, self.cross_document_attention)

    def global_batch_at(self, step: int) -> Batch:
        """All rows of the batch at step (constant batch size): arrays [global_batch, seq_len]."""
        return self.rows(step * self.global_batch, range(self.global_batch))

    def epochs_at(self, samples: int) -> list[float]:
        """How many times each source has been seen after `samples` samples of the order."""
        total = sum(self.weights)
        return [
            samples * weight / total / source.num_sequences
            for weight, source in zip(self.weights, self.sources, strict=True)
        ]


class _TagWithSource:
    """Grain map: sequence id -> (source index, sequence id); a class so workers can unpickle it."""

    def __init__(self, source: int):
        self.source = source

    def __call__(self, sequence_id: int) -> tuple[int, int]:
        return self.source, int(sequence_id)


def eval_batch_list(
    sources: Sequence[PackedSource],
    weights: Sequence[float],
    global_batch: int,
    num_batches: int,
    eos_id: int,
    cross_document_attention: bool,
) -> list[Batch]:
    """The fixed validation set: the first batches of the held-out order under EVAL_SEED.

    At most num_batches, and fewer when the held-out sequences fill fewer batches, so that no
    sequence counts twice in the validation loss. Empty when nothing is held out.
    """
    kept = [(s, w) for s, w in zip(sources, weights, strict=True) if s.num_sequences > 0]
    if not kept:
        return []
    held_out = GlobalBatches(
        [s for s, _ in kept],
        [w for _, w in kept],
        global_batch,
        EVAL_SEED,
        eos_id,
        cross_document_attention,
    )
    # Sequences a batch may use without any source repeating one.
    total = sum(w for _, w in kept)
    distinct = min(int(s.num_sequences * total / w) for s, w in kept)
    count = min(num_batches, (distinct - len(kept)) // global_batch)  # slack for interleaving
    return [held_out.global_batch_at(step) for step in range(count)]
