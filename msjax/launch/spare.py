"""`python -m msjax.launch.spare RUN_DIR SLOT`: a worker that waits with its imports done, either
a spare of `msjax.launch --spares N` or the warm standby of a slot that runs a rank
(resilience.warm_standbys), which the next restart takes instead of starting a fresh process.

It does its imports (JAX, msjax's trainer), then waits for the supervisor to hand it a rank over
its stdin, a pipe only the supervisor holds (never a file: what another user could write there is
never run, and the job's secret in the assignment's environment is never on disk), and runs as
that rank's `msjax.train` worker. The wait is bounded: it ends when the pipe closes (the
supervisor is gone) or after --max-wait-s.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import sys
import time
from collections.abc import Sequence
from pathlib import Path

POLL_S = 0.05
# what a worker imports before its first step: done while waiting, not after the assignment
# (msjax.train imports the loop's parts when it is called: they count in a restart's time)
WARM_IMPORTS = (
    *("jax", "flax.nnx", "optax", "orbax.checkpoint", "grain", "msjax.train"),
    *("msjax.training.prepare", "msjax.training.decisions", "msjax.training.replica_checks"),
    *("msjax.training.reporting", "msjax.training.checkpoints", "msjax.data.pipeline"),
    "msjax.resilience.replica_guard",
)
NOT_ASSIGNED = 0  # the exit code of a spare that was never needed


def read_assignment(stdin_fd: int, max_wait_s: float) -> dict | None:
    """The assignment the supervisor writes to this process's stdin, a pipe only it holds (one
    JSON line); None when the pipe closes first (the supervisor is gone or needs no spare), the
    line is not an assignment, or time is up. Nothing on disk is read: a file in the run dir,
    whoever wrote it, is never taken for one."""
    deadline = time.monotonic() + max_wait_s
    received = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stdin_fd], [], [], min(POLL_S * 20, max_wait_s))
        if not ready:
            continue
        chunk = os.read(stdin_fd, 65536)
        if not chunk:
            return None  # the supervisor closed the pipe or ended
        received += chunk
        if b"\n" in received:
            return _parse_assignment(received.split(b"\n", 1)[0])
    return None


def _parse_assignment(line: bytes) -> dict | None:
    try:
        assignment = json.loads(line)
    except ValueError:
        return None
    fields = ("rank", "env", "args")
    if not isinstance(assignment, dict) or any(key not in assignment for key in fields):
        return None
    return assignment


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m msjax.launch.spare", description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("slot", type=int)
    parser.add_argument("--max-wait-s", type=float, default=7 * 24 * 3600.0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    print(
        f"msjax.launch.spare: slot {args.slot} ready in {time.perf_counter() - started:.1f} s "
        "(imports done), waiting for a rank",
        flush=True,
    )
    assignment = read_assignment(sys.stdin.fileno(), args.max_wait_s)
    _stdin_from_dev_null()  # the trainer reads nothing from the supervisor's pipe
    if assignment is None:
        print(f"msjax.launch.spare: slot {args.slot} not needed; leaving", flush=True)
        return NOT_ASSIGNED
    os.environ.update(assignment["env"])
    print(
        f"msjax.launch.spare: slot {args.slot} takes rank {assignment['rank']}",
        flush=True,
    )
    from msjax.train import main as train_main

    sys.argv = ["msjax.train", *assignment["args"]]
    return train_main(assignment["args"])


def _stdin_from_dev_null() -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, sys.stdin.fileno())
    os.close(null)


if __name__ == "__main__":
    raise SystemExit(main())
