"""Every long step of reading a corpus reports progress: hashing text files, scanning token files,
tokenizing one large file piece by piece; a supervised start-up that reads a large corpus under a
short data deadline is therefore not a hang."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from msjax.config import load_config
from msjax.data.progress import write_progress
from msjax.data.sources import load_sources
from msjax.data.text_files import decode_utf8
from msjax.data.token_store import TOKENIZE_PIECE_CHARS, document_pieces
from msjax.data.tokenizer import ByteTokenizer

MIB = 2**20


def text_corpus(path: Path, size_bytes: int) -> bytes:
    """A .txt of size_bytes: numbered lines of ASCII, so pieces can end at line ends."""
    lines = b"".join(
        b"line %08d of a large corpus, written for the test\n" % i for i in range(4096)
    )
    content = (lines * (size_bytes // len(lines) + 1))[:size_bytes]
    path.write_bytes(content)
    return content


def read_sources(overrides: list[str], messages: list[str] | None = None) -> tuple[list, list[int]]:
    """load_sources under write_progress: (the sources, every progress value reported)."""
    data = load_config(None, overrides).data
    seen: list[int] = []
    report = messages.append if messages is not None else lambda _: None
    with write_progress(seen.append):
        sources = load_sources(data, ByteTokenizer(), 264, report)
    return sources, seen


def test_hashing_and_tokenizing_one_large_text_file_report_progress_piece_by_piece(tmp_path):
    size_bytes = 9 * MIB  # 9 chunks hashed, 9 read, 10 pieces tokenized (each ends at a line)
    content = text_corpus(tmp_path / "book.txt", size_bytes)
    (source,), seen = read_sources(
        [
            f"data.sources={tmp_path}/book.txt",
            f"data.cache_dir={tmp_path}/cache",
            "data.eval_fraction=0",  # the one document is for training
        ]
    )
    assert seen == sorted(set(seen))  # it only grows
    hashed_then_read, tokenized = seen[:18], seen[18:]
    assert hashed_then_read == [MIB * (i + 1) for i in range(18)]  # a MiB at a time
    pieces = list(document_pieces(content.decode(), TOKENIZE_PIECE_CHARS))
    assert len(pieces) == 10 and len(tokenized) == len(pieces) + 1  # the pieces, then EOS
    assert tokenized[:-1] == [2 * size_bytes + sum(map(len, pieces[: i + 1])) for i in range(10)]
    assert seen[-1] == 3 * size_bytes + 1  # bytes hashed + bytes read + tokens written
    (train,) = source.train  # the pieces add up to the whole file: the tokens are exact
    stored = train.tokens()
    assert stored[-1] == ByteTokenizer.eos_id
    assert stored[:-1].tobytes() == np.frombuffer(content, np.uint8).astype(np.uint16).tobytes()


def test_a_text_file_read_a_chunk_at_a_time_decodes_as_it_would_whole(tmp_path):
    """Sequences split between two read chunks: a two-byte character, an undecodable byte pair
    and a U+FFFD of the input itself; the tokens and the replaced count are those of one read."""
    content = bytearray(text_corpus(tmp_path / "unused.txt", 3 * MIB))
    content[MIB - 1 : MIB + 1] = "é".encode()  # across the first chunk boundary
    content[2 * MIB - 1 : 2 * MIB + 1] = b"\xff\xfe"  # undecodable, one byte each side
    content[3 * MIB - 2 : 3 * MIB + 1] = "\ufffd".encode()  # 2 bytes, then 1 past 3 MiB
    content[5:6] = b"\x80"  # a lone continuation byte
    (tmp_path / "mixed.txt").write_bytes(bytes(content))
    messages: list[str] = []
    (source,), _ = read_sources(
        [f"data.sources={tmp_path}/mixed.txt", "data.eval_fraction=0",
         f"data.cache_dir={tmp_path}/cache"],
        messages,
    )  # fmt: skip
    whole, replaced = decode_utf8(bytes(content))
    assert replaced == 3  # 0xff, 0xfe, 0x80: the input's own U+FFFD is not counted
    assert messages[0] == f"{tmp_path}/mixed.txt: replaced 3 undecodable byte sequences with U+FFFD"
    (train,) = source.train
    assert train.tokens()[:-1].tobytes() == ByteTokenizer().encode(whole).tobytes()


def test_scanning_token_files_reports_each_chunk_and_each_file(tmp_path):
    sizes = (1000, 3000, 500)
    for index, tokens in enumerate(sizes):
        (np.arange(tokens) % 200).astype(np.uint16).tofile(tmp_path / f"part{index}.bin")
    overrides = [f"data.sources={tmp_path}/*.bin", f"data.cache_dir={tmp_path}/cache"]
    _, seen = read_sources(overrides)
    # per file: its bytes scanned for ids past the vocabulary, then one for the file
    expected, total = [], 0
    for tokens in sizes:
        total += 2 * tokens
        expected.append(total)
        total += 1
        expected.append(total)
    assert seen == expected
    _, again = read_sources(overrides)  # the checks are cached now: the files still count
    assert again == [1, 2, 3]


def test_pieces_end_after_a_newline_and_join_back_to_the_document():
    text = "".join(f"line {i}\n" for i in range(1000)) + "x" * 50  # 50 chars without a newline
    pieces = list(document_pieces(text, 100))
    assert "".join(pieces) == text
    assert all(piece.endswith("\n") and len(piece) <= 100 for piece in pieces[:-1])
    assert list(document_pieces("y" * 250, 100)) == ["y" * 100, "y" * 100, "y" * 50]
    assert list(document_pieces(b"ab\ncd", 100)) == [b"ab\ncd"]
