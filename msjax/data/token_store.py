"""Token arrays on disk: a `TokenStore` reads a range of a flat file through a memmap.

Stores are written atomically (`TokenStoreWriter`; a JSON sidecar marks them complete) and found
again (`open_token_store`); `open_token_file` reads a user's .bin or .npy in place. Writers report
the tokens they write (msjax/data/progress.py); `remove_abandoned_writes` clears a killed writer's.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from msjax.data.progress import report_progress
from msjax.data.progress import write_progress as write_progress  # where callers found it
from msjax.errors import MsjaxError

TOKEN_DTYPES = ("uint16", "uint32")


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
