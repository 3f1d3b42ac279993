"""The fast tier's guard: a test under tests/unit/ that starts a process fails at that call, with
one line naming the test, the program and where such a test belongs (tests/jobs/).

Every way a test starts a process goes through one of these: `subprocess` (and everything built
on it), `os.posix_spawn`/`os.posix_spawnp`, `os.fork` (with `os.forkpty`), and `multiprocessing`
(Grain's worker processes).
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

JOBS_TIER = "tests/jobs/"


class StartsAProcess(AssertionError):
    """A fast-tier test started a process."""


def refusal(test: str, program: str) -> str:
    return (
        f"{test} starts a process ({program}): the fast tier (tests/unit/) runs in-process; "
        f"a test that starts one belongs in {JOBS_TIER}"
    )


def _program(how: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    if how == "subprocess":
        command = kwargs.get("args", args[0] if args else "")
        if isinstance(command, (list, tuple)):
            command = " ".join(str(part) for part in command[:4])
        return f"subprocess: {str(command)[:120]}"
    if how == "posix_spawn":
        return f"os.posix_spawn: {args[0] if args else '?'}"
    return how


@contextlib.contextmanager
def processes_refused(test: str) -> Iterator[None]:
    """While inside, any process start raises StartsAProcess naming `test`."""

    def refuse(how: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise StartsAProcess(refusal(test, _program(how, args[1:], kwargs)))

        return refused

    def refuse_spawn(*args: Any, **kwargs: Any) -> Any:
        raise StartsAProcess(refusal(test, _program("posix_spawn", args, kwargs)))

    patches = [
        (subprocess.Popen, "__init__", refuse("subprocess")),
        (os, "posix_spawn", refuse_spawn),
        (os, "posix_spawnp", refuse_spawn),
        (os, "fork", refuse("os.fork")),
        (os, "forkpty", refuse("os.forkpty")),
        (multiprocessing.process.BaseProcess, "start", refuse("multiprocessing")),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
