"""Corpus sources to token streams: stdlib, text files (tokenized once, cached), token files.

Each `data.sources` entry becomes a `SourceStreams` of train and eval `TokenStore` pieces, every
document's tokens followed by EOS. A text or stdlib source says what its cache key and documents
are; `token_store.cached_stores` keeps them tokenized. Packing the streams into rows is
`batches.py`'s job.
"""

from __future__ import annotations

import glob
import hashlib
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from msjax.config import DataConfig, SourceConfig
from msjax.data.progress import report_progress
from msjax.data.stdlib_corpus import stdlib_source
from msjax.data.text_files import report_replaced, text_documents
from msjax.data.token_store import (
    Document,
    Report,
    TokenizedSource,
    TokenStore,
    cached_stores,
    write_atomically,
)
from msjax.data.tokenizer import Tokenizer, check_tokenizer_spec
from msjax.errors import MsjaxError

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
TOKEN_SUFFIXES = (".bin", ".npy")
_SCAN_CHUNK_TOKENS = 2**24  # vocabulary check of token files: 32-64 MiB of memmap at a time
_HASH_CHUNK_BYTES = 2**20


@dataclass(frozen=True)
class SourceStreams:
    """One configured source as train and eval token pieces, each documents' tokens + EOS."""

    label: str  # the source path as configured
    train: tuple[TokenStore, ...]
    eval: tuple[TokenStore, ...]  # empty when no document is held out
    facts: dict[str, Any]  # JSON-able, for the run record: kind, files, documents, tokens, cache


def resolve_cache_dir(data: DataConfig) -> Path:
    """data.cache_dir, else $MSJAX_CACHE_DIR, else ~/.cache/msjax."""
    configured = data.cache_dir or os.environ.get("MSJAX_CACHE_DIR") or "~/.cache/msjax"
    return Path(configured).expanduser()


def load_sources(
    data: DataConfig, tokenizer: Tokenizer, vocab_size: int, report: Report
) -> list[SourceStreams]:
    """Every data.sources entry as token streams, in config order, tokenizing only on a cache miss.

    Token files are checked against vocab_size (the model's); text sources are tokenized with
    tokenizer, whose vocab_size the caller checks against the model's.
    """
    cache_dir = resolve_cache_dir(data)
    streams = []
    for source in data.sources:
        if source.path != "stdlib":
            files = _match_files(source.path)
            kinds = {_file_kind(path) for path, _ in files}
            if kinds == {"tokens"}:
                streams.append(_token_file_source(source, data, files, vocab_size, cache_dir))
                continue
            if "tokens" in kinds:
                raise MsjaxError(
                    f"data.sources path {source.path!r} mixes text files and token files "
                    f"({', '.join(TOKEN_SUFFIXES)}); give them as separate sources"
                )
            tokenized = _text_source(source, data, files, tokenizer, cache_dir, report)
        else:
            tokenized = stdlib_source(data, tokenizer, report)
        label, key, facts, documents = tokenized
        stored = cached_stores(label, key, facts, documents, tokenizer, cache_dir, report)
        streams.append(SourceStreams(label, *stored))
    return streams


def check_sources(data: DataConfig) -> None:
    """Every data.sources path names files of a known kind, and data.tokenizer is `byte` or a
    file: what a run can be told before it starts (nothing is read or written)."""
    for source in data.sources:
        if source.path != "stdlib":
            kinds = {_file_kind(path) for path, _ in _match_files(source.path)}
            if len(kinds) > 1:
                raise MsjaxError(
                    f"data.sources path {source.path!r} mixes text files and token files "
                    f"({', '.join(TOKEN_SUFFIXES)}); give them as separate sources"
                )
    check_tokenizer_spec(data.tokenizer)


# --- finding files ---------------------------------------------------------------------------


