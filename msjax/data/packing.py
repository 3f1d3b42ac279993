"""Packing: a source's token pieces cut into fixed-length windows, and the segment ids and
positions that keep attention and RoPE inside each document of a packed row.

Pure numpy (no JAX): these objects travel to Grain worker processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

Batch = dict[str, np.ndarray]  # msjax.batch.BATCH_FIELDS: [rows, seq] int32


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
