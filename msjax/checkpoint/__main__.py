"""`python -m msjax.checkpoint list RUN_DIR | inspect PATH`: what a run's checkpoints hold."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from msjax.checkpoint.read_errors import CheckpointUnreadable
from msjax.cli import ArgumentParser, user_error
from msjax.errors import MsjaxError
from msjax.run_dir import RunDir


def _directory_bytes(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())


def _human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    raise AssertionError("unreachable")


def list_checkpoints(run_dir: Path, verify: bool) -> list[str]:
    """One line per step directory: step, size, time, and whether it is valid."""
    from msjax.checkpoint.manager import Checkpointer, committed_steps, uncommitted_entries
    from msjax.config import CheckpointConfig

    checkpoints = RunDir(run_dir).checkpoints
    directory = checkpoints if checkpoints.is_dir() else run_dir
    if not directory.is_dir():
        raise MsjaxError(f"no checkpoints directory in {run_dir}")
    checkpointer = Checkpointer(directory, CheckpointConfig(), read_only=True)
    lines = [f"{'step':>8}  {'size':>10}  {'saved (UTC)':<19}  status"]
    for step in committed_steps(directory):
        path = directory / str(step)
        size = _human_bytes(_directory_bytes(path))
        try:
            meta = checkpointer.metadata(step)
            saved = datetime.fromtimestamp(meta["saved_at_unix_s"], UTC).strftime(
                "%Y-%m-%d %H:%M:%S"
            )
        except Exception as error:
            lines.append(f"{step:>8}  {size:>10}  {'?':<19}  invalid: meta unreadable ({error})")
            continue
        status = "valid (unverified)"
        if verify:
            try:
                checkpointer.verify_on_host(step)
                status = "valid (arrays match their fingerprints)"
            except MsjaxError as error:
                status = f"invalid: {error}"
            except CheckpointUnreadable as error:  # not damage: it may read on a retry
                status = f"unreadable: {error}"
        lines.append(f"{step:>8}  {size:>10}  {saved:<19}  {status}")
    for name in uncommitted_entries(directory):
        size = _human_bytes(_directory_bytes(directory / name))
        lines.append(f"{name:>8}  {size:>10}  {'-':<19}  invalid: the save never finished")
    checkpointer.close()
    return lines


def inspect_checkpoint(path: Path) -> list[str]:
    """Config, step, data position and the parameter tree of one checkpoint step."""
    import yaml

    from msjax.checkpoint.manager import Checkpointer
    from msjax.config import CheckpointConfig

    if not path.name.isdigit() or not path.is_dir():
        raise MsjaxError(f"{path} is not a checkpoint step directory (RUN_DIR/checkpoints/STEP)")
    checkpointer = Checkpointer(path.parent, CheckpointConfig(), read_only=True)
    step = int(path.name)
    meta = checkpointer.metadata(step)
    arrays = checkpointer.array_metadata(step)
    checkpointer.close()
    try:
        lines = [
            f"checkpoint {path}",
            f"step {meta['step']}; next data step {meta['data']['next_step']} "
            f"({meta['data']['samples_seen']} samples seen); seed {meta['seed']}; "
            f"msjax {meta.get('msjax_version', '?')}",
            "config:",
            *("  " + line for line in yaml.safe_dump(meta["config"], sort_keys=False).splitlines()),
            "arrays:",
        ]
    except (KeyError, TypeError) as missing:  # an old or hand-made record, sealed but partial
        raise MsjaxError(
            f"checkpoint {path}: its record has no {missing} (msjax writes it)"
        ) from None
    import jax

    from msjax.checkpoint.fingerprint import leaf_name

    total = 0
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        size = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        total += size
        shape = "x".join(map(str, leaf.shape)) or "scalar"
        name = leaf_name(key_path)
        lines.append(f"  {name:<44} {shape:<16} {np.dtype(leaf.dtype)!s:<9} {_human_bytes(size)}")
    lines.append(f"total {_human_bytes(total)} in {len(jax.tree.leaves(arrays))} arrays")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m msjax.checkpoint", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)  # same parser class
    list_parser = commands.add_parser("list", help="steps, sizes, times, valid or not")
    list_parser.add_argument("run_dir", type=Path)
    list_parser.add_argument(
        "--quick", action="store_true", help="skip reading arrays back (no fingerprint check)"
    )
    inspect_parser = commands.add_parser("inspect", help="config, step, parameter tree")
    inspect_parser.add_argument("path", type=Path)
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes on read-only managers
    try:
        args = parser.parse_args(argv)
        if args.command == "list":
            lines = list_checkpoints(args.run_dir, verify=not args.quick)
        else:
            lines = inspect_checkpoint(args.path)
    except MsjaxError as error:
        return user_error("msjax.checkpoint", error)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
