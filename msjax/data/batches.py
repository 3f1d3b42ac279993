"""The global sample order: a weighted mixture of packed sources, each reshuffled every epoch,
and the global batches cut from it, readable by sample position from any process.

Sample g of the order depends only on (seed, g, the sources and their weights), so the batch at
step s is the same for any number of processes or Grain workers. Pure numpy and Grain (no JAX).
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np

from msjax.data.packing import Batch, PackedSource, pack_rows
from msjax.errors import MsjaxError

EVAL_SEED = 0  # eval batches are the same for every run seed, so validation losses compare


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
