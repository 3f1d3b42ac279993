"""Specifications of the data path: byte tokenizer, stdlib corpus, the global sample order of a
weighted mixture, batches placed on devices by any process count, and validation batches."""

import threading
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from msjax.config import DataConfig
from msjax.data.batches import GlobalBatches, PackedSource, eval_batch_list
from msjax.data.pipeline import local_row_blocks, place_global_batch, sharded_batches
from msjax.data.stdlib_corpus import is_eval_document, load_corpus, stdlib_source_paths
from msjax.data.token_store import TokenStore
from msjax.data.tokenizer import ByteTokenizer

SEQ_LEN = 32


GLOBAL_BATCH = 8


EOS = ByteTokenizer.eos_id


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(DataConfig(max_corpus_mib=1, eval_fraction=0.1))


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("token-stores")


def token_store(tokens: np.ndarray, directory: Path, name: str) -> TokenStore:
    """tokens written as a raw token file, read back through a TokenStore."""
    path = directory / f"{name}.bin"
    tokens.astype(np.uint16).tofile(path)
    return TokenStore(path, "uint16", 0, len(tokens))


@pytest.fixture(scope="module")
def train_source(corpus, store_dir):
    return PackedSource([token_store(corpus.train_tokens, store_dir, "stdlib-train")], SEQ_LEN)


def batches_of(*sources: PackedSource, weights=None, seed=0, cross=False, batch=GLOBAL_BATCH):
    weights = weights or [1.0] * len(sources)
    return GlobalBatches(list(sources), weights, batch, seed, EOS, cross)