def _match_files(pattern: str) -> list[tuple[Path, str]]:
    """(path, path relative to the pattern's fixed directory) of each file, sorted by the latter."""
    expanded = os.path.expanduser(pattern)
    if not any(char in expanded for char in "*?["):
        path = Path(expanded)
        if path.is_dir():
            raise MsjaxError(
                f"data.sources path {pattern!r} is a directory; give a file or a glob "
                f"such as {pattern.rstrip('/')}/*.jsonl"
            )
        if not path.is_file():
            raise MsjaxError(f"data.sources path {pattern!r}: no such file")
        return [(path, path.name)]
    fixed_parts = []
    for part in Path(expanded).parts:
        if any(char in part for char in "*?["):
            break
        fixed_parts.append(part)
    base = Path(*fixed_parts) if fixed_parts else Path()
    matches = [Path(match) for match in glob.glob(expanded, recursive=True)]
    files = [(path, path.relative_to(base).as_posix()) for path in matches if path.is_file()]
    if not files:
        raise MsjaxError(f"data.sources path {pattern!r} matches no files")
    return sorted(files, key=lambda item: item[1])


def _file_kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    if name.endswith(TOKEN_SUFFIXES):
        return "tokens"
    raise MsjaxError(
        f"{path}: unknown file type; data.sources accepts {', '.join(TEXT_SUFFIXES)} (text) "
        f"and {', '.join(TOKEN_SUFFIXES)} (token ids)"
    )


# --- text sources: tokenized once into a cached store ------------------------------------------


def _text_source(
    source: SourceConfig,
    data: DataConfig,
    files: list[tuple[Path, str]],
    tokenizer: Tokenizer,
    cache_dir: Path,
    report: Report,
) -> TokenizedSource:
    """A text source's cache key, facts and documents (its files hashed, remembered by stat)."""
    hashes = [(relative, _file_sha256(path, cache_dir)) for path, relative in files]
    key = {
        "kind": "text",
        "tokenizer": tokenizer.name,
        "text_field": source.text_field,
        "eval_fraction": data.eval_fraction,
        "files": hashes,
    }
    files_facts = [{"path": relative, "sha256": sha256} for relative, sha256 in hashes]

    def documents() -> Iterator[Document]:
        for path, relative in files:
            replaced_in_file = 0
            for index, text, replaced in text_documents(path, source.text_field):
                replaced_in_file += replaced
                # The stdlib rule (is_eval_document) with the document's index in its file.
                held_out = zlib.crc32(f"{relative}:{index}".encode()) < data.eval_fraction * 2**32
                yield held_out, text, replaced
            if replaced_in_file:
                report_replaced(report, path, replaced_in_file)

    facts = {"kind": "text", "num_files": len(files), "files": files_facts}
    return TokenizedSource(source.path, key, facts, documents)


def _file_sha256(path: Path, cache_dir: Path) -> str:
    """sha256 of path's content, remembered by (path, size, mtime, inode) to skip re-reading."""
    stat = path.stat()
    identity = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}"
    memo = cache_dir / "file_sha256" / hashlib.sha256(identity.encode()).hexdigest()[:32]
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
            report_progress(len(chunk))
    write_atomically(memo, digest.hexdigest().encode())
    return digest.hexdigest()


# --- pre-tokenized sources: read in place ------------------------------------------------------


