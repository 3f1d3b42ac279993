"""What a corpus is, as a checkpoint records it, and what changed between two of them; and what
each source holds, as the run record tells it (`corpus_facts`).

Per source: its files with their sha256 (text) or size (token files, read in place), or the
stdlib listing's digest, and the token-store key; plus the tokenizer. A resumed run compares
the identity it reads with the one its checkpoint was trained on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msjax.data.sources import SourceStreams
from msjax.errors import MsjaxError

if TYPE_CHECKING:
    from msjax.data.dataset import TrainingData


def corpus_facts(data: TrainingData) -> dict[str, Any]:
    """What each source of the run's data holds, for the run record (data_facts.json)."""
    return {
        "tokenizer": data.tokenizer.name,
        "sources": [
            {"path": streams.label, **streams.facts, "train_sequences": packed.num_sequences}
            for streams, packed in zip(data.sources, data.train.sources, strict=True)
        ],
    }


def corpus_identity(tokenizer_name: str, sources: list[SourceStreams]) -> dict[str, Any]:
    """JSON-able identity of the corpus: independent of cache location, machine and mtimes."""
    identities = []
    for streams in sources:
        facts = streams.facts
        files = {}
        for entry in facts.get("files", []):
            # a text file is its hash; a token file, too large to hash at start, its size
            files[entry["path"]] = entry.get("sha256") or f"{entry.get('size_bytes')} bytes"
        identity: dict[str, Any] = {"path": streams.label, "kind": facts.get("kind")}
        if files:
            identity["files"] = files
        if "files_sha256" in facts:  # stdlib: thousands of files, one digest of their listing
            identity["files_sha256"] = facts["files_sha256"]
        if "store" in facts:  # the token store's key: files, tokenizer, split, format
            identity["token_store"] = Path(facts["store"]).name
        identities.append(identity)
    return {"tokenizer": tokenizer_name, "sources": identities}


def corpus_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs from the saved identity to the current one, one phrase each (empty: same)."""
    changes = []
    if saved.get("tokenizer") != current.get("tokenizer"):
        changes.append(f"tokenizer {saved.get('tokenizer')} -> {current.get('tokenizer')}")
    saved_sources = {source["path"]: source for source in saved.get("sources", [])}
    current_sources = {source["path"]: source for source in current.get("sources", [])}
    for path in saved_sources.keys() - current_sources.keys():
        changes.append(f"source {path} removed")
    for path in current_sources.keys() - saved_sources.keys():
        changes.append(f"source {path} added")
    for path in sorted(saved_sources.keys() & current_sources.keys()):
        before, after = saved_sources[path], current_sources[path]
        found_before = len(changes)
        if before.get("kind") != after.get("kind"):
            changes.append(f"source {path}: {before.get('kind')} -> {after.get('kind')}")
        before_files, after_files = before.get("files", {}), after.get("files", {})
        for name in sorted(before_files.keys() - after_files.keys()):
            changes.append(f"source {path}: file {name} removed")
        for name in sorted(after_files.keys() - before_files.keys()):
            changes.append(f"source {path}: file {name} added")
        for name in sorted(before_files.keys() & after_files.keys()):
            if before_files[name] != after_files[name]:
                changes.append(
                    f"source {path}: file {name} changed "
                    f"({_short(before_files[name])} -> {_short(after_files[name])})"
                )
        if before.get("files_sha256") != after.get("files_sha256"):
            changes.append(f"source {path}: its file listing changed")
        if len(changes) == found_before and before.get("token_store") != after.get("token_store"):
            changes.append(f"source {path}: its token store key changed")
    return changes


def allowed_corpus_changes(
    saved_data: dict[str, Any],
    corpus: dict[str, Any],
    allow_changed: bool,
    step: int,
    checkpoint: Path,
    message: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Refuse to resume from checkpoint (saved_data: what it records of its data) on another
    corpus than its own, unless data.allow_changed=true (allow_changed).

    Returns the allowed changes to record in later checkpoints (earlier ones carried along).
    """
    earlier = list(saved_data.get("allowed_changes", []))
    saved = saved_data.get("corpus")
    if saved is None:
        return earlier  # saved before checkpoints recorded their corpus
    changes = corpus_changes(saved, corpus)
    if not changes:
        return earlier
    what = f"the corpus differs from the one checkpoint {checkpoint} was trained on: " + "; ".join(
        changes
    )
    if not allow_changed:
        raise MsjaxError(
            f"{what}; resume with that data, or pass data.allow_changed=true to go on with this "
            "one (recorded in every later checkpoint)"
        )
    message(f"warning: {what}; going on (data.allow_changed=true, recorded in the checkpoints)")
    return [*earlier, {"at_step": step, "changes": changes}]


def _short(value: str) -> str:
    return value[:12] if len(value) == 64 else value  # a sha256 shortened to read
