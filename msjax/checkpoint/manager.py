"""Asynchronous Orbax checkpoints of the train state, restored onto any mesh, checked on restore.

A checkpoint is a step directory holding `state` (parameters, optimizer state, step; arrays
only) and `meta` (JSON: the resolved config, the data position, the seed, fingerprints of every
array, sealed with a CRC-32). No pickle anywhere: restoring reads arrays and JSON, never code.
A checkpoint found damaged is moved to `checkpoints/damaged/STEP`; one that could not be read
stays (msjax.checkpoint.read_errors draws the line); old ones are deleted only once a newer one
is committed with an intact record, counting only those. The `meta` item and its checks are
msjax.checkpoint.meta_item's; the reads every process agrees on, msjax.checkpoint.restore_reads'.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from msjax.checkpoint.commits import (
    COMMIT_MARKER,
    DAMAGED_DIR,
    committed_steps,
    damaged_entries,
    uncommitted_entries,
)
from msjax.checkpoint.fingerprint import (
    FINGERPRINT_FORMATS,
    PendingFingerprints,
    compile_fingerprints,
    fingerprints,
)
from msjax.checkpoint.meta_item import (
    META_FILE,
    MetaHandler,
    MetaSave,
    check_fingerprints,
    read_sealed_record,
)
from msjax.checkpoint.orbax_noise import quiet_failed_saves
from msjax.checkpoint.read_errors import CheckpointUnreadable, is_read_failure, read_error_reason
from msjax.checkpoint.record import record_problem
from msjax.checkpoint.restore_reads import (
    Listing,
    agree_on_listing,
    agreed_read,
    read_own_part,
    restore_vote,
)
from msjax.config import CheckpointConfig
from msjax.errors import MsjaxError
from msjax.parallel.agreement import ProcessVote, agree_any, agree_max

# 2: odd fingerprint weights (msjax.checkpoint.fingerprint) and a sealed record; 1 still restores
FORMAT_VERSION = 2


@dataclass(frozen=True)
class SaveOutcome:
    """How a started save ended: committed with an intact record (problem None), or why not."""

    step: int
    problem: str | None


@dataclass(frozen=True)
class Restored:
    """A checkpoint read back and verified."""

    step: int
    state: Any
    meta: dict[str, Any]
    path: Path


class Checkpointer:
    """Asynchronous saves (msjax.training.save_schedule decides when), their outcomes and
    retention; restores the newest valid step."""

    def __init__(self, directory: Path, options: CheckpointConfig, read_only: bool = False):
        self.directory = directory
        self.options = options
        if not read_only:
            quiet_failed_saves()  # a failed save is msjax's one-line warning, not pages of Orbax's
        # float weights and moments barely compress; zstd would only take host CPU from the
        # steps that overlap the write
        self._state_handler = ocp.PyTreeCheckpointHandler(use_compression=False)
        self._meta_handler = MetaHandler(META_FILE)
        self._manager = ocp.CheckpointManager(
            directory.absolute(),
            item_handlers={
                "state": self._state_handler,
                "meta": self._meta_handler,
            },
            # Retention is msjax's (`prune`): Orbax would count a damaged step as kept and delete
            # the last good one for it.
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None,
                enable_async_checkpointing=True,
                create=not read_only,
                read_only=read_only,
            ),
        )
        self._compiling: threading.Thread | None = None
        self._in_flight: int | None = None  # the step of the last save started
        self._finished: SaveOutcome | None = None  # its outcome, once known
        self.read_only = read_only
        self.skipped: list[str] = []  # why restore_newest_valid passed over each step
        self.moved_aside: list[str] = []  # what it moved to damaged/ (names there)

    def prepare(self, abstract_state: Any) -> None:
        """Compile the fingerprint program in the background, so the first save() need not.

        Call it once the state's shapes and shardings are known, before training starts: the
        compile overlaps the train step's.
        """
        self._compiling = threading.Thread(
            target=compile_fingerprints,
            args=(abstract_state,),
            name="msjax-fingerprint-compile",
            daemon=True,
        )
        self._compiling.start()

    def prepare_save(self) -> None:
        """What a save does first, each process on its own (what can fail here fails before the
        processes enter the save together): the fingerprint program compiled, the save before
        finished (its outcome kept for `save_outcome`), retention applied."""
        if self._compiling is not None:
            self._compiling.join()  # if it failed, the dispatch in save() compiles (and raises)
            self._compiling = None
        self.wait()

    def hold_write(self, step: int) -> None:
        """This process's part of the save of `step` is never finished, so that save never
        commits: an injected crash in that save then lands while it is being written, however
        fast the machine writes."""
        self._meta_handler.held_steps |= {step}

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start an asynchronous save; returns once the arrays are copied off the devices.

        Every process of the job calls it for the same step (it enters Orbax's barriers). The
        fingerprints are only dispatched here; the background thread writing the save waits
        for them. The save counts only once `save_outcome` says it committed.
        """
        meta = {
            **meta,
            "format_version": FORMAT_VERSION,
            "fingerprint_format": FINGERPRINT_FORMATS[-1],
            "step": step,
            "saved_at_unix_s": time.time(),
        }
        self.prepare_save()  # quick when done already
        self._in_flight, self._finished = None, None
        pending = PendingFingerprints(state)  # the next step, donating state, waits for it
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=MetaSave(meta, pending)),
            force=True,
        )
        self._in_flight = step

    def save_in_flight(self) -> bool:
        """Whether the started save is still being written (never blocks)."""
        if self._in_flight is None or self._finished is not None:
            return False
        return self._manager.is_saving_in_progress()

    def save_outcome(self) -> SaveOutcome | None:
        """How the last started save ended, once it is finalized (blocks until then); None when
        none was started. Never raises: a failure is in the outcome."""
        if self._in_flight is not None and self._finished is None:
            step = self._in_flight
            try:
                self._manager.wait_until_finished()  # raises what the background write raised
                problem = self._commit_problem(step)
            except Exception as error:  # Orbax and TensorStore raise many types
                problem = _one_line(error)
            self._finished = SaveOutcome(step, problem)
        return self._finished

    def _commit_problem(self, step: int) -> str | None:
        """Why a step whose save finished is not committed with an intact record, or None.

        Process 0 finalizes a step, so it alone looks; the others' share is their own writes.
        """
        if jax.process_index() != 0:
            return None
        if not (self.directory / str(step) / COMMIT_MARKER).exists():
            return f"step {step} was not finalized (no {COMMIT_MARKER})"
        if not self._record_ok(step):
            return f"the record of step {step} is missing or damaged"
        return None

    def wait(self) -> None:
        """Block until every started save is finalized on disk (its outcome is kept for
        `save_outcome`), then apply retention."""
        self.save_outcome()
        self._manager.wait_until_finished()
        self.prune()

    def remove_unfinished(self, vote: ProcessVote | None, step: int | None = None) -> list[str]:
        """Delete the step directories that saves started and never finalized (Orbax's
        `STEP.orbax-checkpoint-tmp-*`, or a STEP without its commit marker): all of them, or
        those of `step`; the names removed.

        Call it on every process of the job that holds the run lock, when none of its saves is
        in flight (at start-up, or once a failed save is finished everywhere): process 0
        deletes, then every process reloads its list of steps. A committed step is never
        touched. A directory that cannot be listed is left as it is.
        """
        removed: list[str] = []
        if not self.read_only and jax.process_index() == 0:
            try:
                names = uncommitted_entries(self.directory)
            except OSError:
                names = []
            for name in names:
                if step is None or name.split(".")[0] == str(step):
                    shutil.rmtree(self.directory / name, ignore_errors=True)
                    removed.append(name)
        agree_any(vote, False)  # process 0 is done: a barrier before every process reloads
        self._manager.reload()
        return removed

    def prune(self) -> None:
        """Delete checkpoints past `max_to_keep`, counting only committed steps whose record is
        intact (process 0; call when no save is in flight).

        Multiples of `keep_every_steps` stay, and so does every step newer than the newest
        intact one: a damaged newest step never costs the last good one.
        """
        if self.read_only or jax.process_index() != 0:
            return
        intact = [step for step in committed_steps(self.directory) if self._record_ok(step)]
        keep_every = self.options.keep_every_steps
        for step in intact[: -self.options.max_to_keep]:
            if not (keep_every and step % keep_every == 0):
                shutil.rmtree(self.directory / str(step), ignore_errors=True)
        # Orbax's own list of steps is not reloaded here: a failed save may still have threads
        # waiting on it, and with max_to_keep=None it deletes nothing from that list.

    def _record_ok(self, step: int) -> bool:
        try:
            raw = (self.directory / str(step) / "meta" / META_FILE).read_bytes()
        except OSError:
            return False
        return record_problem(raw) is None

    def move_aside(self, step: int) -> Path | None:
        """Move a damaged step to checkpoints/damaged/STEP (process 0, this run's own checkpoints
        only); where it went, or None when not moved."""
        if self.read_only or jax.process_index() != 0:
            return None
        source = self.directory / str(step)
        target = self.directory / DAMAGED_DIR / str(step)
        suffix = 1
        while target.exists():  # the same step damaged again after a rerun
            target = self.directory / DAMAGED_DIR / f"{step}-{suffix}"
            suffix += 1
        target.parent.mkdir(parents=True, exist_ok=True)
        source.rename(target)
        return target

    def damaged_entries(self) -> list[str]:
        """Names under checkpoints/damaged/: steps found damaged by earlier restores."""
        return damaged_entries(self.directory)

    def close(self) -> None:
        self._manager.close()

    def restore(self, step: int, abstract_state: Any, vote: ProcessVote | None = None) -> Restored:
        """One step, placed as abstract_state's shardings say, with the same outcome on every
        process: MsjaxError if it is damaged (on any process), CheckpointUnreadable if a process
        could not read it (the step is no worse for it: leave it where it is).

        The record is checked first (its seal, then the arrays against its fingerprints); a
        failed read is retried READ_ATTEMPTS times before it counts.
        """
        vote = vote if vote is not None else restore_vote()
        path = self.directory / str(step)
        meta, state = agreed_read(
            vote, path, lambda: read_own_part(path, abstract_state, self._state_handler)
        )
        try:  # computed over the global arrays: every process gets the same fingerprints
            actual = fingerprints(state, meta.get("fingerprint_format", 1))
        except Exception as error:
            if not is_read_failure(error):  # out of memory, say; anything else is a bug
                raise
            raise CheckpointUnreadable(
                f"checkpoint {path} was read but its fingerprints could not be computed "
                f"({read_error_reason(error)}); it is left in place"
            ) from None
        check_fingerprints(path, meta, actual)
        return Restored(step=step, state=state, meta=meta, path=path)

    def agreed_listing(self, vote: ProcessVote | None = None, context: str = "") -> Listing:
        """The committed and damaged steps, which every process must list alike (and `context`,
        a choice made from them). Processes that list them otherwise (a stale or missing mount
        on one node) stop every process with CheckpointUnreadable naming them: choosing by the
        least or the most of the listings would let one node's view start the job afresh."""
        vote = vote if vote is not None else restore_vote()
        try:
            listing = Listing(committed_steps(self.directory), self.damaged_entries())
        except OSError as error:  # the others learn of it as this process leaves (exit 7)
            raise CheckpointUnreadable(
                f"the checkpoints in {self.directory} could not be listed: {error}"
            ) from None
        return agree_on_listing(vote, self.directory, listing, context)

    def restore_newest_valid(
        self,
        abstract_state: Any,
        warn: Callable[[str], None],
        at_most: int | None = None,
    ) -> Restored | None:
        """The newest checkpoint (<= at_most) that reads back intact.

        Warns one line for each one skipped and moves each damaged one aside (this run's own
        checkpoints only); `self.skipped` lists why each committed step was skipped. Every
        process lists the same steps (else CheckpointUnreadable, see agreed_listing) and
        restores the same one: a step damaged in any process's shards is skipped by all, and
        one any process could not read ends the restore (CheckpointUnreadable), leaving every
        step in place.
        """
        self.skipped, self.moved_aside = [], []
        for name in uncommitted_entries(self.directory):
            warn(f"skipped checkpoint {self.directory / name}: the save never finished")
        vote = restore_vote()
        steps = self.agreed_listing(vote).steps
        candidates = [s for s in steps if at_most is None or s <= at_most]
        diverged = [self._replicas_differed(step) for step in candidates]
        if diverged:  # every process skips the same ones
            diverged = [bool(value) for value in agree_max(vote, diverged)]
        for index in reversed(range(len(candidates))):
            step = candidates[index]
            if diverged[index] and not all(diverged[:index]):
                warn(
                    f"skipped checkpoint {self.directory / str(step)}: its data-parallel "
                    "replicas differed when it was saved, and an earlier one's agreed"
                )
                continue
            try:
                return self.restore(step, abstract_state, vote)
            except MsjaxError as error:  # damage, found alike by every process
                self._skip(step, f"skipped {error}", warn, vote)
        return None

    def _replicas_differed(self, step: int) -> bool:
        """Whether a step's record says its replicas differed when it was saved (a record that
        cannot be read says nothing here: restoring it finds out)."""
        try:
            record = json.loads((self.directory / str(step) / "meta" / META_FILE).read_bytes())
        except (OSError, ValueError):
            return False
        replicas = record.get("replicas") if isinstance(record, dict) else None
        return isinstance(replicas, dict) and replicas.get("agreed") is False

    def restore_named(self, step: int, abstract_state: Any) -> Restored:
        """Exactly this step (MsjaxError if it is not committed or is damaged; never an older
        one in its place), with the same listing on every process."""
        vote = restore_vote()
        steps = self.agreed_listing(vote).steps
        if step not in steps:
            finished = ", ".join(map(str, steps[-5:])) or "none"
            raise MsjaxError(
                f"no finished checkpoint of step {step} in {self.directory} (finished: {finished})"
            )
        return self.restore(step, abstract_state, vote)

    def _skip(
        self, step: int, reason: str, warn: Callable[[str], None], vote: ProcessVote | None
    ) -> None:
        """Record and warn why a step is skipped, and move it aside as damaged. Every process
        then reloads its list of steps once the move is done, so all agree on which steps exist
        (a process that still listed the step would skip saving it again, and the save's
        collectives would no longer match)."""
        aside = self.move_aside(step)
        agree_any(vote, False)  # process 0 has moved it: a barrier before every process reloads
        self._manager.reload()
        line = reason + (f"; moved to {aside}" if aside else "")
        self.skipped.append(line)
        if aside is not None:
            self.moved_aside.append(aside.name)
        warn(line)

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only the parameters of one step (no optimizer state read), checked like a full
        restore: the record's seal, then the arrays against the fingerprints of the format that
        step was saved with."""
        path = self.directory / str(step)
        if not (path / COMMIT_MARKER).exists():
            raise MsjaxError(f"checkpoint {path} was never finalized (the save did not finish)")
        meta = read_sealed_record(path)
        item = {"params": abstract_params}
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                        partial_restore=True,
                    )
                ),
            )
        except Exception as error:  # Orbax and TensorStore raise many types for bad files
            reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
            raise MsjaxError(f"checkpoint {path} could not be read: {reason}") from None
        actual = fingerprints(dict(restored.state), meta.get("fingerprint_format", 1))
        expected = meta.get("fingerprints", {})
        check_fingerprints(path, {"fingerprints": {k: expected.get(k) for k in actual}}, actual)
        return restored.state["params"]

    def array_metadata(self, step: int) -> Any:
        """The saved state's tree of arrays (shapes and dtypes), without reading them."""
        return self._manager.item_metadata(step)["state"]

    def verify_on_host(self, step: int) -> None:
        """Read every array of a step onto one local device and check its fingerprint."""
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        abstract = jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
            self.array_metadata(step),
        )
        self.restore(step, abstract)

    def metadata(self, step: int) -> dict[str, Any]:
        """The meta JSON of one step, without reading any array; MsjaxError if it is garbled."""
        path = self.directory / str(step)
        raw = (path / "meta" / META_FILE).read_bytes()
        problem = record_problem(raw)
        if problem is not None:
            raise MsjaxError(f"checkpoint {path} is damaged: {problem}")
        return json.loads(raw)


def _one_line(error: Exception) -> str:
    """An error as one line; a long one keeps its start and its end (the OS error is there)."""
    text = str(error).splitlines()[0] if str(error) else ""
    if len(text) > 300:
        text = f"{text[:120]} ... {text[-160:]}"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
