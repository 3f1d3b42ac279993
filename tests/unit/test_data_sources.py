"""Specifications of corpus sources and the cached token store they are read through: file
formats, bad input, token files read in place, cache hits and rebuilds."""

import gzip
import hashlib
import json
import pickle
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from msjax.config import DataConfig, SourceConfig
from msjax.data.sources import load_sources, resolve_cache_dir
from msjax.data.stdlib_corpus import load_corpus
from msjax.data.token_store import TokenStore, TokenStoreWriter, open_token_store
from msjax.data.tokenizer import ByteTokenizer, load_tokenizer
from msjax.errors import MsjaxError

EVAL_FRACTION = 0.25
MODEL_VOCAB_SIZE = 264
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "naïve",
    "café",
    "✓",
    "sums",
    "of",
    "squares",
]
# 40 documents of a few sentences each, distinct so that a misplaced document shows.
DOCUMENTS = [
    " ".join(WORDS[(i + j) % len(WORDS)] for j in range(5 + i % 7)) + f" number {i}.\n"
    for i in range(40)
]


def data_config(tmp_path: Path, *sources, **overrides) -> DataConfig:
    """A DataConfig of the given paths or SourceConfigs with its cache inside tmp_path."""
    configs = tuple(
        s if isinstance(s, SourceConfig) else SourceConfig(path=str(s)) for s in sources
    )
    overrides.setdefault("eval_fraction", EVAL_FRACTION)
    return DataConfig(sources=configs, cache_dir=str(tmp_path / "cache"), **overrides)


def load(data: DataConfig, tokenizer=None, vocab_size: int = MODEL_VOCAB_SIZE):
    """The streams of data and the messages reported while loading them."""
    messages: list[str] = []
    tokenizer = tokenizer or load_tokenizer(data.tokenizer)
    return load_sources(data, tokenizer, vocab_size, messages.append), messages


def expected_streams(documents, encode, eos_id: int, eval_fraction: float = EVAL_FRACTION):
    """Train and eval token lists of (relative path, index in file, text) documents, by hand."""
    train, held_out = [], []
    for relative_path, index, text in documents:
        key = zlib.crc32(f"{relative_path}:{index}".encode())
        stream = held_out if key < eval_fraction * 2**32 else train
        stream.extend([*(int(i) for i in encode(text)), eos_id])
    return train, held_out


def tokens_of(stores) -> list[int]:
    return [int(i) for store in stores for i in store.tokens()]


def write_text_corpus(directory: Path) -> dict[str, list[tuple[str, int, str]]]:
    """Every text format holding slices of DOCUMENTS; per source glob, its documents in order."""
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(8):
        (directory / f"doc{i}.txt").write_text(DOCUMENTS[i], encoding="utf-8")
    records = [json.dumps({"id": i, "text": DOCUMENTS[i]}) for i in range(8, 20)]
    (directory / "a.jsonl").write_text("\n".join(records[:6]) + "\n\n")  # a blank line is skipped
    (directory / "b.jsonl").write_text("\n".join(records[6:]) + "\n")
    with gzip.open(directory / "c.jsonl.gz", "wt", encoding="utf-8") as file:
        file.write("\n".join(json.dumps({"body": text}) for text in DOCUMENTS[20:30]))
    pq.write_table(pa.table({"text": DOCUMENTS[30:40]}), directory / "d.parquet")
    return {
        "*.txt": [(f"doc{i}.txt", 0, DOCUMENTS[i]) for i in range(8)],
        "*.jsonl": [("a.jsonl", i, DOCUMENTS[8 + i]) for i in range(6)]
        + [("b.jsonl", i, DOCUMENTS[14 + i]) for i in range(6)],
        "c.jsonl.gz": [("c.jsonl.gz", i, DOCUMENTS[20 + i]) for i in range(10)],
        "d.parquet": [("d.parquet", i, DOCUMENTS[30 + i]) for i in range(10)],
    }


def test_rerun_with_unchanged_files_is_a_cache_hit_that_leaves_the_store_untouched(tmp_path):
    write_text_corpus(tmp_path / "corpus")
    data = data_config(tmp_path, tmp_path / "corpus" / "*.jsonl")
    (first,), first_messages = load(data)
    store_stat = first.train[0].path.stat()

    (again,), again_messages = load(data)

    assert first.facts["cache"] == "built" and any("tokenized" in m for m in first_messages)
    assert again.facts["cache"] == "hit" and again_messages == []
    assert again.train[0].path == first.train[0].path
    stat = again.train[0].path.stat()
    assert (stat.st_ino, stat.st_mtime_ns) == (store_stat.st_ino, store_stat.st_mtime_ns)
    assert tokens_of(again.train) == tokens_of(first.train)
    assert [f["path"] for f in again.facts["files"]] == ["a.jsonl", "b.jsonl"]
    sha256 = hashlib.sha256((tmp_path / "corpus" / "b.jsonl").read_bytes()).hexdigest()
    assert again.facts["files"][1]["sha256"] == sha256


def test_changing_one_file_rebuilds_the_store_with_its_new_content(tmp_path):
    corpus = write_text_corpus(tmp_path / "corpus")
    data = data_config(tmp_path, tmp_path / "corpus" / "*.txt")
    (first,), _ = load(data)
    (tmp_path / "corpus" / "doc5.txt").write_text("a rewritten fifth document")

    (changed,), _ = load(data)

    documents = [
        d if d[0] != "doc5.txt" else (d[0], 0, "a rewritten fifth document")
        for d in corpus["*.txt"]
    ]
    train, held_out = expected_streams(documents, str.encode, ByteTokenizer.eos_id)
    assert changed.facts["cache"] == "built"
    assert changed.train[0].path != first.train[0].path
    assert tokens_of(changed.train) + tokens_of(changed.eval) != tokens_of(first.train) + tokens_of(
        first.eval
    )
    assert (tokens_of(changed.train), tokens_of(changed.eval)) == (train, held_out)


def test_undecodable_bytes_are_replaced_counted_and_reported_with_the_file(tmp_path):
    # \xff is never UTF-8, \xe2\x82 is a cut-off sequence; the encoded U+FFFD is genuine text.
    raw = b"caf\xc3\xa9 \xff ok \xef\xbf\xbd end\xe2\x82"
    (tmp_path / "broken.txt").write_bytes(raw)
    (tmp_path / "broken.jsonl").write_bytes(b'{"text": "x\xfey"}\n{"text": "clean"}\n')
    data = data_config(
        tmp_path, tmp_path / "broken.txt", tmp_path / "broken.jsonl", eval_fraction=0
    )

    (text, jsonl), messages = load(data)

    assert text.facts["replaced_undecodable"] == 2 and jsonl.facts["replaced_undecodable"] == 1
    expected = raw.decode("utf-8", errors="replace").encode("utf-8")
    assert tokens_of(text.train) == [*expected, ByteTokenizer.eos_id]
    assert tokens_of(jsonl.train) == [*"x\ufffdy".encode(), 256, *b"clean", 256]
    assert f"{tmp_path / 'broken.txt'}: replaced 2 undecodable" in "\n".join(messages)
    assert f"{tmp_path / 'broken.jsonl'}: replaced 1 undecodable" in "\n".join(messages)


