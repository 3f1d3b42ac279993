"""The device mesh: axes `data`, `fsdp`, `expert`, `pipe`, `tensor` (outermost first), from the
config.

`tensor` is innermost so that tensor-parallel collectives stay between neighbouring devices
(within a node on GPUs); `pipe` comes next, so pipeline stages sit on neighbouring nodes and only
point-to-point transfers cross between them (MegaScale's tensor x pipeline x data layout).
`expert` is carved out of the data-parallel devices (as MaxText and Megatron do): MoE runs without
a pipeline, so its all-to-all stays between the devices just outside `tensor`.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from msjax.config import MeshConfig

MESH_AXES = ("data", "fsdp", "expert", "pipe", "tensor")


def named_place(place: Sequence[int], shape: Sequence[int]) -> dict[str, int]:
    """A device's mesh coordinates (`place`, in MESH_AXES order, on a mesh of `shape`) by axis
    name, for people and records: all axes but `expert` where it is 1, so a mesh without expert
    parallelism is named as it always was."""
    return {
        axis: int(index)
        for axis, index, size in zip(MESH_AXES, place, shape, strict=True)
        if axis != "expert" or size > 1
    }


def configure_cpu_devices(count: int) -> bool:
    """Before JAX starts: simulate `count` CPU devices, unless `JAX_NUM_CPU_DEVICES` decides.

    Only the CPU backend reads this, so GPU runs are unaffected. Returns whether it was set; a
    backend that has already started keeps the devices it has.
    """
    if os.environ.get("JAX_NUM_CPU_DEVICES"):
        return False
    with contextlib.suppress(RuntimeError):  # the backend already started (as in tests)
        jax.config.update("jax_num_cpu_devices", count)
        return True
    return False


def build_mesh(mesh: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over devices (all of them by default) of a resolved mesh config; GSPMD axes."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh.axis_sizes()
    if -1 in sizes.values() or math.prod(sizes.values()) != len(devices):
        raise ValueError(f"build_mesh needs a mesh resolved for {len(devices)} devices: {sizes}")
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )
