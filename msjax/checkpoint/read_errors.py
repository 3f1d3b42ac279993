"""Damage or a failed read: how an error reading a checkpoint is told apart, and the error that
ends an attempt when a checkpoint that looks whole could not be read (exit code 7)."""

from __future__ import annotations

import errno
import re

# TensorStore (under Orbax) names the OS error behind a failed file read in its message.
_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")
# A file that is not there is a fact about the step, not about this read.
_MISSING = (errno.ENOENT, errno.ENOTDIR)
# absl status codes (TensorStore, XLA) of a read that failed without saying anything about the
# bytes: no access, no memory, an unavailable or slow store.
_READ_FAILURE_STATUSES = (
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "ABORTED",
    "CANCELLED",
)


class CheckpointUnreadable(Exception):
    """A checkpoint that looks whole could not be read, here or on another process (an I/O or
    permission error, out of memory, processes that list different checkpoints). It is no
    evidence of damage: every step stays where it is, and the attempt ends with exit code 7
    (msjax.resilience.exit_codes.CHECKPOINT_UNREADABLE), to be retried here or elsewhere."""


def is_read_failure(error: BaseException) -> bool:
    """Whether an error reading a step says only that the read failed, not that the step is
    damaged.

    Evidence of damage (the step moves to checkpoints/damaged/, the restore falls back to an
    older one): no commit marker; a record that is missing, does not parse or fails its seal;
    arrays that TensorStore finds missing, short or undecodable; arrays that fail their
    fingerprints. These are facts about the bytes on disk, the same on every retry.

    A failed read (the step stays, the attempt ends with exit code 7): any other OSError (EIO,
    EACCES, EISDIR, ESTALE, ...), MemoryError, and the TensorStore or XLA errors that carry such
    an OS error code or a status of no access, no memory or an unavailable store. These say
    nothing about the bytes: the same step may read fine on a retry or on another node.
    """
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:  # Orbax wraps TensorStore's errors
        seen.add(id(cause))
        if isinstance(cause, MemoryError):
            return True
        if isinstance(cause, OSError) and cause.errno is not None:
            return cause.errno not in _MISSING
        text = str(cause)
        os_code = _OS_ERROR_CODE.search(text)
        if os_code is not None:
            return int(os_code.group(1)) not in _MISSING
        if text.startswith(_READ_FAILURE_STATUSES):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def read_error_reason(error: BaseException, limit: int = 240) -> str:
    """One line for why a read failed: the innermost error's first line (Orbax's own wrapper
    says only where), its middle cut when long, so the OS error at its end stays."""
    innermost, seen = error, {id(error)}
    while (cause := innermost.__cause__ or innermost.__context__) is not None:
        if id(cause) in seen:
            break
        innermost = cause
        seen.add(id(cause))
    text = str(innermost).strip()
    line = text.splitlines()[0] if text else type(innermost).__name__
    if len(line) > limit:
        line = line[: limit // 2] + " ... " + line[-limit // 2 :]
    return line
