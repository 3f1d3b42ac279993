"""Whether msjax can create and write a directory, checked before anything is written there."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

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
