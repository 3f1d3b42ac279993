"""The `meta` item of a checkpoint step: its sealed JSON record (the resolved config, the data
position, the seed, fingerprints of every array), written once the fingerprints are fetched, and
read back checked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from msjax.checkpoint.fingerprint import FINGERPRINT_FORMATS, PendingFingerprints
from msjax.checkpoint.record import record_problem, seal_record
from msjax.errors import MsjaxError

META_FILE = "metadata"  # the file JsonCheckpointHandler reads back in the `meta` item directory


class MetaHandler(ocp.JsonCheckpointHandler):
    """The `meta` item: JSON, whose fingerprints are fetched by the thread that writes it.

    Orbax runs the returned commit future in a background thread and finalizes the step only
    after it is done, so a committed step always holds its fingerprints, and the training loop
    never waits for them to be computed.
    """

    held_steps: frozenset[int] = frozenset()  # this process's part of their saves never ends

    async def async_save(
        self, directory: Any, item: Any = None, args: Any = None
    ) -> list[ocp.future.Future] | None:
        if not isinstance(args, MetaSave):
            return await super().async_save(directory, item, args)
        held = args.meta["step"] in self.held_steps

        async def write() -> None:
            while held:  # the process exits mid-save (an injected crash_in_save)
                await asyncio.sleep(1.0)
            if jax.process_index() == 0:
                meta = {**args.meta, "fingerprints": args.fingerprints.result()}
                (Path(directory) / META_FILE).write_bytes(seal_record(meta))

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="msjax_meta")]


@ocp.args.register_with_handler(MetaHandler, for_save=True)
@dataclasses.dataclass
class MetaSave(ocp.args.CheckpointArgs):
    """What a save hands the `meta` item: the record, and the fingerprints still being fetched."""

    meta: dict[str, Any]
    fingerprints: PendingFingerprints


@ocp.args.register_with_handler(MetaHandler, for_restore=True)
@dataclasses.dataclass
class MetaRestore(ocp.args.CheckpointArgs):
    """Registered so that Orbax can read the `meta` item back as plain JSON."""


def read_sealed_record(path: Path) -> dict[str, Any]:
    """The record of the step at path, checked: its seal intact and its fingerprint format one
    this msjax knows; MsjaxError naming the step otherwise."""
    try:
        raw = (path / "meta" / META_FILE).read_bytes()
    except OSError as error:
        raise MsjaxError(f"checkpoint {path}: its record could not be read: {error}") from None
    return checked_record(path, raw)


def checked_record(path: Path, raw: bytes) -> dict[str, Any]:
    """The record bytes of the step at path, parsed once its seal and fingerprint format are
    checked; MsjaxError naming the step otherwise (evidence of damage, not a failed read)."""
    problem = record_problem(raw)
    if problem is not None:
        raise MsjaxError(f"checkpoint {path} is damaged: {problem}")
    meta = json.loads(raw)
    fingerprint_format = meta.get("fingerprint_format", 1)  # format 1 records had none
    if fingerprint_format not in FINGERPRINT_FORMATS:
        raise MsjaxError(
            f"checkpoint {path} has fingerprint format {fingerprint_format}, newer than this "
            f"msjax reads ({FINGERPRINT_FORMATS[-1]}); restore it with a newer msjax"
        )
    return meta


def check_fingerprints(path: Path, meta: dict[str, Any], actual: dict[str, int]) -> None:
    """MsjaxError naming the step at path when its arrays' fingerprints are not the record's."""
    expected = meta.get("fingerprints", {})
    if expected != actual:
        differing = sorted(key for key in actual if expected.get(key) != actual[key])
        first = differing[0] if differing else "the list of arrays differs"
        raise MsjaxError(
            f"checkpoint {path} is corrupted: {len(differing)} arrays do not match their "
            f"fingerprints (first: {first})"
        )
