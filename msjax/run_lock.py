"""One job per run directory: an exclusive `flock` on RUN_DIR/job.lock, held for the job's life.

The kernel drops the lock when its holder exits, however it exits (SIGKILL included), so a killed
job never blocks the rerun. The job holds it, not each worker: `msjax.launch` (node 0) or a
`msjax.train` that no launcher started (process 0).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from msjax.errors import MsjaxError
from msjax.loop_events import LoopEvents
from msjax.run_dir import RunDir
from msjax.writable import open_regular, read_no_follow


class RunDirLock(LoopEvents):
    """The exclusive lock on one run directory; `acquire` refuses a directory in use. As a loop
    listener it lets go when the loop ends, however it ends."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        self._file: int | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> None:
        """Take the lock (the directory must exist); MsjaxError if another job holds it.

        A refused job writes nothing: the lock file is only created when there is none yet, and
        only the holder writes who it is into it.
        """
        if self.held:
            return
        path = self.run_dir.lock
        try:  # never through a link: the file it points to is not ours to truncate and write
            descriptor = open_regular(path, os.O_RDWR | os.O_CREAT)
        except OSError as error:
            reason = "a symbolic link" if error.errno == errno.ELOOP else error.strerror
            raise MsjaxError(
                f"run.dir={self.run_dir.path}: cannot open its lock file {path.name} ({reason}); "
                "msjax never follows links in a run directory: choose another run.dir"
            ) from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(descriptor)
            raise MsjaxError(
                f"run.dir={self.run_dir.path} is in use by another job ({_holder(path)}); wait "
                "for it to end or choose another run.dir"
            ) from None
        self._file = descriptor
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since_unix_s": round(time.time(), 3),
            "command": " ".join(sys.argv),
        }
        with contextlib.suppress(OSError):  # who holds it is a courtesy: a full disk goes without
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, (json.dumps(holder) + "\n").encode(), 0)

    def release(self) -> None:
        if self._file is not None:
            os.close(self._file)  # closing the descriptor drops the flock
            self._file = None

    def run_end(self, final_step: int) -> None:
        self.release()

    def run_failed(self) -> None:
        self.release()

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(path: Path) -> str:
    """Who holds the lock, as its holder wrote it (best effort: it may be mid-write)."""
    try:
        holder = json.loads(read_no_follow(path))
        return f"pid {holder['pid']} on {holder['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"
