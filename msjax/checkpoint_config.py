"""The checkpoint settings of a run (`checkpoint.*`): disk saves, where to resume from, and the
in-memory snapshots. Their checks are in msjax.config_checks; saving and restoring are in
msjax.checkpoint and msjax.training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class CheckpointConfig:
    """Asynchronous Orbax checkpoints in RUN_DIR/checkpoints, and where to resume from."""

    enabled: bool = True  # false: no checkpoints saved or restored
    every_steps: int = 100  # 0: no periodic saves by step count
    every_minutes: float | None = None  # also save when this much time passed since the last
    max_to_keep: int = 3  # committed checkpoints kept; older ones go once a newer one is good
    keep_every_steps: int | None = None  # checkpoints at multiples of this are never deleted
    resume_from: str | None = None  # a checkpoints dir or run dir, optionally /STEP
    # a failed save: continue (retried with a growing pause while training goes on) or stop
    # (exit code 6 at the first failure)
    on_save_error: Literal["continue", "stop"] = "continue"
    # while saves keep failing (retried with a growing pause), training goes on for at most this
    # long after the last good checkpoint; then the attempt ends with exit code 6 (retried)
    max_unsaved_minutes: float | None = 60.0
    # when checkpoints exist but none restores: stop (exit 2, one line per checkpoint) or restart
    # from step 0
    if_none_valid: Literal["stop", "restart"] = "stop"
    # every this many steps each process copies its shards of the state to /dev/shm (kept two
    # deep, outliving a killed worker); a restart restores the newest whole one. 0: off
    memory_every_steps: int = 0
    # the snapshots (each process's shards, twice: double-buffered) may take at most this share
    # of the RAM its host can give (MemAvailable, and the free space of /dev/shm); more: they are
    # off for the run, said in one line; in (0, 1]
    memory_max_fraction: float = 0.5
    # a snapshot due while the one before is still being written (on any process): skip it (the
    # steps keep their pace; a fault may then lose more than memory_every_steps steps) or wait
    # for that write on every process and take it (at most memory_every_steps steps lost per
    # fault; the wait stalls the step)
    memory_when_busy: Literal["skip", "wait"] = "skip"
    # with memory snapshots in a job of several processes under msjax.launch (its job secret
    # seals them), each process also sends every snapshot to its buddy, a process on another
    # node where the job spans several, which keeps it in its own /dev/shm: a restart whose node
    # lost its memory restores from that copy. false: each process keeps only its own
    memory_buddy: bool = True