def open_token_file(path: Path, bin_dtype: str) -> TokenStore:
    """The whole token array of a .bin (dtype from the config) or .npy (dtype from its header)."""
    size_bytes = path.stat().st_size
    if size_bytes == 0:
        raise MsjaxError(f"{path}: empty file; a token file needs at least one token")
    if path.name.lower().endswith(".bin"):
        itemsize = np.dtype(bin_dtype).itemsize
        if size_bytes % itemsize:
            raise MsjaxError(
                f"{path}: {size_bytes} bytes is not a whole number of {bin_dtype} tokens; "
                "set token_dtype of this data source to the dtype the file was written with"
            )
        return TokenStore(path, bin_dtype, 0, size_bytes // itemsize)
    with path.open("rb") as file:
        try:
            version = np.lib.format.read_magic(file)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(file)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(file)
            else:  # 3.0 only differs for structured dtypes with non-ASCII field names
                raise ValueError(f"npy format {version}")
        except ValueError:
            raise MsjaxError(f"{path}: not a readable .npy file") from None
        header_bytes = file.tell()
    if len(shape) != 1 or dtype.str not in ("<u2", "<u4"):
        raise MsjaxError(
            f"{path}: holds a {dtype} array of shape {shape}; token .npy files must hold a "
            "1-D little-endian uint16 or uint32 array"
        )
    if shape[0] == 0:
        raise MsjaxError(f"{path}: holds no tokens; a token file needs at least one")
    if header_bytes + shape[0] * dtype.itemsize > size_bytes:
        raise MsjaxError(f"{path}: truncated; its header promises {shape[0]} tokens")
    return TokenStore(path, dtype.name, 0, shape[0], header_bytes)


def _token_file_source(
    source: SourceConfig,
    data: DataConfig,
    files: list[tuple[Path, str]],
    vocab_size: int,
    cache_dir: Path,
) -> SourceStreams:
    train, evaluation, files_facts = [], [], []
    all_checks_cached = True
    for path, relative in files:
        whole = open_token_file(path, source.token_dtype)
        all_checks_cached &= _check_token_ids(whole, vocab_size, cache_dir)
        report_progress(1)  # a file checked, even when its check was cached
        # The tail of each file is held out: token files carry no document boundaries we know.
        eval_tokens = int(whole.num_tokens * data.eval_fraction)
        split = whole.stop - eval_tokens
        train.append(TokenStore(path, whole.dtype, 0, split, whole.header_bytes))
        if eval_tokens:
            evaluation.append(TokenStore(path, whole.dtype, split, whole.stop, whole.header_bytes))
        stat = path.stat()
        files_facts.append(
            {"path": relative, "size_bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        )
    facts = {
        "kind": "tokens",
        "num_files": len(files),
        "files": files_facts,
        "documents": None,  # boundaries are whatever EOS ids the files hold
        "eval_documents": None,
        "train_tokens": sum(store.num_tokens for store in train),
        "eval_tokens": sum(store.num_tokens for store in evaluation),
        "replaced_undecodable": 0,
        "tokenizer": None,  # made elsewhere; only checked against the vocabulary size
        "vocab_size_checked": vocab_size,
        "cache": "hit" if all_checks_cached else "built",
    }
    return SourceStreams(source.path, tuple(train), tuple(evaluation), facts)


def _check_token_ids(store: TokenStore, vocab_size: int, cache_dir: Path) -> bool:
    """Raise if an id is >= vocab_size; True when a cached check of this very file said so."""
    if np.iinfo(store.dtype).max < vocab_size:
        return True  # no id of this dtype can reach the vocabulary size
    stat = store.path.stat()
    identity = (
        f"{store.path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{vocab_size}\0"
        f"{store.dtype}\0{store.header_bytes}"
    )
    memo = cache_dir / "vocab_checks" / hashlib.sha256(identity.encode()).hexdigest()[:32]
    if memo.is_file():
        return True
    tokens = store.tokens()
    for chunk_start in range(0, tokens.size, _SCAN_CHUNK_TOKENS):
        chunk = tokens[chunk_start : chunk_start + _SCAN_CHUNK_TOKENS]
        maximum = int(chunk.max())
        report_progress(chunk.nbytes)
        if maximum >= vocab_size:
            offset = chunk_start + int(np.argmax(chunk >= vocab_size))
            raise MsjaxError(
                f"{store.path}: token id {int(tokens[offset])} at token offset {offset} is not "
                f"below the model's vocab size {vocab_size}; raise model.vocab_size or re-make "
                "the file with a matching tokenizer"
            )
    write_atomically(memo, b"ok\n")
    return False
