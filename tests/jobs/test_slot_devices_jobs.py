"""A slot is a set of devices: which GPUs each slot of a node owns (msjax.launch.devices), and what
a worker in a Slurm job step hands jax.distributed for them: its slot's devices, not the GPU
SLURM_LOCALID that JAX's own Slurm detection would keep (the per-slot environment of a real
supervised job, spares included, is checked in
tests/jobs/test_shrink.py and tests/jobs/test_blame.py)."""

from __future__ import annotations

import subprocess
import sys

from harness import distributed_env, free_port, job_env, launch_command, run_to_end
from slurm_step import SLURM_STEP_ENV


def handed_to_jax(extra_env: dict[str, str]) -> list[str]:
    """The last lines of a one-process jax.distributed job in a Slurm job step's environment
    (the variables JAX's Slurm detection reads): what the worker printed and what JAX's
    jax_cuda_visible_devices holds after msjax.distributed.initialize_distributed."""
    env = job_env(
        **SLURM_STEP_ENV, **distributed_env(f"127.0.0.1:{free_port()}", 1, 0), **extra_env
    )
    program = (
        "import jax\n"
        "from msjax.distributed import JobEnv, announce_devices, initialize_distributed\n"
        "job = JobEnv.read()\n"
        "initialize_distributed(job)\n"
        "announce_devices(job)\n"
        "print('jax_cuda_visible_devices', jax.config.values['jax_cuda_visible_devices'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_a_worker_under_slurm_hands_jax_its_slots_devices_not_the_gpu_of_its_local_id():
    # slot 1 of a node given GPUs 4-7, two each: it sees GPUs 6 and 7 as its devices 0 and 1
    lines = handed_to_jax({"CUDA_VISIBLE_DEVICES": "6,7", "MSJAX_LOCAL_DEVICE_IDS": "0,1"})
    assert lines[-2:] == [
        "msjax: process 0: devices CUDA_VISIBLE_DEVICES=6,7, local devices 0,1",
        "jax_cuda_visible_devices 0,1",
    ]


def test_slots_that_need_more_gpus_than_the_node_was_given_are_refused_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    command = launch_command(run_dir, ["train.steps=1"], nprocs=2, devices_per_proc=2)
    done = run_to_end(command, 300, CUDA_VISIBLE_DEVICES="0,1")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.splitlines() == [
        "msjax.launch: error: 2 slot(s) x 2 GPU(s) each need 4 GPUs; this node has 2 "
        "(CUDA_VISIBLE_DEVICES=0,1): lower --nprocs, --spares or --devices-per-proc (or set "
        "JAX_PLATFORMS=cpu for simulated CPU devices)"
    ]
    assert not run_dir.exists()  # refused before anything was written
