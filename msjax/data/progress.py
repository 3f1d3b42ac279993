"""Work done in the data phase (bytes hashed, bytes of token files scanned, tokens written),
counted for `write_progress` listeners: a heartbeat shows a large corpus as moving, not hung."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

_listeners: list[tuple[Callable[[int], None], list[int]]] = []  # (listener, [units so far])


@contextlib.contextmanager
def write_progress(listener: Callable[[int], None]) -> Iterator[None]:
    """Within the block, every long step of reading the corpus on this process calls listener
    with the units of work done since the block began (a heartbeat uses it)."""
    entry = (listener, [0])
    _listeners.append(entry)
    try:
        yield
    finally:
        _listeners.remove(entry)


def report_progress(units: int) -> None:
    """units more work done: bytes hashed or scanned, or tokens written."""
    for listener, done in _listeners:
        done[0] += units
        listener(done[0])