def write_bad_input(tmp_path: Path, case: str) -> SourceConfig:
    if case == "missing":
        return SourceConfig(path=str(tmp_path / "absent.txt"))
    if case == "glob_matches_nothing":
        return SourceConfig(path=str(tmp_path / "*.jsonl"))
    if case == "unknown_extension":
        (tmp_path / "table.csv").write_text("text\nhello\n")
        return SourceConfig(path=str(tmp_path / "table.csv"))
    if case == "empty_txt":
        (tmp_path / "empty.txt").write_bytes(b"")
        return SourceConfig(path=str(tmp_path / "empty.txt"))
    if case == "jsonl_not_json":
        (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": unquoted}\n')
        return SourceConfig(path=str(tmp_path / "bad.jsonl"))
    if case == "jsonl_missing_field":
        (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n')
        return SourceConfig(path=str(tmp_path / "bad.jsonl"))
    if case == "parquet_missing_column":
        pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "bad.parquet")
        return SourceConfig(path=str(tmp_path / "bad.parquet"))
    if case == "bin_partial_token":
        (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
        return SourceConfig(path=str(tmp_path / "odd.bin"))
    if case == "npy_two_dimensional":
        np.save(tmp_path / "grid.npy", np.zeros((2, 3), dtype=np.uint16))
        return SourceConfig(path=str(tmp_path / "grid.npy"))
    if case == "mixed_text_and_tokens":
        (tmp_path / "a.txt").write_text("text")
        np.save(tmp_path / "b.npy", np.arange(4, dtype=np.uint16))
        return SourceConfig(path=str(tmp_path / "*"))
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "named", "expected"),
    [
        ("missing", "absent.txt", "no such file"),
        ("glob_matches_nothing", "*.jsonl", "matches no files"),
        ("unknown_extension", "table.csv", r"unknown file type.*\.txt.*\.jsonl\.gz.*\.npy"),
        ("empty_txt", "empty.txt", "empty file"),
        ("jsonl_not_json", "bad.jsonl", "line 2: not valid JSON"),
        ("jsonl_missing_field", "bad.jsonl", "line 3: no field 'text'"),
        ("parquet_missing_column", "bad.parquet", "no column 'text'.*one of body"),
        ("bin_partial_token", "odd.bin", "3 bytes is not a whole number of uint16 tokens"),
        ("npy_two_dimensional", "grid.npy", "shape \\(2, 3\\).*1-D"),
        ("mixed_text_and_tokens", "*", "mixes text files and token files"),
    ],
)
def test_bad_input_is_one_line_naming_the_path_and_the_problem(tmp_path, case, named, expected):
    source = write_bad_input(tmp_path, case)
    with pytest.raises(MsjaxError, match=expected) as error:
        load(data_config(tmp_path, source))
    message = str(error.value)
    assert named in message and "\n" not in message
    assert not list((tmp_path / "cache").glob("tokens/*/*.bin"))  # nothing half-built is kept


def test_bin_token_file_is_read_in_place_with_each_files_tail_held_out(tmp_path):
    tokens = (np.arange(1000) % MODEL_VOCAB_SIZE).astype(np.uint32)
    tokens.tofile(tmp_path / "part0.bin")
    tokens[:400].tofile(tmp_path / "part1.bin")
    source = SourceConfig(path=str(tmp_path / "part*.bin"), token_dtype="uint32")

    (stream,), _ = load(data_config(tmp_path, source))

    assert [store.path for store in stream.train] == [
        tmp_path / "part0.bin",
        tmp_path / "part1.bin",
    ]
    assert [(s.start, s.stop) for s in stream.train] == [(0, 750), (0, 300)]
    assert [(s.start, s.stop) for s in stream.eval] == [(750, 1000), (300, 400)]
    assert tokens_of(stream.train) == tokens[:750].tolist() + tokens[:300].tolist()
    assert tokens_of(stream.eval) == tokens[750:].tolist() + tokens[300:400].tolist()
    assert stream.facts["train_tokens"] == 1050 and stream.facts["eval_tokens"] == 350
    assert not (tmp_path / "cache" / "tokens").exists()  # no copy was made


def test_npy_token_file_is_read_past_its_header_with_the_dtype_it_declares(tmp_path):
    tokens = np.array([5, 70000, 3, 9], dtype=np.uint32)
    np.save(tmp_path / "ids.npy", tokens)

    (stream,), _ = load(
        data_config(tmp_path, tmp_path / "ids.npy", eval_fraction=0), vocab_size=2**17
    )

    (store,) = stream.train
    assert (store.dtype, store.header_bytes, store.num_tokens) == ("uint32", 128, 4)
    assert store.tokens().tolist() == [5, 70000, 3, 9] and stream.eval == ()


def test_token_ids_at_or_beyond_the_vocab_size_are_refused_naming_file_and_offset(tmp_path):
    tokens = np.full(100, 7, dtype=np.uint16)
    tokens[37], tokens[60] = MODEL_VOCAB_SIZE, MODEL_VOCAB_SIZE + 50
    tokens.tofile(tmp_path / "ids.bin")
    with pytest.raises(MsjaxError, match=r"ids\.bin: token id 264 at token offset 37 is not below"):
        load(data_config(tmp_path, tmp_path / "ids.bin"))


