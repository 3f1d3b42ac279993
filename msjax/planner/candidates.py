"""Which meshes can run a config: parsing `data,fsdp,tensor` (pipe 1) or `data,fsdp,pipe,tensor`
sizes and enumerating factorisations.

A mesh is rejected here, before any compile, when its sizes do not multiply to the device count or
when the config's divisibility checks (`msjax.resolve.check_device_count`) fail for it. A config
made for a mesh is resolved for a backend, as a run would be: compiles never see `auto`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from msjax.config import Config
from msjax.errors import ConfigError, MsjaxError
from msjax.resolve import check_device_count, resolve_mesh_shape, resolve_model, with_layer_loop

PLANNED_BACKEND = "gpu"  # what plans are for unless a backend is named


@dataclass(frozen=True, order=True)
class MeshShape:
    """Sizes of the mesh axes `data`, `fsdp`, `tensor` and `pipe` (written data,fsdp,pipe,tensor:
    mesh order, outermost first; three numbers when pipe is 1)."""

    data: int
    fsdp: int
    tensor: int
    pipe: int = 1
    expert: int = 1  # expert parallelism (MoE): carved out of the data-parallel devices

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.expert * self.pipe * self.tensor

    def sizes(self) -> dict[str, int]:
        return {
            "data": self.data,
            "fsdp": self.fsdp,
            "expert": self.expert,
            "pipe": self.pipe,
            "tensor": self.tensor,
        }

    def __str__(self) -> str:
        if self.pipe == 1:
            return f"{self.data},{self.fsdp},{self.tensor}"
        return f"{self.data},{self.fsdp},{self.pipe},{self.tensor}"

    def describe(self) -> str:
        """`data 2 x fsdp 2 x pipe 2 x tensor 1` (pipe left out when 1)."""
        return " x ".join(
            f"{axis} {size}"
            for axis, size in self.sizes().items()
            if axis not in ("pipe", "expert") or size > 1
        )


def parse_mesh(text: str) -> MeshShape:
    """`"2,2,2"` -> data 2, fsdp 2, tensor 2; `"2,1,2,2"` -> data 2, fsdp 1, pipe 2, tensor 2.

    MsjaxError naming the text if it is not three or four positive sizes.
    """
    parts = text.strip().split(",")
    try:
        sizes = [int(part) for part in parts]
    except ValueError:
        sizes = []
    if len(sizes) not in (3, 4) or min(sizes) < 1:
        raise MsjaxError(
            f"mesh {text!r} is not three positive sizes data,fsdp,tensor (e.g. 2,2,2), four "
            "data,fsdp,pipe,tensor (e.g. 2,1,2,2), or 'auto'"
        )
    if len(sizes) == 3:
        return MeshShape(*sizes)
    data, fsdp, pipe, tensor = sizes
    return MeshShape(data, fsdp, tensor, pipe)


def factorisations(
    device_count: int, pipe: bool = True, experts: tuple[int, ...] = (1,)
) -> list[MeshShape]:
    """Every (data, fsdp, expert, pipe, tensor) whose product is device_count (pipe 1 only
    unless `pipe`; expert sizes from `experts`), most data-parallel first."""
    divisors = [size for size in range(1, device_count + 1) if device_count % size == 0]
    meshes = [
        MeshShape(data, fsdp, device_count // (data * fsdp * stages * expert), stages, expert)
        for data in divisors
        for fsdp in divisors
        for expert in experts
        for stages in (divisors if pipe else [1])
        if device_count % (data * fsdp * stages * expert) == 0
    ]
    return sorted(meshes, reverse=True)


def expert_sizes(config: Config, device_count: int) -> tuple[int, ...]:
    """The `expert` axis sizes to try: those dividing both the MoE layers' experts and the
    devices (1 alone for a dense model)."""
    num_experts = config.model.moe.num_experts
    if num_experts == 0:
        return (1,)
    return tuple(
        size
        for size in range(1, num_experts + 1)
        if num_experts % size == 0 and device_count % size == 0
    )


def config_for_mesh(config: Config, mesh: MeshShape, backend: str = PLANNED_BACKEND) -> Config:
    """The config on `mesh` with its kernels resolved for `backend`.

    ConfigError naming the mesh if the config cannot run on it, or naming the kernel if `backend`
    cannot run it.
    """
    model = resolve_model(config.model, backend)
    sizes = dataclasses.replace(config.mesh, **mesh.sizes())
    replaced = dataclasses.replace(config, model=model, mesh=sizes)
    try:
        return with_layer_loop(check_device_count(replaced, mesh.devices), backend)
    except ConfigError as error:
        raise ConfigError(f"mesh {mesh} ({mesh.describe()}): {error}") from None


def valid_meshes(
    config: Config, device_count: int, backend: str = PLANNED_BACKEND
) -> list[MeshShape]:
    """The factorisations of device_count that pass the config's checks; with pipe sizes only
    when the config asks for a pipeline (mesh.pipe other than 1), since the step-time prediction
    does not price the pipeline's bubble yet; with expert sizes for a MoE model."""
    valid = []
    pipe = config.mesh.pipe != 1
    for mesh in factorisations(device_count, pipe, expert_sizes(config, device_count)):
        try:
            config_for_mesh(config, mesh, backend)
        except ConfigError:
            continue
        valid.append(mesh)
    return valid


def mesh_of_config(
    config: Config, device_count: int, backend: str = PLANNED_BACKEND
) -> MeshShape | None:
    """The config's own mesh on device_count devices (-1 filled in), or None if it cannot run."""
    try:
        filled = resolve_mesh_shape(config.mesh, device_count)
        mesh = MeshShape(**filled)
        config_for_mesh(config, mesh, backend)
    except ConfigError:
        return None
    return mesh
