"""Whether msjax can create and write a directory (checked before anything is written there), and
how it writes files: atomically, never through a symbolic link, a full disk dropping a write with
one warning rather than crashing."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

from msjax.errors import MsjaxError


def check_writable_dir(path: Path, name: str) -> None:
    """Raise MsjaxError (naming the config key `name`) unless path is, or can be made, a writable
    directory: not a file, not under a file, and in a folder this user may write."""
    path = Path(path).expanduser().absolute()
    if path.exists():
        if not path.is_dir():
            raise MsjaxError(f"{name}={path} exists and is not a directory; give a directory")
        if not _can_write_in(path):
            raise MsjaxError(f"{name}={path} is not writable by this user; give a writable one")
        return
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise MsjaxError(
                    f"{name}={path} is under {parent}, which is a file, not a directory"
                )
            if not _can_write_in(parent):
                raise MsjaxError(
                    f"{name}={path} cannot be created: {parent} is not writable by this user"
                )
            return


def _can_write_in(directory: Path) -> bool:
    """Whether a file can be made in directory; tried with a nameless temporary file (O_TMPFILE
    where the file system has it), so nothing is left behind, and root is not taken at its word."""
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


# ---- how msjax writes files: never through a link, never half, never fatal outside checkpoints

# In the name of every temporary file msjax writes before renaming it into place: the run dir's
# "holds no msjax run" check knows such leftovers of a killed writer as msjax's own.
TEMPORARY_MARK = ".msjax-tmp."
_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO must not block the opener
_WRITE_FLAGS = {"a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "w": os.O_WRONLY | os.O_CREAT}


class WriteFailed(OSError):
    """A file msjax could not write (disk full, I/O error): an infrastructure fault, not a user
    mistake; its message is one line naming the file."""


def is_temporary_name(name: str) -> bool:
    """Whether name is one of msjax's temporary files (`.NAME.msjax-tmp.PID.RANDOM`)."""
    return name.startswith(".") and TEMPORARY_MARK in name


def temporary_path(path: Path) -> Path:
    """A fresh temporary name beside path, unique across processes and hosts sharing the folder."""
    return path.with_name(f".{path.name}{TEMPORARY_MARK}{os.getpid()}.{secrets.token_hex(4)}")


def open_no_follow(path: Path, mode: str = "a") -> IO[Any]:
    """path opened for appending ("a", "ab") or writing from its start ("w", "wb", truncated)
    without following a symbolic link; OSError (ELOOP) for a link, and for anything but a regular
    file, so a planted link or FIFO never redirects or blocks a write."""
    descriptor = open_regular(path, _WRITE_FLAGS[mode[0]])
    try:
        if mode[0] == "w":
            os.ftruncate(descriptor, 0)
        return os.fdopen(descriptor, mode, **({} if "b" in mode else {"encoding": "utf-8"}))
    except BaseException:
        os.close(descriptor)
        raise


def open_regular(path: Path, flags: int) -> int:
    """A descriptor (os.open flags) of the regular file at path: a link is not followed (OSError
    ELOOP), anything but a regular file is refused (EINVAL), a FIFO does not block."""
    descriptor = os.open(path, flags | _NO_FOLLOW, 0o644)
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return descriptor


def read_no_follow(path: Path) -> bytes:
    """The bytes of a regular file, read without following a symbolic link (OSError otherwise)."""
    with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as file:
        return file.read()


def write_text_atomically(path: Path, text: str, durable: bool = True) -> None:
    """Write text to path through a temporary file, fsync (if durable) and rename: never half a
    file, and a link at path is replaced, not followed. A failure removes the temporary file and
    raises WriteFailed (one line)."""
    temporary = temporary_path(path)
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o644)
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            if durable:
                os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise WriteFailed(error.errno, f"cannot write {path}: {error.strerror}") from None


def write_json(path: Path, value: Any, indent: int = 2) -> None:
    """value as indented JSON and a newline, written atomically (write_text_atomically)."""
    write_text_atomically(path, json.dumps(value, indent=indent) + "\n")


def write_private_file(text: str, prefix: str, suffix: str, what: str) -> Path:
    """A new temporary file of this machine, readable by its owner alone, holding text; a
    failure raises WriteFailed (one line naming `what`)."""
    try:
        descriptor, name = tempfile.mkstemp(prefix=prefix, suffix=suffix)
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
    except OSError as error:
        raise WriteFailed(error.errno, f"cannot write {what}: {error}") from None
    return Path(name)


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_write_dropped(path: Path, error: OSError, outcome: str = "") -> None:
    """One line on stderr the first time a file of this process cannot be written; silence after."""
    with _warned_lock:
        if str(path) in _warned:
            return
        _warned.add(str(path))
    reason = error.strerror or str(error)
    outcome = outcome or "its writes are dropped while this lasts"
    print(
        f"msjax: warning: cannot write {path} ({reason}); {outcome}, training goes on",
        file=sys.stderr,
        flush=True,
    )


def rewrite_best_effort(path: Path, text: str) -> bool:
    """Replace path's content atomically; on a full disk, overwrite it in place where the new text
    fits in the blocks it already has (a reader may catch it torn and must skip it), else drop the
    write; one warning per file either way. Whether the text was written."""
    try:
        write_text_atomically(path, text, durable=False)  # rewritten often; the newest counts
        return True
    except OSError as error:
        failure = error
    data = text.encode()
    try:
        descriptor = open_regular(path, os.O_WRONLY)
    except OSError:
        warn_write_dropped(path, failure)
        return False
    try:
        if len(data) > os.fstat(descriptor).st_blocks * 512:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # the old text stays whole
        if os.pwrite(descriptor, data, 0) != len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.ftruncate(descriptor, len(data))
    except OSError:
        warn_write_dropped(path, failure)
        return False
    else:
        warn_write_dropped(path, failure, "it is rewritten in place while this lasts")
        return True
    finally:
        os.close(descriptor)


class AppendLog:
    """An append-only file (JSON lines, a log) that a full disk cannot crash: each write lands
    whole or not at all (a short write is cut back), and the first failure warns once; the file
    is opened without following a link. `write` takes str or bytes."""

    def __init__(self, path: Path):
        self.path = path
        self.dropped = 0  # writes that did not land
        self._descriptor: int | None = None
        self._closed = False
        self._open()

    def _open(self) -> None:
        if self._closed:
            return
        try:
            self._descriptor = open_regular(self.path, _WRITE_FLAGS["a"])
        except OSError as error:
            warn_write_dropped(self.path, error)

    def write(self, text: str | bytes) -> None:
        data = text if isinstance(text, bytes) else text.encode()
        if self._descriptor is None:
            self._open()  # it could not be made before (a full disk): perhaps it can now
        if self._descriptor is None:
            self.dropped += 1
            return
        size = None
        try:
            size = os.fstat(self._descriptor).st_size
            view = memoryview(data)
            while view:
                view = view[os.write(self._descriptor, view) :]
        except OSError as error:
            if size is not None:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._descriptor, size)  # no half line for a reader to trip on
            self.dropped += 1
            warn_write_dropped(self.path, error)

    def flush(self) -> None:
        """Each write already went to the kernel whole: nothing is buffered here."""

    def close(self) -> None:
        self._closed = True
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None