@pytest.fixture(scope="module")
def batch_sharding():
    mesh = jax.make_mesh(
        (2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3
    )
    return NamedSharding(mesh, P(("data", "fsdp"), None))


def synthetic_source(num_sequences: int, seq_len: int, directory: Path, offset: int = 0):
    """A one-piece source whose sequence i starts with token offset + i, so a row names it."""
    tokens = offset + np.arange(num_sequences * seq_len + 1) // seq_len  # [sequences * seq + 1]
    name = f"synthetic-{num_sequences}-{seq_len}-{offset}"
    return PackedSource([token_store(tokens, directory, name)], seq_len)


def assert_batches_equal(actual, expected):
    assert actual.keys() == expected.keys()
    for key in expected:
        np.testing.assert_array_equal(np.asarray(actual[key]), expected[key], err_msg=key)


def test_byte_tokenizer_round_trips_utf8_text_and_shows_eos_as_newline():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("héllo ✓", add_eos=True)
    assert ids.dtype == np.uint16
    assert ids.tolist() == [*"héllo ✓".encode(), 256]
    assert tokenizer.vocab_size == 257 and tokenizer.eos_id == 256
    assert tokenizer.decode(ids) == "héllo ✓\n"
    assert tokenizer.decode([104, 105, 260]) == "hi\ufffd"


def test_corpus_streams_are_exactly_the_listed_stdlib_files_each_followed_by_eos(corpus):
    root = Path(corpus.facts.root)
    for documents, tokens in (
        (corpus.train_documents, corpus.train_tokens),
        (corpus.eval_documents, corpus.eval_tokens),
    ):
        expected = b"".join(
            ByteTokenizer().encode((root / path).read_bytes(), add_eos=True).tobytes()
            for path in documents
        )
        assert tokens.dtype == np.uint16
        assert tokens.tobytes() == expected
        assert int((tokens == 256).sum()) == len(documents)
    assert corpus.facts.train_bytes + corpus.facts.eval_bytes <= 2**20
    assert corpus.facts.num_eval_documents == len(corpus.eval_documents) > 0


def test_corpus_reads_library_modules_before_tests_and_skips_site_packages(corpus):
    paths = stdlib_source_paths(Path(corpus.facts.root))
    assert not any("site-packages" in path for path in paths)
    first_test = next(i for i, path in enumerate(paths) if path.startswith("test/"))
    assert "unittest/case.py" in paths[:first_test]  # sorts after test/, read before it
    read = corpus.train_documents + corpus.eval_documents
    assert all(not path.startswith("test/") for path in read)  # 1 MiB holds no tests


def test_eval_split_shares_no_document_with_train_split(corpus):
    train, held_out = set(corpus.train_documents), set(corpus.eval_documents)
    assert not train & held_out
    assert all(is_eval_document(path, 0.1) for path in held_out)
    assert not any(is_eval_document(path, 0.1) for path in train)
    assert all(zlib.crc32(path.encode()) < 0.1 * 2**32 for path in held_out)


def test_every_token_is_below_the_tokenizer_vocab_size(corpus, train_source):
    batches = batches_of(train_source)
    assert corpus.train_tokens.max() < 257 and corpus.eval_tokens.max() < 257
    for step in range(20):
        batch = batches.global_batch_at(step)
        assert batch["inputs"].max() < 257 and batch["targets"].max() < 257


def test_targets_are_inputs_shifted_by_one_within_a_contiguous_window(corpus, train_source):
    tokens = corpus.train_tokens
    batch = batches_of(train_source, seed=3).global_batch_at(7)
    assert {key: (value.shape, value.dtype) for key, value in batch.items()} == {
        key: ((GLOBAL_BATCH, SEQ_LEN), np.int32)
        for key in ("inputs", "targets", "positions", "segment_ids")
    }
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    stream_windows = np.lib.stride_tricks.sliding_window_view(tokens, SEQ_LEN + 1)[::SEQ_LEN]
    for inputs, targets in zip(batch["inputs"], batch["targets"], strict=True):
        window = np.concatenate([inputs, targets[-1:]])  # [seq + 1]
        assert (stream_windows == window).all(axis=1).any()  # cut at a multiple of seq_len


def test_same_seed_and_step_give_identical_batches_from_separate_instances(store_dir, corpus):
    first = batches_of(PackedSource([token_store(corpus.train_tokens, store_dir, "a")], SEQ_LEN))
    second = batches_of(PackedSource([token_store(corpus.train_tokens, store_dir, "b")], SEQ_LEN))
    for step in (0, 1, 57, 10_000):
        assert_batches_equal(second.global_batch_at(step), first.global_batch_at(step))


def test_different_step_or_seed_gives_different_batch(train_source):
    seed_0, seed_1 = batches_of(train_source, seed=0), batches_of(train_source, seed=1)
    batch = seed_0.global_batch_at(5)["inputs"]
    assert not np.array_equal(seed_0.global_batch_at(6)["inputs"], batch)
    assert not np.array_equal(seed_1.global_batch_at(5)["inputs"], batch)


def test_each_epoch_covers_every_sequence_once_in_a_new_order(store_dir):
    num_sequences, seq_len, global_batch = 24, 4, 4
    batches = batches_of(synthetic_source(num_sequences, seq_len, store_dir), batch=global_batch)
    steps_per_epoch = num_sequences // global_batch
    epochs = [
        np.concatenate(
            [
                batches.global_batch_at(epoch * steps_per_epoch + step)["inputs"][:, 0]
                for step in range(steps_per_epoch)
            ]
        ).tolist()
        for epoch in range(3)
    ]
    for order in epochs:
        assert sorted(order) == list(range(num_sequences))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
    assert epochs[0] != list(range(num_sequences))  # shuffled, not stream order


def test_nearby_seeds_do_not_share_shifted_epoch_orders(store_dir):
    # Grain alone seeds epoch e with (seed + e): seed 1's first epoch would be seed 0's second.
    source = synthetic_source(16, 4, store_dir)
    seed_0, seed_1 = batches_of(source, seed=0, batch=16), batches_of(source, seed=1, batch=16)
    assert not np.array_equal(
        seed_1.global_batch_at(0)["inputs"], seed_0.global_batch_at(1)["inputs"]
    )


def test_mixture_gives_each_source_its_weighted_share_of_every_stretch_of_batches(store_dir):
    # Three sources with disjoint first tokens: 0.., 1000.., 2000..; weights 5:3:2.
    sources = [synthetic_source(n, 4, store_dir, offset=1000 * i) for i, n in enumerate([7, 50, 3])]
    batches = batches_of(*sources, weights=[5.0, 3.0, 2.0], batch=10)
    first_tokens = np.concatenate(
        [batches.global_batch_at(step)["inputs"][:, 0] for step in range(300)]
    )  # [3000]
    shares = np.bincount(first_tokens // 1000, minlength=3) / len(first_tokens)
    np.testing.assert_allclose(shares, [0.5, 0.3, 0.2], atol=0.005)
    for stretch in first_tokens.reshape(-1, 100):  # each 10 batches, not just on average
        np.testing.assert_allclose(np.bincount(stretch // 1000, minlength=3), [50, 30, 20], atol=2)
    # Each source cycles through all of its own sequences, whatever the others do.
    from_small = first_tokens[first_tokens >= 2000][:6] - 2000
    assert sorted(from_small[:3].tolist()) == sorted(from_small[3:].tolist()) == [0, 1, 2]
    assert batches.epochs_at(3000) == pytest.approx([1500 / 7, 900 / 50, 600 / 3])


def test_sharded_iterator_places_each_global_batch_with_the_batch_sharding(
    train_source, batch_sharding
):
    batches = batches_of(train_source)
    assert local_row_blocks(batch_sharding, (GLOBAL_BATCH, SEQ_LEN)) == [(0, GLOBAL_BATCH)]
    with sharded_batches(batches, batch_sharding, start_step=0, prefetch=2) as iterator:
        for step in range(3):
            batch, data_wait_s = next(iterator)
            assert data_wait_s >= 0.0
            expected = batches.global_batch_at(step)
            assert_batches_equal(batch, expected)
            for array in batch.values():
                assert array.shape == (GLOBAL_BATCH, SEQ_LEN)
                assert array.sharding.is_equivalent_to(batch_sharding, array.ndim)
            rows_per_shard = GLOBAL_BATCH // 4  # dim 0 over data x fsdp, replicated over tensor
            for shard in batch["inputs"].addressable_shards:
                assert shard.data.shape == (rows_per_shard, SEQ_LEN)
                np.testing.assert_array_equal(
                    np.asarray(shard.data), expected["inputs"][shard.index]
                )


@pytest.mark.parametrize("prefetch", [0, 3])
def test_iterator_started_at_step_k_yields_the_batches_of_an_uninterrupted_run(
    train_source, batch_sharding, prefetch
):
    batches = batches_of(train_source, seed=4)
    with sharded_batches(batches, batch_sharding, start_step=0, prefetch=2) as uninterrupted:
        from_zero = [next(uninterrupted)[0] for _ in range(8)]
    resumed_at = 5
    with sharded_batches(batches, batch_sharding, resumed_at, prefetch) as resumed:
        for expected in from_zero[resumed_at:]:
            assert_batches_equal(next(resumed)[0], {k: np.asarray(v) for k, v in expected.items()})


def test_a_recorded_sample_position_continues_the_order_after_a_batch_size_change(
    train_source, batch_sharding
):
    # 5 steps of 8 rows consumed samples 0..39; the resumed run takes 16 rows a step from 40 on.
    small, large = batches_of(train_source, seed=2), batches_of(train_source, seed=2, batch=16)
    with sharded_batches(large, batch_sharding, 5, prefetch=0, first_sample=40) as resumed:
        for offset in range(3):
            expected = {
                key: np.concatenate([first[key], second[key]])
                for first, second in [
                    (small.global_batch_at(5 + 2 * offset), small.global_batch_at(6 + 2 * offset))
                ]
                for key in first
            }
            assert_batches_equal(next(resumed)[0], expected)


def test_closing_the_iterator_stops_its_prefetch_thread(train_source, batch_sharding):
    iterator = sharded_batches(batches_of(train_source), batch_sharding, start_step=0, prefetch=2)
    next(iterator)
    assert any(thread.name == "msjax-batch-prefetch" for thread in threading.enumerate())
    iterator.close()
    assert not iterator._thread.is_alive()
    with pytest.raises(StopIteration):
        next(iterator)


def test_eval_batches_are_a_fixed_list_independent_of_the_run_seed(
    corpus, store_dir, batch_sharding
):
    held_out = PackedSource([token_store(corpus.eval_tokens, store_dir, "eval")], SEQ_LEN)
    first = eval_batch_list([held_out], [1.0], GLOBAL_BATCH, 3, EOS, False)
    second = eval_batch_list([held_out], [1.0], GLOBAL_BATCH, 3, EOS, False)
    assert len(first) == 3
    for a, b in zip(first, second, strict=True):
        assert_batches_equal(a, b)
    assert not np.array_equal(first[0]["inputs"], first[1]["inputs"])
    placed = place_global_batch(first[0], batch_sharding)
    assert_batches_equal(placed, first[0])
    assert placed["inputs"].sharding.is_equivalent_to(batch_sharding, 2)


def test_eval_batches_never_repeat_a_sequence_when_the_split_is_small(store_dir):
    held_out = synthetic_source(num_sequences=10, seq_len=4, directory=store_dir)
    batches = eval_batch_list([held_out], [1.0], 4, 5, EOS, False)
    assert len(batches) == 2  # 10 sequences hold 2 full batches of 4
    seen = np.concatenate([batch["inputs"][:, 0] for batch in batches]).tolist()
    assert len(set(seen)) == len(seen) == 8
    empty = PackedSource([], 4)
    assert eval_batch_list([empty], [1.0], 4, 5, EOS, False) == []


def test_corpus_is_deterministic_and_a_larger_budget_extends_it(corpus):
    again = load_corpus(DataConfig(max_corpus_mib=1, eval_fraction=0.1))
    assert again.facts == corpus.facts
    np.testing.assert_array_equal(again.train_tokens, corpus.train_tokens)
    larger = load_corpus(DataConfig(max_corpus_mib=2, eval_fraction=0.1))
    assert larger.train_documents[: len(corpus.train_documents)] == corpus.train_documents
    assert larger.eval_documents[: len(corpus.eval_documents)] == corpus.eval_documents
    assert larger.facts.train_bytes > corpus.facts.train_bytes
