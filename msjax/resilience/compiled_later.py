"""A program compiled on a thread of its own while the loop goes on: the checks that run every
hundred steps (replica fingerprints, the known-answer matmul) need not hold a (re)start's first
step back while XLA compiles them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class CompiledLater:
    """compile() run on its own thread from now on; get() waits for its result (or raises its
    error) where the program is first used. The thread is not a daemon: a run that ends before
    the compile does waits for it at exit instead of tearing XLA down under it."""

    def __init__(self, compile: Callable[[], Any], name: str):
        self._compiled: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(compile,), name=f"msjax-compile-{name}"
        )
        self._thread.start()

    def _run(self, compile: Callable[[], Any]) -> None:
        try:
            self._compiled = compile()
        except BaseException as error:  # raised where the program is used, in the loop
            self._error = error

    def get(self) -> Any:
        """The compiled program, once its compile has ended."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._compiled
