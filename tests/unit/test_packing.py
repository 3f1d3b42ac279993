"""Packing documents into rows: every token once per epoch, segment ids and positions that
restart at each document, and a model that sees each packed document as if it were alone."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_data import EOS, SEQ_LEN, token_store
from test_data import store_dir as store_dir  # a fixture, re-exported for pytest

from msjax.config import ModelConfig
from msjax.data.batches import PackedSource, pack_rows
from msjax.models.transformer import Transformer
from msjax.resolve import resolve_model

# ---- packing ------------------------------------------------------------------------------------


def documents_stream(lengths: list[int], seed: int = 0) -> np.ndarray:
    """Documents of the given lengths (bytes 0..255), each followed by EOS."""
    rng = np.random.default_rng(seed)
    parts = [np.append(rng.integers(0, 256, length), EOS) for length in lengths]
    return np.concatenate(parts).astype(np.uint16)


def test_an_epoch_of_packed_sequences_holds_every_token_once_as_input_and_once_as_target(
    store_dir,
):
    pieces = [
        documents_stream([3, 40, 1, 17], seed=1),  # 65 tokens: not a multiple of SEQ_LEN
        documents_stream([2], seed=2),  # shorter than one sequence
        documents_stream([100, 5], seed=3),  # a document longer than a sequence
    ]
    stores = [token_store(tokens, store_dir, f"piece-{i}") for i, tokens in enumerate(pieces)]
    source = PackedSource(stores, SEQ_LEN)
    expected_counts = [-(-(len(tokens) - 1) // SEQ_LEN) for tokens in pieces]
    assert source.num_sequences == sum(expected_counts)
    epoch = pack_rows([source.window(i) for i in range(source.num_sequences)], SEQ_LEN, EOS, False)
    real = epoch["segment_ids"] != 0
    np.testing.assert_array_equal(
        epoch["inputs"][real], np.concatenate([tokens[:-1] for tokens in pieces])
    )
    np.testing.assert_array_equal(
        epoch["targets"][real], np.concatenate([tokens[1:] for tokens in pieces])
    )
    assert real.sum() == sum(len(tokens) - 1 for tokens in pieces)  # padding is all that is left


def expected_segments(inputs: list[int], eos: int) -> tuple[list[int], list[int]]:
    """Segment ids and positions by walking the row: an EOS input opens the next document."""
    segments, positions, segment, position = [], [], 1, 0
    for column, token in enumerate(inputs):
        if column > 0 and token == eos:
            segment, position = segment + 1, 0
        segments.append(segment)
        positions.append(position)
        position += 1
    return segments, positions


def test_segment_ids_and_positions_restart_at_every_document_and_padding_is_segment_zero():
    rng = np.random.default_rng(0)
    windows = [
        documents_stream([4, 7, 2, 30], seed=5)[: SEQ_LEN + 1],
        np.array([EOS, 1, 2, EOS, EOS, 3], dtype=np.uint16),  # starts with EOS, empty document
        rng.integers(0, 256, SEQ_LEN + 1).astype(np.uint16),  # one document, no EOS
    ]
    batch = pack_rows(windows, SEQ_LEN, EOS, cross_document_attention=False)
    for row, window in enumerate(windows):
        inputs = window[:-1].tolist()
        segments, positions = expected_segments(inputs, EOS)
        real = len(inputs)
        assert batch["segment_ids"][row, :real].tolist() == segments
        assert batch["positions"][row, :real].tolist() == positions
        assert batch["inputs"][row, :real].tolist() == inputs
        assert batch["targets"][row, :real].tolist() == window[1:].tolist()
        assert not batch["segment_ids"][row, real:].any()
        assert not batch["positions"][row, real:].any()
    assert batch["segment_ids"][1, :5].tolist() == [1, 1, 1, 2, 3]


def test_cross_document_attention_makes_each_row_one_segment_with_running_positions():
    windows = [documents_stream([4, 7, 30], seed=6)[: SEQ_LEN + 1], documents_stream([3])]
    batch = pack_rows(windows, SEQ_LEN, EOS, cross_document_attention=True)
    assert batch["segment_ids"][0].tolist() == [1] * SEQ_LEN
    assert batch["positions"][0].tolist() == list(range(SEQ_LEN))
    # 3 bytes and EOS: 3 inputs (the EOS is only a target), then padding.
    assert batch["segment_ids"][1].tolist() == [1] * 3 + [0] * (SEQ_LEN - 3)
    assert batch["positions"][1].tolist() == [0, 1, 2] + [0] * (SEQ_LEN - 3)


def test_model_on_a_packed_row_gives_each_document_the_logits_it_gets_alone():
    config = ModelConfig(
        vocab_size=264, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2, mlp_dim=64,
        init_std=0.2,
    )  # fmt: skip
    with nnx.use_eager_sharding(False):
        model = Transformer(resolve_model(config, jax.default_backend()), nnx.Rngs(params=0))
    window = documents_stream([5, 9, 12, 20], seed=8)[: SEQ_LEN + 1]
    batch = pack_rows([window], SEQ_LEN, EOS, cross_document_attention=False)
    packed = model(
        jnp.asarray(batch["inputs"]), jnp.asarray(batch["positions"]), batch["segment_ids"]
    )  # [1, seq, vocab]
    segments = batch["segment_ids"][0]
    assert len(set(segments.tolist())) == 4
    for segment in set(segments.tolist()):
        columns = np.flatnonzero(segments == segment)
        alone = model(jnp.asarray(batch["inputs"][:, columns]))  # positions 0.., one document
        np.testing.assert_allclose(packed[:, columns], alone, atol=2e-5, rtol=2e-5)
    crossing = pack_rows([window], SEQ_LEN, EOS, cross_document_attention=True)
    attends_across = model(jnp.asarray(crossing["inputs"]))
    last = np.flatnonzero(segments == segments.max())
    assert not np.allclose(attends_across[:, last], packed[:, last], atol=1e-3)
