"""The device mesh: axes `data`, `fsdp`, `tensor` (outermost first), built from the config.

`tensor` is innermost so that tensor-parallel collectives stay between neighbouring devices
(within a node on GPUs). A `pipe` axis would slot in between `fsdp` and `tensor`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from msjax.config import Config, MeshConfig, resolve_mesh_shape

MESH_AXES = ("data", "fsdp", "tensor")


def configure_cpu_devices(config: Config) -> int | None:
    """Before JAX starts: simulate as many CPU devices as the mesh needs.

    `JAX_NUM_CPU_DEVICES`, when set, wins; otherwise the product of the mesh axes in the config
    (an axis of -1 counts as 1). Only the CPU backend reads this, so GPU runs are unaffected.
    Returns the count asked for, or None when the environment decides.
    """
    if os.environ.get("JAX_NUM_CPU_DEVICES"):
        return None
    count = 1
    for size in config.mesh.axis_sizes().values():
        count *= max(size, 1)
    jax.config.update("jax_num_cpu_devices", count)
    return count


def build_mesh(mesh: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over devices (all of them by default) with -1 resolved; GSPMD (Auto) axes."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(mesh, len(devices))
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )
