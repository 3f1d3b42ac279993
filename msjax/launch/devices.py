"""Which devices each slot of a node owns, decided by the launcher without starting JAX.

On a GPU node, slot i owns the node's GPUs [i*d, (i+1)*d) (d: --devices-per-proc) of those the
node was given: the CUDA_VISIBLE_DEVICES list the launcher inherited (Slurm sets one), else every
GPU of the machine. Its worker sees only them (CUDA_VISIBLE_DEVICES) and hands them to
jax.distributed as its local devices (MSJAX_LOCAL_DEVICE_IDS), so that leaving a slot out leaves
its GPUs out. On CPU each worker simulates d devices (JAX_NUM_CPU_DEVICES), as set elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from msjax.distributed import LOCAL_DEVICE_IDS, VISIBLE_DEVICES
from msjax.errors import MsjaxError
from msjax.parallel.xla_flags import gpu_expected

NO_GPU_VALUES = ("-1", "NoDevFiles")  # CUDA_VISIBLE_DEVICES values that mean no GPU


@dataclass(frozen=True)
class NodeGpus:
    """The GPUs a node was given, in CUDA_VISIBLE_DEVICES's terms, and where that came from."""

    ids: tuple[str, ...]  # device numbers or UUIDs, as CUDA_VISIBLE_DEVICES takes them
    source: str


def node_gpus(environ: Mapping[str, str] = os.environ, dev: Path = Path("/dev")) -> NodeGpus | None:
    """The node's GPUs; None on a CPU node (JAX_PLATFORMS names no GPU platform, no GPU was
    given, or there is none to be seen)."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and not {"cuda", "gpu"} & set(platforms.lower().split(",")):
        return None
    if VISIBLE_DEVICES in environ:
        given = environ[VISIBLE_DEVICES]
        ids = tuple(part.strip() for part in given.split(",") if part.strip())
        if not ids or ids[0] in NO_GPU_VALUES:
            return None
        return NodeGpus(ids, f"{VISIBLE_DEVICES}={given}")
    if not gpu_expected(dict(environ)):
        return None
    count = sum(1 for path in dev.glob("nvidia*") if path.name[len("nvidia") :].isdigit())
    if not count:
        return None
    return NodeGpus(tuple(str(number) for number in range(count)), f"{count} GPUs in {dev}")


def slot_device_env(
    slot: int, devices_per_proc: int | None, gpus: NodeGpus | None
) -> dict[str, str]:
    """What the worker of `slot` gets in its environment to use its own GPUs alone: {} on a CPU
    node (or with no per-slot count)."""
    if gpus is None or devices_per_proc is None:
        return {}
    owned = gpus.ids[slot * devices_per_proc : (slot + 1) * devices_per_proc]
    return {
        VISIBLE_DEVICES: ",".join(owned),
        LOCAL_DEVICE_IDS: ",".join(str(index) for index in range(len(owned))),
    }


def slot_devices(slot: int, devices_per_proc: int | None) -> dict[str, str]:
    """slot_device_env on the GPUs of this launcher's node."""
    return slot_device_env(slot, devices_per_proc, node_gpus())


def default_devices_per_proc(mesh_devices: int | None, num_processes: int) -> int | None:
    """--devices-per-proc when not given: the mesh's devices shared out over the job's
    processes; None when the mesh leaves its size to the devices (an axis of -1)."""
    if mesh_devices is None:
        return None
    if mesh_devices % num_processes:
        raise MsjaxError(
            f"the mesh's {mesh_devices} devices do not split over {num_processes} processes; "
            "pass --devices-per-proc"
        )
    return mesh_devices // num_processes


def devices_per_slot(slots: int, devices_per_proc: int | None, gpus: NodeGpus | None) -> int | None:
    """The devices each of a node's `slots` owns (its workers and spares): --devices-per-proc
    when given, on a GPU node else the node's GPUs shared out evenly. MsjaxError when the slots
    need more GPUs than the node was given."""
    if gpus is None:
        return devices_per_proc
    if devices_per_proc is None:
        devices_per_proc = len(gpus.ids) // slots
    if devices_per_proc < 1 or slots * devices_per_proc > len(gpus.ids):
        raise MsjaxError(
            f"{slots} slot(s) x {max(devices_per_proc, 1)} GPU(s) each need "
            f"{slots * max(devices_per_proc, 1)} GPUs; this node has {len(gpus.ids)} "
            f"({gpus.source}): lower --nprocs, --spares or --devices-per-proc (or set "
            "JAX_PLATFORMS=cpu for simulated CPU devices)"
        )
    return devices_per_proc