def test_a_passed_vocab_check_is_remembered_for_that_file_and_vocab_size_only(tmp_path):
    (np.arange(300) % 250).astype(np.uint16).tofile(tmp_path / "ids.bin")
    data = data_config(tmp_path, tmp_path / "ids.bin")

    (first,), _ = load(data)
    (again,), _ = load(data)

    assert (first.facts["cache"], again.facts["cache"]) == ("built", "hit")
    with pytest.raises(MsjaxError, match="token id 200 at token offset 200"):
        load(data, vocab_size=200)


def test_token_store_pickles_only_its_fields_and_reads_again_after_unpickling(tmp_path):
    tokens = np.arange(100_000, dtype=np.uint32)
    np.save(tmp_path / "ids.npy", tokens)
    store = TokenStore(tmp_path / "ids.npy", "uint32", 1000, 99_000, header_bytes=128)
    assert store.tokens()[0] == 1000  # opened before pickling

    restored = pickle.loads(pickle.dumps(store))

    assert len(pickle.dumps(store)) < 1000  # fields, not 392 KB of tokens or an open mmap
    assert restored == store
    np.testing.assert_array_equal(restored.tokens(), tokens[1000:99_000])
    assert not restored.tokens().flags.writeable


def test_store_without_its_sidecar_or_with_a_wrong_size_is_rebuilt(tmp_path):
    write_text_corpus(tmp_path / "corpus")
    data = data_config(tmp_path, tmp_path / "corpus" / "*.txt")
    (first,), _ = load(data)
    train_path = first.train[0].path
    expected = tokens_of(first.train)

    Path(f"{train_path}.json").unlink()  # as if the process died before marking it complete
    (without_sidecar,), _ = load(data)
    with train_path.open("r+b") as file:
        file.truncate(10)  # a sidecar vouching for more tokens than the file holds
    (truncated,), _ = load(data)

    assert without_sidecar.facts["cache"] == "built" and truncated.facts["cache"] == "built"
    assert tokens_of(without_sidecar.train) == expected == tokens_of(truncated.train)


def test_store_writer_left_without_commit_leaves_nothing_behind(tmp_path):
    path = tmp_path / "store" / "train.bin"
    with pytest.raises(RuntimeError), TokenStoreWriter(path, "uint16") as writer:
        writer.append(np.arange(10))
        raise RuntimeError("tokenizing failed")
    assert list(path.parent.iterdir()) == []
    assert open_token_store(path) is None

    with TokenStoreWriter(path, "uint16") as writer:
        writer.append(np.arange(10))
        store = writer.commit({"documents": 1})
    assert open_token_store(path) == (store, {"documents": 1})
    assert store.tokens().tolist() == list(range(10))


def test_stdlib_source_with_the_byte_tokenizer_holds_exactly_the_load_corpus_tokens(tmp_path):
    data = data_config(tmp_path, "stdlib", max_corpus_mib=1, eval_fraction=0.1)
    corpus = load_corpus(data)

    (stream,), _ = load(data)
    (again,), _ = load(data)

    np.testing.assert_array_equal(stream.train[0].tokens(), corpus.train_tokens)
    np.testing.assert_array_equal(stream.eval[0].tokens(), corpus.eval_tokens)
    assert stream.facts["documents"] == len(corpus.train_documents) + len(corpus.eval_documents)
    assert (stream.facts["kind"], stream.facts["cache"], again.facts["cache"]) == (
        "stdlib",
        "built",
        "hit",
    )


def test_cache_dir_is_the_configured_one_else_the_environment_else_the_home_cache(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("MSJAX_CACHE_DIR", str(tmp_path / "from_env"))
    assert resolve_cache_dir(DataConfig(cache_dir="~/mine")) == Path.home() / "mine"
    assert resolve_cache_dir(DataConfig()) == tmp_path / "from_env"
    monkeypatch.delenv("MSJAX_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_cache_dir(DataConfig()) == tmp_path / ".cache" / "msjax"
