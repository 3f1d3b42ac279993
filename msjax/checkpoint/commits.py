"""Which steps of a checkpoints directory Orbax committed, read from the file system alone (no
JAX, no Orbax): for the supervisor, which never imports JAX, and for the checkpoint manager; the
steps found damaged, and where checkpoint.resume_from points."""

from __future__ import annotations

from pathlib import Path

from msjax.errors import MsjaxError
from msjax.run_dir import RunDir

# Orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it to `<step>` when the
# save is finalized; a finalized step directory also holds this metadata file.
COMMIT_MARKER = "_CHECKPOINT_METADATA"
TMP_MARKER = ".orbax-checkpoint-tmp"
DAMAGED_DIR = "damaged"  # checkpoints/damaged/STEP: found damaged on restore, kept for a look


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


def damaged_entries(directory: Path) -> list[str]:
    """Names under DIRECTORY/damaged/: steps found damaged by earlier restores."""
    damaged = directory / DAMAGED_DIR
    return sorted(entry.name for entry in damaged.iterdir()) if damaged.is_dir() else []


def resume_source(
    source: str | None, own: Path, continues_run: bool
) -> tuple[Path, int | None] | None:
    """checkpoint.resume_from (source), parsed and checked: a finished checkpoint, of STEP if
    named; None where it does not apply: unset, or the run dir continues a run whose own
    checkpoints (own) hold a committed step or damaged ones (it saved before: reruns and
    restarts resume from there)."""
    if not source or (continues_run and (committed_steps(own) or damaged_entries(own))):
        return None
    directory, step = parse_resume_source(source)
    steps = committed_steps(directory)
    if not steps or (step is not None and step not in steps):
        wanted = f"of step {step} " if step is not None else ""
        finished = ", ".join(map(str, steps[-5:])) or "none"
        raise MsjaxError(
            f"checkpoint.resume_from={source}: no finished checkpoint {wanted}in {directory} "
            f"(finished steps: {finished})"
        )
    return directory, step
