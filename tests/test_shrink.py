"""Going on without a broken slot: the mesh re-planned for fewer processes keeps the global
batch, and a job excluding a crash-looping slot finishes on the shrunk mesh."""

from __future__ import annotations

import pytest

from msjax.config import load_config
from msjax.errors import MsjaxError
from msjax.launch.membership import MeshPlan, replan_mesh
from tests.small_runs import QUICK_RUN


def job(*overrides: str):
    return load_config(None, [*QUICK_RUN, *overrides])


# --- re-planning the mesh ------------------------------------------------------------------------


def test_replan_keeps_tensor_shrinks_data_and_fsdp_and_accumulates_to_keep_the_batch():
    config = job("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.global_batch=8")
    plan = replan_mesh(config, devices_per_proc=2, job_processes=4, healthy_processes=3)
    # 3 processes hold 6 devices, tensor 2 leaves 3 replicas, which do not divide 8: 2 do, and
    # fsdp stays the larger (memory per device); 4 rows per replica in 2 passes of 2, as before
    assert plan == MeshPlan(data=1, fsdp=2, pipe=1, tensor=2, grad_accum_steps=2, processes=2)
    assert plan.overrides() == [
        "mesh.data=1",
        "mesh.fsdp=2",
        "mesh.pipe=1",
        "mesh.tensor=2",
        "train.grad_accum_steps=2",
    ]


def test_replan_uses_every_healthy_process_when_the_batch_allows():
    config = job("mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1", "train.global_batch=12")
    plan = replan_mesh(config, devices_per_proc=1, job_processes=4, healthy_processes=3)
    # 3 rows per replica and pass before; 4 rows per replica now, in 2 passes of at most 3
    assert (plan.data, plan.fsdp, plan.processes, plan.grad_accum_steps) == (3, 1, 3, 2)
    # 12 rows over 4 replicas in 3 passes: 1 row per pass; on 3 replicas 4 passes keep that
    config = job(
        "mesh.data=4",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "train.global_batch=12",
        "train.grad_accum_steps=3",
    )
    plan = replan_mesh(config, devices_per_proc=1, job_processes=4, healthy_processes=3)
    assert (plan.data, plan.grad_accum_steps) == (3, 4)


def test_replan_with_every_process_healthy_is_the_jobs_own_mesh_with_its_minus_one_filled():
    config = job("mesh.data=-1", "mesh.fsdp=2", "mesh.tensor=1", "train.grad_accum_steps=2")
    plan = replan_mesh(config, devices_per_proc=2, job_processes=4, healthy_processes=4)
    assert plan == MeshPlan(data=4, fsdp=2, pipe=1, tensor=1, grad_accum_steps=2, processes=4)


def test_replan_keeps_the_pipeline_and_its_microbatches_dividing_each_pass():
    config = job(
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.pipe=2",
        "mesh.tensor=1",
        "pipeline.microbatches=2",
        "train.global_batch=8",
    )
    plan = replan_mesh(config, devices_per_proc=2, job_processes=2, healthy_processes=1)
    # one replica of 2 stages on the healthy process: 8 rows in 2 passes of 4 (as before, 4
    # rows per replica per pass), each pass split into the pipeline's 2 microbatches
    assert (plan.data, plan.fsdp, plan.pipe, plan.grad_accum_steps, plan.processes) == (
        1,
        1,
        2,
        2,
        1,
    )


def test_replan_refuses_in_one_line_where_no_mesh_fits_the_healthy_processes():
    config = job("mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4")
    with pytest.raises(MsjaxError) as refused:
        replan_mesh(config, devices_per_proc=2, job_processes=4, healthy_processes=1)
    message = str(refused.value)
    assert "\n" not in message
    assert "1 healthy processes x 2 devices" in message and "pipe x tensor = 4" in message
