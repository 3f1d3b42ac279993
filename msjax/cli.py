"""What every msjax command does with a user mistake: one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from msjax.errors import MsjaxError


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are user mistakes like any other: one line, exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise MsjaxError(message)


def user_error(prog: str, error: MsjaxError) -> int:
    """Print `prog: error: message` as one line on stderr; return the exit code 2."""
    message = " ".join(str(error).split())
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def split_at_double_dash(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """A launcher's own arguments and, after the first `--`, the trainer's (none without one)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    split = argv.index("--")
    return argv[:split], argv[split + 1 :]
