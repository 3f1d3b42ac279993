"""Specifications of the data path: byte tokenizer, stdlib corpus, deterministic Grain batches."""

import os
import socket
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from msjax.config import DataConfig
from msjax.data.pipeline import (
    TokenBatches,
    eval_batches,
    local_row_blocks,
    place_global_batch,
    sharded_batches,
)
from msjax.data.stdlib_corpus import is_eval_document, load_corpus, stdlib_source_paths
from msjax.data.tokenizer import ByteTokenizer
from msjax.errors import MsjaxError

SEQ_LEN = 32
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(DataConfig(max_corpus_mib=1, eval_fraction=0.1))


@pytest.fixture(scope="module")
def batch_sharding():
    mesh = jax.make_mesh(
        (2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3
    )
    return NamedSharding(mesh, P(("data", "fsdp"), None))


def synthetic_tokens(num_sequences: int, seq_len: int) -> np.ndarray:
    """A stream whose sequence i starts with token i, so a row names its sequence."""
    tokens = np.arange(num_sequences * seq_len + 1) // seq_len  # [num_sequences * seq_len + 1]
    return tokens.astype(np.uint16)


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


def test_every_token_is_below_the_tokenizer_vocab_size(corpus):
    batches = TokenBatches(corpus.train_tokens, SEQ_LEN, GLOBAL_BATCH, seed=0)
    assert corpus.train_tokens.max() < 257 and corpus.eval_tokens.max() < 257
    for step in range(20):
        batch = batches.global_batch_at(step)
        assert batch["inputs"].max() < 257 and batch["targets"].max() < 257


def test_targets_are_inputs_shifted_by_one_within_a_contiguous_window(corpus):
    tokens = corpus.train_tokens
    batch = TokenBatches(tokens, SEQ_LEN, GLOBAL_BATCH, seed=3).global_batch_at(7)
    assert {key: (value.shape, value.dtype) for key, value in batch.items()} == {
        key: ((GLOBAL_BATCH, SEQ_LEN), np.int32)
        for key in ("inputs", "targets", "positions", "segment_ids")
    }
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    stream_windows = np.lib.stride_tricks.sliding_window_view(tokens, SEQ_LEN + 1)[::SEQ_LEN]
    for inputs, targets in zip(batch["inputs"], batch["targets"], strict=False):
        window = np.concatenate([inputs, targets[-1:]])  # [seq + 1]
        assert (stream_windows == window).all(axis=1).any()  # cut at a multiple of seq_len
    np.testing.assert_array_equal(
        batch["positions"], np.tile(np.arange(SEQ_LEN), (GLOBAL_BATCH, 1))
    )
    np.testing.assert_array_equal(batch["segment_ids"], np.ones((GLOBAL_BATCH, SEQ_LEN)))


def test_same_seed_and_step_give_identical_batches_from_separate_instances(corpus):
    first = TokenBatches(corpus.train_tokens, SEQ_LEN, GLOBAL_BATCH, seed=11)
    second = TokenBatches(corpus.train_tokens.copy(), SEQ_LEN, GLOBAL_BATCH, seed=11)
    for step in (0, 1, 57, 10_000):
        assert_batches_equal(second.global_batch_at(step), first.global_batch_at(step))


def test_different_step_or_seed_gives_different_batch(corpus):
    seed_0 = TokenBatches(corpus.train_tokens, SEQ_LEN, GLOBAL_BATCH, seed=0)
    seed_1 = TokenBatches(corpus.train_tokens, SEQ_LEN, GLOBAL_BATCH, seed=1)
    batch = seed_0.global_batch_at(5)["inputs"]
    assert not np.array_equal(seed_0.global_batch_at(6)["inputs"], batch)
    assert not np.array_equal(seed_1.global_batch_at(5)["inputs"], batch)


def test_each_epoch_covers_every_sequence_once_in_a_new_order():
    num_sequences, seq_len, global_batch = 24, 4, 4
    batches = TokenBatches(synthetic_tokens(num_sequences, seq_len), seq_len, global_batch, seed=0)
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


def test_nearby_seeds_do_not_share_shifted_epoch_orders():
    # Grain alone seeds epoch e with (seed + e): seed 1's first epoch would be seed 0's second.
    num_sequences, seq_len = 16, 4
    tokens = synthetic_tokens(num_sequences, seq_len)
    seed_0 = TokenBatches(tokens, seq_len, num_sequences, seed=0)
    seed_1 = TokenBatches(tokens, seq_len, num_sequences, seed=1)
    assert not np.array_equal(
        seed_1.global_batch_at(0)["inputs"], seed_0.global_batch_at(1)["inputs"]
    )


def test_sharded_iterator_places_each_global_batch_with_the_batch_sharding(corpus, batch_sharding):
    batches = TokenBatches(corpus.train_tokens, SEQ_LEN, GLOBAL_BATCH, seed=0)
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
    corpus, batch_sharding, prefetch
):
    batches = TokenBatches(corpus.train_tokens, SEQ_LEN, GLOBAL_BATCH, seed=4)
    with sharded_batches(batches, batch_sharding, start_step=0, prefetch=2) as uninterrupted:
        from_zero = [next(uninterrupted)[0] for _ in range(8)]
    resumed_at = 5
    with sharded_batches(batches, batch_sharding, resumed_at, prefetch) as resumed:
        for expected in from_zero[resumed_at:]:
            assert_batches_equal(next(resumed)[0], {k: np.asarray(v) for k, v in expected.items()})


