"""From the data config to what the loop consumes: the tokenizer, the global training order of
the source mixture, and the fixed validation batches. Every check on the data runs here, before
anything is written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from msjax.config import Config
from msjax.data.batches import Batch, GlobalBatches, PackedSource, eval_batch_list
from msjax.data.sources import SourceStreams, load_sources
from msjax.data.tokenizer import Tokenizer, load_tokenizer
from msjax.errors import MsjaxError


@dataclass(frozen=True)
class TrainingData:
    """The tokenizer, the training batches by step, and the validation batches of one run."""

    tokenizer: Tokenizer
    train: GlobalBatches
    validation: list[Batch]  # [global_batch, seq] arrays; empty when nothing is held out
    sources: list[SourceStreams]


def build_training_data(config: Config, report: Callable[[str], None]) -> TrainingData:
    """Load the tokenizer and sources (tokenizing into the cache when needed) and cut them."""
    data = config.data
    tokenizer = load_tokenizer(data.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise MsjaxError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} tokens (data.tokenizer={data.tokenizer}); raise "
            "model.vocab_size to at least that (a multiple of 128 is fast on GPUs)"
        )
    sources = load_sources(data, tokenizer, config.model.vocab_size, report)
    weights = [source.weight for source in data.sources]
    train_sources = [PackedSource(streams.train, data.seq_len) for streams in sources]
    for streams, packed in zip(sources, train_sources, strict=True):
        if packed.num_sequences == 0:
            raise MsjaxError(
                f"data source {streams.label} has no training tokens after holding out "
                f"data.eval_fraction={data.eval_fraction}; give it more text or remove it"
            )
    train = GlobalBatches(
        train_sources,
        weights,
        config.train.global_batch,
        config.run.seed,
        tokenizer.eos_id,
        data.cross_document_attention,
    )
    validation: list[Batch] = []
    if config.train.eval_every:
        validation = eval_batch_list(
            [PackedSource(streams.eval, data.seq_len) for streams in sources],
            weights,
            config.train.global_batch,
            config.train.eval_batches,
            tokenizer.eos_id,
            data.cross_document_attention,
        )
        if not validation:
            report(
                "warning: the held-out documents fill no validation batch; evaluation is off "
                "(raise data.eval_fraction or lower train.global_batch)"
            )
    return TrainingData(tokenizer, train, validation, sources)
