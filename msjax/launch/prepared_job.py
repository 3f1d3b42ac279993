"""A launch made ready before any worker starts: the job's config and devices, the run dir planned,
checked, locked and created, the workers' config written, and its supervisor built.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from msjax.data.sources import check_sources
from msjax.distributed import ensure_job_secret
from msjax.errors import MsjaxError
from msjax.launch.devices import default_devices_per_proc, devices_per_slot, node_gpus
from msjax.launch.job_options import LaunchOptions, job_config
from msjax.launch.layout import JobLayout
from msjax.launch.supervisor import Supervisor
from msjax.llama_config import model_from_init
from msjax.resolve import fixed_mesh_device_count
from msjax.run_dir import create_run_dir, plan_run_dir, write_text_atomically
from msjax.run_lock import RunDirLock
from msjax.writable import WriteFailed, write_private_file


@dataclass
class PreparedJob:
    """A supervisor ready to run, and what the launch holds until it ends: the run dir's lock
    (node 0's launcher; its workers restart under it) and a node-local copy of the config."""

    supervisor: Supervisor | None = None
    lock: RunDirLock | None = None
    node_config: Path | None = None

    def run(self) -> int:
        """Supervise the job, then let go of what the launch held; the launcher's exit code."""
        assert self.supervisor is not None
        try:
            return self.supervisor.run()
        finally:
            self.release()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
        if self.node_config is not None:
            self.node_config.unlink(missing_ok=True)


def prepare_job(options: LaunchOptions) -> PreparedJob:
    """Everything before the first worker; an MsjaxError (the user's) or a WriteFailed (the
    disk's) leaves nothing held."""
    job = PreparedJob()
    try:
        job.supervisor = _build(options, job)
    except (MsjaxError, WriteFailed):
        job.release()
        raise
    return job


def _build(options: LaunchOptions, job: PreparedJob) -> Supervisor:
    config = job_config(options.train_args, options.max_restarts, options.nnodes)
    devices = options.devices_per_proc
    if devices is None:
        mesh_devices = fixed_mesh_device_count(config.mesh)
        devices = default_devices_per_proc(mesh_devices, options.nprocs * options.nnodes)
    elif devices < 1:
        raise MsjaxError(f"--devices-per-proc={devices} must be at least 1")
    devices = devices_per_slot(options.nprocs + options.spares, devices, node_gpus())
    plan = plan_run_dir(config)  # another run's config there: refused before any worker
    check_sources(config.data)
    model_from_init(config)  # a bad Hugging Face directory: refused before any run dir
    plan.path.mkdir(parents=True, exist_ok=True)
    # The job holds the lock (node 0's launcher), not its workers: restarts are not refused.
    if options.node_rank == 0:
        job.lock = RunDirLock(plan.run_dir)
        job.lock.acquire()
        aside = create_run_dir(plan)
        if aside is not None:
            print(f"msjax.launch: the earlier run in {plan.path} moved to {aside}")
    # Workers read this file rather than parsing the arguments again. Node 0 alone writes the
    # run dir's copy; every other node's workers read the same config from a node-local file.
    if options.node_rank == 0:
        worker_config = plan.run_dir.job_config
        write_text_atomically(worker_config, config.to_yaml())
    else:
        worker_config = job.node_config = write_private_file(
            config.to_yaml(), "msjax-job-config-", ".yaml", "the workers' config"
        )
    if not ensure_job_secret(options.nnodes):
        print(
            "msjax.launch: warning: MSJAX_JOB_SECRET is not set, so this multi-node job's "
            "coordination records are not sealed (docs/recovery.md, "
            '"The coordination service on a shared node")',
            file=sys.stderr,
        )
    layout = JobLayout(
        options.nprocs, devices, options.nnodes, options.node_rank, options.coordinator
    )
    worker_args = ["--config", str(worker_config)]
    return Supervisor(
        config, plan.path, worker_args, layout, faults=options.fault, spares=options.spares
    )
