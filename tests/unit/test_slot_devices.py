"""A slot is a set of devices: which GPUs each slot of a node owns (msjax.launch.devices), and what
a worker in a Slurm job step hands jax.distributed for them: its slot's devices, not the GPU
SLURM_LOCALID that JAX's own Slurm detection would keep (the per-slot environment of a real
supervised job, spares included, is checked in
tests/jobs/test_shrink.py and tests/jobs/test_blame.py)."""

from __future__ import annotations

import pytest

from msjax.errors import MsjaxError
from msjax.launch.devices import NodeGpus, devices_per_slot, node_gpus, slot_device_env

EIGHT = NodeGpus(tuple(str(n) for n in range(8)), "8 GPUs in /dev")


def test_each_slot_owns_its_own_run_of_the_gpus_the_node_was_given():
    given = node_gpus({"CUDA_VISIBLE_DEVICES": "4,5,6,7,GPU-9a,GPU-9b"})
    assert given is not None and given.ids == ("4", "5", "6", "7", "GPU-9a", "GPU-9b")
    assert [slot_device_env(slot, 2, given)["CUDA_VISIBLE_DEVICES"] for slot in range(3)] == [
        "4,5",
        "6,7",
        "GPU-9a,GPU-9b",
    ]
    # the worker sees its own GPUs alone, so its local devices are the first d it sees
    assert slot_device_env(2, 2, given)["MSJAX_LOCAL_DEVICE_IDS"] == "0,1"
    assert slot_device_env(3, 2, EIGHT) == {
        "CUDA_VISIBLE_DEVICES": "6,7",
        "MSJAX_LOCAL_DEVICE_IDS": "0,1",
    }


def test_a_cpu_node_gets_no_gpu_environment(tmp_path):
    assert node_gpus({"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0,1"}) is None
    assert node_gpus({"CUDA_VISIBLE_DEVICES": ""}) is None
    assert node_gpus({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}) is None
    assert node_gpus({}, dev=tmp_path) is None  # no CUDA plugin here, no /dev/nvidiaN
    assert slot_device_env(1, 4, None) == {}
    assert devices_per_slot(3, 4, None) == 4  # CPU devices: as many as asked for


def test_gpus_are_shared_out_evenly_by_default_and_a_slot_never_gets_fewer_than_asked():
    assert devices_per_slot(2, None, EIGHT) == 4
    assert devices_per_slot(3, 2, EIGHT) == 2
    with pytest.raises(MsjaxError) as error:
        devices_per_slot(3, 4, EIGHT)  # 2 workers and a spare, 4 GPUs each
    assert str(error.value).startswith("3 slot(s) x 4 GPU(s) each need 12 GPUs; this node has 8")
