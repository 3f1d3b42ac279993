"""Reading a checkpoint step back on every process of a job: each reads its own part (retried,
a failed read told from damage), then all act on one verdict and one listing of the steps.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from msjax.checkpoint.commits import COMMIT_MARKER
from msjax.checkpoint.meta_item import META_FILE, checked_record
from msjax.checkpoint.read_errors import CheckpointUnreadable, is_read_failure, read_error_reason
from msjax.errors import MsjaxError
from msjax.parallel.agreement import ProcessVote, process_vote

READ_ATTEMPTS = 3  # a read is retried (a file system hiccup) before its error counts
READ_RETRY_S = 0.5
# What each process found when it read a step (msjax.checkpoint.read_errors tells them apart)
READ_OK, READ_DAMAGED, READ_FAILED = 0, 1, 2
_restore_votes = itertools.count()  # every process opens the same votes in the same order


@dataclass(frozen=True)
class Listing:
    """The steps a checkpoints directory holds, as one process lists them."""

    steps: list[int]  # committed, oldest first
    damaged: list[str]  # names under damaged/


def restore_vote() -> ProcessVote | None:
    """The next restore's vote, the same on every process (None in a one-process job)."""
    return process_vote(f"restore/{next(_restore_votes)}")


def read_own_part(
    path: Path, abstract_state: Any, state_handler: ocp.PyTreeCheckpointHandler
) -> tuple[dict[str, Any], Any]:
    """This process's part of a step: its record, checked, and its shards of the state.

    MsjaxError for evidence of damage, CheckpointUnreadable for a read that failed
    (msjax.checkpoint.read_errors draws the line).
    """
    finalized = read_with_retries(path, (path / COMMIT_MARKER).exists)
    if not finalized:
        raise MsjaxError(f"checkpoint {path} was never finalized (the save did not finish)")
    raw = read_with_retries(path, lambda: (path / "meta" / META_FILE).read_bytes())
    meta = checked_record(path, raw)
    # The item handler itself, not the manager: the manager's restore ends in a barrier of
    # all processes that one whose read failed would never reach.
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
    state = read_with_retries(
        path,
        lambda: state_handler.restore(
            path.absolute() / "state",
            args=ocp.args.PyTreeRestore(abstract_state, restore_args=restore_args),
        ),
    )
    return meta, state


def read_with_retries(path: Path, read: Callable[[], Any]) -> Any:
    """read(), retried READ_ATTEMPTS times; then CheckpointUnreadable for a failed read, or
    MsjaxError naming the step at path for anything else."""
    for attempt in range(READ_ATTEMPTS):
        try:
            return read()
        except Exception as error:  # Orbax and TensorStore raise many types for bad files
            if attempt + 1 < READ_ATTEMPTS:
                time.sleep(READ_RETRY_S * 2**attempt)
                continue
            reason = read_error_reason(error)
            if is_read_failure(error):
                raise CheckpointUnreadable(f"{reason} ({READ_ATTEMPTS} tries)") from None
            raise MsjaxError(
                f"checkpoint {path} could not be read ({READ_ATTEMPTS} tries): {reason}"
            ) from None
    raise AssertionError("unreachable")


def agreed_read(
    vote: ProcessVote | None, path: Path, read: Callable[[], tuple[dict[str, Any], Any]]
) -> tuple[dict[str, Any], Any]:
    """This process's read() of the step at path, once every process has read its own part and
    all found it whole; otherwise the same error on every process: CheckpointUnreadable if any
    could not read it, else MsjaxError if any found it damaged."""
    outcome, local_error = READ_OK, None
    try:
        meta, state = read()
    except CheckpointUnreadable as error:
        outcome, local_error = READ_FAILED, error
    except MsjaxError as error:
        outcome, local_error = READ_DAMAGED, error
    # Every process reads its own shards; all act on the same verdict. One that could not
    # read wins over one that found damage: nothing is moved aside on a failed read.
    outcomes = [values[0] for values in every_process(vote, [outcome])]
    failed = [rank for rank, found in enumerate(outcomes) if found == READ_FAILED]
    damaged = [rank for rank, found in enumerate(outcomes) if found == READ_DAMAGED]
    if failed:
        raise CheckpointUnreadable(
            f"checkpoint {path} looks whole but could not be read by {_processes(failed)}"
            + (f" ({local_error})" if outcome == READ_FAILED else "")
            + "; it is left in place (a read error is not damage): retry, or check that "
            "node's file system"
        )
    if local_error is not None:
        raise local_error
    if damaged:
        raise MsjaxError(f"checkpoint {path} is damaged in the shards {_processes(damaged)} reads")
    return meta, state


def agree_on_listing(
    vote: ProcessVote | None, directory: Path, listing: Listing, context: str
) -> Listing:
    """This process's listing (and `context`, a choice made from it), once every process has
    found the same; CheckpointUnreadable naming the processes that differ otherwise."""
    text = json.dumps([listing.steps, listing.damaged, context])
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")
    newest = listing.steps[-1] if listing.steps else -1
    views = every_process(vote, [digest, len(listing.steps), newest, len(listing.damaged)])
    if len({view[0] for view in views}) == 1:
        return listing
    groups: dict[int, list[int]] = {}
    for rank, view in enumerate(views):
        groups.setdefault(view[0], []).append(rank)
    # the likely stale view first: the fewest processes, then the fewest steps
    ordered = sorted(groups.values(), key=lambda ranks: (len(ranks), views[ranks[0]][1:]))
    seen = "; ".join(f"{_processes(ranks)}: {_describe_view(views[ranks[0]])}" for ranks in ordered)
    raise CheckpointUnreadable(
        f"the processes list different checkpoints in {directory}: {seen} (a stale or "
        "missing mount on one node?); every process stops, and nothing was restored, moved "
        "or trained"
    )


def every_process(vote: ProcessVote | None, mine: list[int]) -> list[tuple[int, ...]]:
    """Every process's values (whole numbers >= -1), the same list on every process, in process
    order. One vote round when all processes hold the same values, two when they differ."""
    if vote is None:
        return [tuple(mine)]
    count = jax.process_count()
    agreed = vote.agree([*mine, *(-value for value in mine)])  # each value's max, and -min
    if all(agreed[i] == -agreed[len(mine) + i] for i in range(len(mine))):
        return [tuple(mine)] * count
    slots = [-1] * (count * len(mine))  # each process fills its own slots; the max reads them
    slots[vote.rank * len(mine) : (vote.rank + 1) * len(mine)] = mine
    agreed = vote.agree(slots)
    return [tuple(agreed[rank * len(mine) : (rank + 1) * len(mine)]) for rank in range(count)]


def _processes(ranks: list[int]) -> str:
    return ("process " if len(ranks) == 1 else "processes ") + ", ".join(map(str, ranks))


def _describe_view(view: tuple[int, ...]) -> str:
    _, steps, newest, damaged = view
    listed = f"{steps} committed steps (newest {newest})" if steps else "no committed step"
    return listed + (f" and {damaged} damaged" if damaged else "")
