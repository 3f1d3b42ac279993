"""The default corpus: the running Python's standard-library `.py` sources, byte tokens.

It exists on every machine without a download. Library modules come first and tests fill the rest
of the `data.max_corpus_mib` budget; ~`data.eval_fraction` of documents are held out by path hash.
`stdlib_source` gives the same documents, split the same way, to be tokenized with any tokenizer
(msjax.data.sources, msjax.data.token_store).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from msjax.config import DataConfig
from msjax.data.text_files import decode_utf8, report_replaced
from msjax.data.token_store import Document, Report, TokenizedSource
from msjax.data.tokenizer import ByteTokenizer, Tokenizer
from msjax.errors import MsjaxError

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


@dataclass(frozen=True)
class CorpusFacts:
    """What was read, for the run record: where from, how much, and a fingerprint of it."""

    root: str
    python_version: str
    num_train_documents: int
    num_eval_documents: int
    train_bytes: int
    eval_bytes: int
    fingerprint: str  # crc32 of every document's bytes in reading order; same corpus, same value


@dataclass(frozen=True)
class Corpus:
    """Two token streams: each document's bytes followed by EOS, documents in path order."""

    train_tokens: np.ndarray  # [train_tokens] uint16
    eval_tokens: np.ndarray  # [eval_tokens] uint16
    train_documents: tuple[str, ...]  # paths relative to facts.root, in stream order
    eval_documents: tuple[str, ...]
    facts: CorpusFacts


def load_corpus(data: DataConfig) -> Corpus:
    """Read stdlib sources up to data.max_corpus_mib MiB and split them into train and eval."""
    root, selected = select_stdlib_documents(data.max_corpus_mib)
    documents: dict[str, list[tuple[str, bytes]]] = {"train": [], "eval": []}
    fingerprint = 0
    for relative_path, _ in selected:
        content = (root / relative_path).read_bytes()
        fingerprint = zlib.crc32(content, fingerprint)
        split = "eval" if is_eval_document(relative_path, data.eval_fraction) else "train"
        documents[split].append((relative_path, content))
    train, evaluation = documents["train"], documents["eval"]
    facts = CorpusFacts(
        root=str(root),
        python_version=sys.version.split()[0],
        num_train_documents=len(train),
        num_eval_documents=len(evaluation),
        train_bytes=sum(len(content) for _, content in train),
        eval_bytes=sum(len(content) for _, content in evaluation),
        fingerprint=f"{fingerprint:08x}",
    )
    return Corpus(
        train_tokens=_token_stream([content for _, content in train]),
        eval_tokens=_token_stream([content for _, content in evaluation]),
        train_documents=tuple(path for path, _ in train),
        eval_documents=tuple(path for path, _ in evaluation),
        facts=facts,
    )


def select_stdlib_documents(max_corpus_mib: int) -> tuple[Path, list[tuple[str, int]]]:
    """The stdlib root and the (relative path, size in bytes) of every document within budget."""
    root = Path(sysconfig.get_paths()["stdlib"])
    budget_bytes = max_corpus_mib * 2**20
    selected = []
    total_bytes = 0
    for relative_path in stdlib_source_paths(root):
        size_bytes = (root / relative_path).stat().st_size
        if total_bytes + size_bytes > budget_bytes:
            break  # whole documents only: the budget is an upper bound
        total_bytes += size_bytes
        selected.append((relative_path, size_bytes))
    if not selected:
        raise MsjaxError(
            f"no stdlib sources fit in data.max_corpus_mib={max_corpus_mib} under {root}; "
            "raise data.max_corpus_mib"
        )
    return root, selected


def stdlib_source_paths(root: Path) -> list[str]:
    """Every `.py` under root outside site-packages, library before tests, then by path."""
    paths = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [name for name in subdirectories if name not in _SKIPPED_DIRS]
        relative_dir = Path(directory).relative_to(root)
        paths.extend((relative_dir / name).as_posix() for name in files if name.endswith(".py"))
    # Tests last so that a small budget cuts tests, not library modules that sort after `test/`.
    return sorted(paths, key=lambda path: (_is_test(path), path))


def is_eval_document(relative_path: str, eval_fraction: float) -> bool:
    """Held out iff the path's crc32 falls in the lowest eval_fraction of 32-bit values."""
    # A stable hash (not Python's salted hash()): the same files are held out on every machine.
    return zlib.crc32(relative_path.encode("utf-8")) < eval_fraction * 2**32


def _is_test(relative_path: str) -> bool:
    return any(part in _TEST_DIRS for part in relative_path.split("/")[:-1])


def _token_stream(contents: list[bytes]) -> np.ndarray:
    """Documents' bytes as uint16 tokens, EOS after each: one vectorised copy, no Python loop."""
    lengths = np.array([len(content) for content in contents], dtype=np.int64)
    stream = np.empty(int(lengths.sum()) + len(contents), dtype=np.uint16)  # [bytes + documents]
    is_byte = np.ones(stream.size, dtype=bool)
    is_byte[np.cumsum(lengths + 1) - 1] = False
    stream[~is_byte] = ByteTokenizer.eos_id
    stream[is_byte] = np.frombuffer(b"".join(contents), dtype=np.uint8)
    return stream


def stdlib_source(data: DataConfig, tokenizer: Tokenizer, report: Report) -> TokenizedSource:
    """The stdlib source's cache key, facts and documents (the files data.max_corpus_mib keeps)."""
    root, selected = select_stdlib_documents(data.max_corpus_mib)
    listing = []
    for relative, size_bytes in selected:
        listing.append((relative, size_bytes, (root / relative).stat().st_mtime_ns))
    key = {
        "kind": "stdlib",
        "tokenizer": tokenizer.name,
        "root": str(root),
        "eval_fraction": data.eval_fraction,
        "files": listing,
    }
    # Thousands of files: the facts carry a digest of the listing rather than the listing.
    facts = {
        "kind": "stdlib",
        "root": str(root),
        "python_version": sys.version.split()[0],
        "num_files": len(listing),
        "files_sha256": hashlib.sha256(json.dumps(listing).encode()).hexdigest(),
    }
    # The byte tokenizer takes the raw bytes, as load_corpus does: a few stdlib test files are
    # deliberately not UTF-8, and their bytes stay exact.
    raw_bytes = isinstance(tokenizer, ByteTokenizer)

    def documents() -> Iterator[Document]:
        for relative, _, _ in listing:
            raw = (root / relative).read_bytes()
            held_out = is_eval_document(relative, data.eval_fraction)
            if raw_bytes:
                yield held_out, raw, 0
                continue
            text, replaced = decode_utf8(raw)
            if replaced:
                report_replaced(report, root / relative, replaced)
            yield held_out, text, replaced

    return TokenizedSource("stdlib", key, facts, documents)
