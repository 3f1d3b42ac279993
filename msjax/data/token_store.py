"""Token arrays on disk: a `TokenStore` reads a range of a flat file through a memmap.

Stores are written atomically (`TokenStoreWriter`; a JSON sidecar marks them complete) and found
again (`open_token_store`); `cached_stores` keeps a source's documents tokenized once, as a train
and an eval store found again by the source's key. Writers report the tokens they write
(msjax/data/progress.py); `remove_abandoned_writes` clears a killed writer's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from msjax.data.progress import report_progress
from msjax.data.progress import write_progress as write_progress  # where callers found it
from msjax.data.text_files import TextPieces
from msjax.data.tokenizer import Tokenizer, token_dtype
from msjax.errors import MsjaxError

TOKEN_DTYPES = ("uint16", "uint32")
# Bump when what a cached store holds for the same inputs changes (document rule, EOS placement).
# 2: documents over TOKENIZE_PIECE_CHARS are tokenized in pieces that end at line ends.
FORMAT_VERSION = 2
# A long document (a large .txt is one) is tokenized in pieces, each reported as progress, so
# one file is never minutes without a heartbeat; pieces end after a newline where there is one.
TOKENIZE_PIECE_CHARS = 2**20

Report = Callable[[str], None]
Document = tuple[bool, str | bytes | TextPieces, int]  # held out, its text, sequences replaced


class TokenizedSource(NamedTuple):
    """A text or stdlib source as cached_stores takes it: its label, its cache key,
    its facts, and its documents (read only on a cache miss)."""

    label: str
    key: dict[str, Any]
    facts: dict[str, Any]
    documents: Callable[[], Iterator[Document]]


def _writer_prefix(path: Path) -> str:
    # host and pid name the writer, so a later start can tell an abandoned file from a live one
    return f".{path.name}.{_host()}-{os.getpid()}."


def _host() -> str:
    return socket.gethostname().replace(".", "_")  # no dots: the name splits on them


def remove_abandoned_writes(directory: Path) -> list[Path]:
    """Delete the temporary files of writers on this host that died before committing."""
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        if not (entry.name.startswith(".") and entry.name.endswith(".tmp")):
            continue
        # .STORE.HOST-PID.RANDOM.tmp
        writer = entry.name.removesuffix(".tmp").rsplit(".", 2)[-2:][0]
        writer_host, _, pid = writer.rpartition("-")
        if writer_host == _host() and pid.isdigit() and not _process_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed.append(entry)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


@dataclass(frozen=True)
class TokenStore:
    """A contiguous range of tokens in a flat file on disk, read through a memmap."""

    path: Path
    dtype: str  # "uint16" | "uint32"
    start: int  # first token index within the file's token array
    stop: int  # one past the last
    header_bytes: int = 0  # .npy header; 0 for raw files

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    def tokens(self) -> np.ndarray:
        """The tokens as a read-only memmap view [num_tokens]; opened on first use."""
        cached = self.__dict__.get("_tokens")
        if cached is None:
            cached = _open_range(self)
            object.__setattr__(self, "_tokens", cached)  # a cache, not a field: never pickled
        return cached

    def __getstate__(self) -> dict[str, Any]:
        # Only the fields travel to spawned worker processes; each reopens its own memmap.
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)


def _open_range(store: TokenStore) -> np.ndarray:
    if store.num_tokens == 0:
        empty = np.empty(0, dtype=store.dtype)  # mmap cannot map zero bytes
        empty.flags.writeable = False
        return empty
    itemsize = np.dtype(store.dtype).itemsize
    return np.memmap(
        store.path,
        dtype=store.dtype,
        mode="r",
        offset=store.header_bytes + store.start * itemsize,
        shape=(store.num_tokens,),
    )


def sidecar_path(path: Path) -> Path:
    """Where the metadata JSON of the store at path lives."""
    return path.with_name(path.name + ".json")


class TokenStoreWriter:
    """Appends token arrays to a hidden temp file; `commit` makes the store and its sidecar visible.

    Use as a context manager: leaving it without a commit (an error mid-way) deletes the temp file,
    so a reader sees a complete store or none.
    """

    def __init__(self, path: Path, dtype: str):
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"token store dtype {dtype!r} is not one of {TOKEN_DTYPES}")
        self.path, self.dtype = Path(path), dtype
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.num_tokens = 0
        self._file = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed by commit or abort
            dir=self.path.parent, prefix=_writer_prefix(self.path), suffix=".tmp", delete=False
        )

    def append(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        self._file.write(ids.astype(self.dtype, copy=False).tobytes())
        self.num_tokens += ids.size
        report_progress(ids.size)

    def commit(self, metadata: dict[str, Any]) -> TokenStore:
        """Publish the store, then its sidecar (dtype, num_tokens, metadata), each atomically."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._file.name, self.path)
        _fsync_directory(self.path.parent)
        sidecar = {"dtype": self.dtype, "num_tokens": self.num_tokens, "metadata": metadata}
        write_atomically(sidecar_path(self.path), json.dumps(sidecar, indent=1).encode())
        return TokenStore(self.path, self.dtype, 0, self.num_tokens)

    def abort(self) -> None:
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file.name)

    def __enter__(self) -> TokenStoreWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._file.closed:
            self.abort()


def open_token_store(path: Path) -> tuple[TokenStore, dict[str, Any]] | None:
    """The complete store at path and its sidecar metadata; None if missing, partial or stale."""
    try:
        sidecar = json.loads(sidecar_path(path).read_bytes())
        dtype, num_tokens = sidecar["dtype"], int(sidecar["num_tokens"])
        size_bytes = path.stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if dtype not in TOKEN_DTYPES or size_bytes != num_tokens * np.dtype(dtype).itemsize:
        return None
    return TokenStore(path, dtype, 0, num_tokens), sidecar.get("metadata", {})


def write_atomically(path: Path, content: bytes) -> None:
    """Write content to path via a temp file in the same directory, fsync and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False
    ) as temp:
        try:
            temp.write(content)
            temp.flush()
            os.fsync(temp.fileno())
        except BaseException:
            temp.close()
            os.unlink(temp.name)
            raise
    os.replace(temp.name, path)
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    # The rename itself must reach the disk before the sidecar that vouches for it.
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# --- the tokenize-once cache of text and stdlib sources -----------------------------------------


def cached_stores(
    label: str,
    key: dict[str, Any],
    facts: dict[str, Any],
    documents: Callable[[], Iterator[Document]],
    tokenizer: Tokenizer,
    cache_dir: Path,
    report: Report,
) -> tuple[tuple[TokenStore, ...], tuple[TokenStore, ...], dict[str, Any]]:
    """The train and eval pieces (eval empty when no document is held out) and facts of the
    cached stores for key (a source's inputs; FORMAT_VERSION is added here), or documents()
    tokenized into them on a miss.

    documents() yields (held out, text, undecodable sequences replaced in it) per document.
    """
    key = {**key, "format": FORMAT_VERSION}
    key_digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    store_dir = cache_dir / "tokens" / key_digest[:32]
    train_path, eval_path = store_dir / "train.bin", store_dir / "eval.bin"
    train_found, eval_found = open_token_store(train_path), open_token_store(eval_path)
    if train_found is not None and eval_found is not None:
        (train, built_facts), (evaluation, _) = train_found, eval_found
        cache = "hit"
    else:
        for abandoned in remove_abandoned_writes(store_dir):
            report(f"{label}: removed {abandoned}, left by a writer that was stopped")
        train, evaluation, built_facts = _build_stores(
            label, facts, documents, tokenizer, train_path, eval_path
        )
        cache = "built"
        report(
            f"{label}: tokenized {built_facts['documents']} documents into "
            f"{built_facts['train_tokens']} train and {built_facts['eval_tokens']} eval tokens "
            f"in {store_dir}"
        )
    evaluation_pieces = (evaluation,) if evaluation.num_tokens else ()
    return (train,), evaluation_pieces, {**built_facts, "cache": cache, "store": str(store_dir)}


def _build_stores(
    label: str,
    facts: dict[str, Any],
    documents: Callable[[], Iterator[Document]],
    tokenizer: Tokenizer,
    train_path: Path,
    eval_path: Path,
) -> tuple[TokenStore, TokenStore, dict[str, Any]]:
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    counts = {"train": 0, "eval": 0}
    replaced = 0
    with TokenStoreWriter(train_path, dtype) as train, TokenStoreWriter(eval_path, dtype) as held:
        for held_out, text, replaced_in_text in documents():
            replaced += replaced_in_text
            writer = held if held_out else train
            for piece in document_pieces(text, TOKENIZE_PIECE_CHARS):
                writer.append(tokenizer.encode(piece))
            writer.append(eos)
            counts["eval" if held_out else "train"] += 1
        if not counts["eval"] and not counts["train"]:
            raise MsjaxError(f"data source {label}: every document's text is empty")
        if not counts["train"]:
            raise MsjaxError(
                f"data source {label}: all {counts['eval']} documents are held out for eval; "
                "add documents or lower data.eval_fraction"
            )
        built_facts = {
            **facts,
            "documents": counts["train"] + counts["eval"],
            "eval_documents": counts["eval"],
            "train_tokens": train.num_tokens,
            "eval_tokens": held.num_tokens,
            "replaced_undecodable": replaced,
            "tokenizer": tokenizer.name,
        }
        # Eval first: the train sidecar, written last, is what marks the pair complete.
        evaluation_store = held.commit({"split": "eval"})
        train_store = train.commit(built_facts)
    return train_store, evaluation_store, built_facts


def document_pieces(text: str | bytes | TextPieces, piece_chars: int) -> Iterator[str | bytes]:
    """text in consecutive pieces of about piece_chars, each ending after a newline where the
    piece holds one (a cut inside a line would change a subword tokenizer's tokens there); a .txt
    file's text comes in such pieces already."""
    if isinstance(text, tuple):
        yield from text
        return
    newline = "\n" if isinstance(text, str) else b"\n"
    start = 0
    while len(text) - start > piece_chars:
        end = text.rfind(newline, start, start + piece_chars) + 1 or start + piece_chars
        yield text[start:end]
        start = end
    yield text[start:]
