"""Asynchronous Orbax checkpoints of the train state, restored onto any mesh, checked on restore.

A checkpoint is a step directory holding `state` (parameters, optimizer state, step; arrays
only) and `meta` (JSON: the resolved config, the data position, the seed, fingerprints of every
array). No pickle anywhere: restoring reads arrays and JSON, never code.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from msjax.checkpoint.fingerprint import (
    PendingFingerprints,
    compile_fingerprints,
    fingerprints,
)
from msjax.config import CheckpointConfig
from msjax.errors import MsjaxError
from msjax.parallel.agreement import agree_any, agree_min, process_vote
from msjax.run_dir import RunDir

FORMAT_VERSION = 1
# Orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it to `<step>` when the
# save is finalized; a finalized step directory also holds this metadata file.
COMMIT_MARKER = "_CHECKPOINT_METADATA"
TMP_MARKER = ".orbax-checkpoint-tmp"
META_FILE = "metadata"  # the file JsonCheckpointHandler reads back in the `meta` item directory


@dataclass(frozen=True)
class Restored:
    """A checkpoint read back and verified."""

    step: int
    state: Any
    meta: dict[str, Any]
    path: Path


def parse_resume_source(source: str) -> tuple[Path, int | None]:
    """`PATH` or `PATH/STEP`, where PATH is a run dir or its checkpoints dir."""
    path = Path(source)
    step = None
    if path.name.isdigit() and not RunDir(path).checkpoints.is_dir():
        path, step = path.parent, int(path.name)
    checkpoints = RunDir(path).checkpoints
    if checkpoints.is_dir():
        path = checkpoints
    if not path.is_dir():
        raise MsjaxError(f"checkpoint.resume_from={source}: no checkpoint directory at {path}")
    return path, step


def committed_steps(directory: Path) -> list[int]:
    """Steps whose directory Orbax finalized, oldest first (a killed save leaves none)."""
    if not directory.is_dir():
        return []
    return sorted(
        int(entry.name)
        for entry in directory.iterdir()
        if entry.is_dir() and entry.name.isdigit() and (entry / COMMIT_MARKER).exists()
    )


def uncommitted_entries(directory: Path) -> list[str]:
    """Names of step directories that were started but never finalized."""
    if not directory.is_dir():
        return []
    return sorted(
        entry.name
        for entry in directory.iterdir()
        if entry.is_dir()
        and (
            (TMP_MARKER in entry.name and entry.name.split(".")[0].isdigit())
            or (entry.name.isdigit() and not (entry / COMMIT_MARKER).exists())
        )
    )


class _MetaHandler(ocp.JsonCheckpointHandler):
    """The `meta` item: JSON, whose fingerprints are fetched by the thread that writes it.

    Orbax runs the returned commit future in a background thread and finalizes the step only
    after it is done, so a committed step always holds its fingerprints, and the training loop
    never waits for them to be computed.
    """

    async def async_save(
        self, directory: Any, item: Any = None, args: Any = None
    ) -> list[ocp.future.Future] | None:
        if not isinstance(args, _MetaSave):
            return await super().async_save(directory, item, args)

        async def write() -> None:
            if jax.process_index() == 0:
                meta = {**args.meta, "fingerprints": args.fingerprints.result()}
                (Path(directory) / META_FILE).write_text(json.dumps(meta))

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="msjax_meta")]


@ocp.args.register_with_handler(_MetaHandler, for_save=True)
@dataclasses.dataclass
class _MetaSave(ocp.args.CheckpointArgs):
    meta: dict[str, Any]
    fingerprints: PendingFingerprints


@ocp.args.register_with_handler(_MetaHandler, for_restore=True)
@dataclasses.dataclass
class _MetaRestore(ocp.args.CheckpointArgs):
    pass


class Checkpointer:
    """Saves every so many steps or minutes, asynchronously; restores the newest valid step."""

    def __init__(self, directory: Path, options: CheckpointConfig, read_only: bool = False):
        self.directory = directory
        self.options = options
        self._manager = ocp.CheckpointManager(
            directory.absolute(),
            item_handlers={
                # float weights and moments barely compress; zstd would only take host CPU
                # from the steps that overlap the write
                "state": ocp.PyTreeCheckpointHandler(use_compression=False),
                "meta": _MetaHandler(META_FILE),
            },
            options=ocp.CheckpointManagerOptions(
                max_to_keep=options.max_to_keep,
                keep_period=options.keep_every_steps,
                enable_async_checkpointing=True,
                create=not read_only,
                read_only=read_only,
            ),
        )
        self._last_save_time = time.monotonic()
        self.last_saved_step: int | None = None
        self.save_blocked_s: list[float] = []  # how long each save() held up the loop
        self._compiling: threading.Thread | None = None

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

    def due_by_steps(self, step: int) -> bool:
        """Whether checkpoint.every_steps asks for a save after `step` updates."""
        every = self.options.every_steps
        return bool(self.options.enabled and every and step % every == 0)

    def due_by_clock(self) -> bool:
        """Whether checkpoint.every_minutes have passed since the last save (this clock's view)."""
        minutes = self.options.every_minutes
        if not self.options.enabled or minutes is None:
            return False
        return time.monotonic() - self._last_save_time >= 60 * minutes

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start an asynchronous save; returns once the arrays are copied off the devices.

        The fingerprints are only dispatched here; the background thread writing the save waits
        for them. Raises what Orbax raises (a failed earlier save surfaces here or in `wait`).
        """
        started = time.perf_counter()
        if self._compiling is not None:
            self._compiling.join()  # if it failed, the dispatch below compiles (and raises)
            self._compiling = None
        meta = {
            **meta,
            "format_version": FORMAT_VERSION,
            "step": step,
            "saved_at_unix_s": time.time(),
        }
        pending = PendingFingerprints(state)  # the next step, donating state, waits for it
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state), meta=_MetaSave(meta, pending)
            ),
            force=True,
        )
        self.save_blocked_s.append(time.perf_counter() - started)
        self._last_save_time = time.monotonic()
        self.last_saved_step = step

    def wait(self) -> None:
        """Block until every started save is finalized on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def restore(self, step: int, abstract_state: Any) -> Restored:
        """One step, placed as abstract_state's shardings say; MsjaxError if it is not valid."""
        path = self.directory / str(step)
        if not (path / COMMIT_MARKER).exists():
            raise MsjaxError(f"checkpoint {path} was never finalized (the save did not finish)")
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        abstract_state,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
                    ),
                    meta=_MetaRestore(),
                ),
            )
        except Exception as error:  # Orbax and TensorStore raise many types for bad files
            reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
            raise MsjaxError(f"checkpoint {path} could not be read: {reason}") from None
        meta = dict(restored.meta)
        _check_fingerprints(path, meta, fingerprints(restored.state))
        return Restored(step=step, state=restored.state, meta=meta, path=path)

    def restore_newest_valid(
        self,
        abstract_state: Any,
        warn: Callable[[str], None],
        at_most: int | None = None,
    ) -> Restored | None:
        """The newest checkpoint (<= at_most) that reads back intact; warns for each skipped.

        In a multi-process job every process restores the same step: the step tried is the
        least of the processes' candidates, and one that any process cannot read is skipped by
        all (each process reads its own shards, so only some may see the damage).
        """
        for name in uncommitted_entries(self.directory):
            warn(f"skipped checkpoint {self.directory / name}: the save never finished")
        vote = process_vote("restore")
        bound = at_most
        while True:
            candidates = [s for s in committed_steps(self.directory) if bound is None or s <= bound]
            step = agree_min(vote, candidates[-1] if candidates else -1)
            if step < 0:
                return None
            bound = step - 1
            try:
                restored = self.restore(step, abstract_state)
            except MsjaxError as error:
                warn(f"skipped {error}")
                agree_any(vote, True)
                continue
            if agree_any(vote, False):
                warn(f"skipped checkpoint {restored.path}: another process could not read it")
                continue
            return restored

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only the parameters of one step (no optimizer state read), checked by fingerprint."""
        path = self.directory / str(step)
        if not (path / COMMIT_MARKER).exists():
            raise MsjaxError(f"checkpoint {path} was never finalized (the save did not finish)")
        item = {"params": abstract_params}
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                        partial_restore=True,
                    ),
                    meta=_MetaRestore(),
                ),
            )
        except Exception as error:  # Orbax and TensorStore raise many types for bad files
            reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
            raise MsjaxError(f"checkpoint {path} could not be read: {reason}") from None
        actual = fingerprints(dict(restored.state))
        expected = dict(restored.meta).get("fingerprints", {})
        _check_fingerprints(path, {"fingerprints": {k: expected.get(k) for k in actual}}, actual)
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
        """The meta JSON of one step, without reading any array."""
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=_MetaRestore()))
        return dict(restored.meta)


def _check_fingerprints(path: Path, meta: dict[str, Any], actual: dict[str, int]) -> None:
    expected = meta.get("fingerprints", {})
    if expected != actual:
        differing = sorted(key for key in actual if expected.get(key) != actual[key])
        first = differing[0] if differing else "the list of arrays differs"
        raise MsjaxError(
            f"checkpoint {path} is corrupted: {len(differing)} arrays do not match their "
            f"fingerprints (first: {first})"
        )
