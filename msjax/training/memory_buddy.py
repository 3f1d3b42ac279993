"""The link of this process's in-memory snapshots to its buddy (checkpoint.memory_buddy): made
once per process, where the run has snapshots, several processes and a job secret to seal the
copies with, and used both by the restore at start-up and by the snapshots' writer."""

from __future__ import annotations

from pathlib import Path

from msjax.checkpoint.buddies import BuddyLink, coordinator_address
from msjax.checkpoint.snapshots import SHARED_MEMORY
from msjax.config import Config
from msjax.parallel.agreement import JOB_SECRET, job_secret

_links: dict[str, BuddyLink] = {}  # run dir -> this process's link, made at its first use


def buddy_link(config: Config, run_dir: Path) -> tuple[BuddyLink | None, str]:
    """This process's link to its buddy, or None with why there is none ("" where none is asked
    for: no snapshots, checkpoint.memory_buddy=false, or one process). Every process of the job
    decides alike (the same config, process count and job secret), so either all publish their
    server's address or none does."""
    import jax
    from jax._src.distributed import global_state

    checkpoint = config.checkpoint
    if not checkpoint.memory_every_steps or not checkpoint.memory_buddy:
        return None, ""
    if jax.process_count() < 2:
        return None, ""
    secret = job_secret()
    if secret is None:
        return None, f"no job secret to seal them with ({JOB_SECRET}; msjax.launch gives one)"
    key = str(Path(run_dir).absolute())
    if key not in _links:
        _links[key] = BuddyLink(
            Path(run_dir),
            SHARED_MEMORY,
            secret,
            global_state.client,
            coordinator_address(),
            jax.process_index(),
            jax.process_count(),
        )
    return _links[key], ""
