"""Which steps of a checkpoints directory Orbax committed, read from the file system alone (no
JAX, no Orbax): for the supervisor, which never imports JAX, and for the checkpoint manager."""

from __future__ import annotations

from pathlib import Path

# Orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it to `<step>` when the
# save is finalized; a finalized step directory also holds this metadata file.
COMMIT_MARKER = "_CHECKPOINT_METADATA"
TMP_MARKER = ".orbax-checkpoint-tmp"


def committed_steps(directory: Path) -> list[int]:
    """Steps whose directory Orbax finalized, oldest first (a killed save leaves none)."""
    if not directory.is_dir():
        return []
    return sorted(
        int(entry.name)
        for entry in directory.iterdir()
        if entry.is_dir() and entry.name.isdigit() and (entry / COMMIT_MARKER).exists()
    )


def newest_committed_step(directory: Path) -> int | None:
    """The newest committed step in directory; None when none is (or none is readable)."""
    try:
        steps = committed_steps(directory)
    except OSError:
        return None
    return steps[-1] if steps else None


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