TWO_PROCESS_WORKER = """
import sys
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from msjax.config import DataConfig
from msjax.data.pipeline import TokenBatches, local_row_blocks, sharded_batches
from msjax.data.stdlib_corpus import load_corpus

port, process_id = sys.argv[1], int(sys.argv[2])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
batches = TokenBatches(load_corpus(DataConfig(max_corpus_mib=1)).train_tokens, 32, 16, seed=0)
axis_types = (jax.sharding.AxisType.Auto,) * 3
mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=axis_types)
sharding = NamedSharding(mesh, P(("data", "fsdp"), None))
print("msjax rows", local_row_blocks(sharding, (16, 32)))
with sharded_batches(batches, sharding, start_step=2, prefetch=2) as iterator:
    for step in (2, 3, 4):
        batch, _ = next(iterator)
        gathered = multihost_utils.process_allgather(batch["inputs"], tiled=True)
        assert np.array_equal(gathered, batches.global_batch_at(step)["inputs"]), step
print("msjax batches equal")
"""


def test_two_processes_each_read_half_the_rows_and_build_the_same_global_batch():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "4", "PYTHONPATH": str(root)}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_PROCESS_WORKER, str(port), str(process_id)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for process_id in (0, 1)
    ]
    outputs = [worker.communicate(timeout=120) for worker in workers]
    for worker, (_stdout, stderr) in zip(workers, outputs, strict=False):
        assert worker.returncode == 0, stderr[-2000:]
    ours = [
        [line for line in stdout.splitlines() if line.startswith("msjax")] for stdout, _ in outputs
    ]
    assert ours == [
        ["msjax rows [(0, 8)]", "msjax batches equal"],
        ["msjax rows [(8, 16)]", "msjax batches equal"],
    ]


def test_closing_the_iterator_stops_its_prefetch_thread(corpus, batch_sharding):
    batches = TokenBatches(corpus.train_tokens, SEQ_LEN, GLOBAL_BATCH, seed=0)
    iterator = sharded_batches(batches, batch_sharding, start_step=0, prefetch=2)
    next(iterator)
    assert any(thread.name == "msjax-batch-prefetch" for thread in threading.enumerate())
    iterator.close()
    assert not iterator._thread.is_alive()
    with pytest.raises(StopIteration):
        next(iterator)


def test_eval_batches_are_a_fixed_list_independent_of_the_run_seed(corpus, batch_sharding):
    first = eval_batches(corpus.eval_tokens, SEQ_LEN, GLOBAL_BATCH, num_batches=3)
    second = eval_batches(corpus.eval_tokens.copy(), SEQ_LEN, GLOBAL_BATCH, num_batches=3)
    assert len(first) == 3
    for a, b in zip(first, second, strict=False):
        assert_batches_equal(a, b)
    assert not np.array_equal(first[0]["inputs"], first[1]["inputs"])
    placed = place_global_batch(first[0], batch_sharding)
    assert_batches_equal(placed, first[0])
    assert placed["inputs"].sharding.is_equivalent_to(batch_sharding, 2)


def test_eval_batches_never_repeat_a_sequence_when_the_split_is_small():
    tokens = synthetic_tokens(num_sequences=10, seq_len=4)
    batches = eval_batches(tokens, seq_len=4, global_batch=4, num_batches=5)
    assert len(batches) == 2  # 10 sequences hold 2 full batches of 4
    seen = np.concatenate([batch["inputs"][:, 0] for batch in batches]).tolist()
    assert len(set(seen)) == len(seen) == 8


def test_split_smaller_than_one_global_batch_is_a_one_line_error():
    tokens = synthetic_tokens(num_sequences=5, seq_len=16)
    with pytest.raises(MsjaxError) as error:
        TokenBatches(tokens, seq_len=16, global_batch=8, seed=0, split="eval")
    message = str(error.value)
    assert "\n" not in message
    assert "5 sequences" in message and "train.global_batch=8" in message
    assert "data.seq_len=16" in message and "data.eval_fraction" in message


def test_corpus_is_deterministic_and_a_larger_budget_extends_it(corpus):
    again = load_corpus(DataConfig(max_corpus_mib=1, eval_fraction=0.1))
    assert again.facts == corpus.facts
    np.testing.assert_array_equal(again.train_tokens, corpus.train_tokens)
    larger = load_corpus(DataConfig(max_corpus_mib=2, eval_fraction=0.1))
    assert larger.train_documents[: len(corpus.train_documents)] == corpus.train_documents
    assert larger.eval_documents[: len(corpus.eval_documents)] == corpus.eval_documents
    assert larger.facts.train_bytes > corpus.facts.train_bytes
