"""`python -m msjax.launch.spare RUN_DIR SLOT`: a worker that waits with its imports done, either
a spare of `msjax.launch --spares N` or the warm standby of a slot that runs a rank
(resilience.warm_standbys), which the next restart takes instead of starting a fresh process.

It does its imports (JAX, msjax's trainer), then waits for the supervisor to hand it a rank in
RUN_DIR/spares/slot<SLOT>.json, and runs as that rank's `msjax.train` worker. The wait is bounded:
it ends when the supervisor is gone (the parent changes) or after --max-wait-s.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from msjax.run_dir import RunDir

POLL_S = 0.05
# what a worker imports before its first step: done while waiting, not after the assignment
WARM_IMPORTS = ("jax", "flax.nnx", "optax", "orbax.checkpoint", "grain", "msjax.train")
NOT_ASSIGNED = 0  # the exit code of a spare that was never needed


def write_assignment(run_dir: Path, slot: int, rank: int, env: dict[str, str], args: list[str]):
    """Hand the spare of `slot` its rank: the worker environment and trainer arguments."""
    from msjax.run_dir import write_text_atomically

    path = RunDir(run_dir).spare_assignment(slot)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps({"rank": rank, "env": env, "args": args}))


def wait_for_assignment(path: Path, parent_pid: int, max_wait_s: float) -> dict | None:
    """The assignment once it is written; None when the supervisor is gone or time is up."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        if os.getppid() != parent_pid:
            return None
        try:
            assignment = json.loads(path.read_text())
        except FileNotFoundError:
            time.sleep(POLL_S)
            continue
        path.unlink(missing_ok=True)  # taken once: a later spare of this slot waits afresh
        return assignment
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m msjax.launch.spare", description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("slot", type=int)
    parser.add_argument("--max-wait-s", type=float, default=7 * 24 * 3600.0)
    args = parser.parse_args(argv)
    parent_pid = os.getppid()
    started = time.perf_counter()
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    print(
        f"msjax.launch.spare: slot {args.slot} ready in {time.perf_counter() - started:.1f} s "
        "(imports done), waiting for a rank",
        flush=True,
    )
    path = RunDir(args.run_dir).spare_assignment(args.slot)
    assignment = wait_for_assignment(path, parent_pid, args.max_wait_s)
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


if __name__ == "__main__":
    raise SystemExit(main())
