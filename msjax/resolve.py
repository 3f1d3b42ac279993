"""Resolve once: a loaded config plus the devices and backend it runs on give the run's config.

Resolution fills in every choice that depends on where the run happens: the `-1` mesh axis, the
kernel behind each `model.*_impl` (`auto` becomes what will actually run), and `run.dir`. It also
checks that the mesh fits the devices. The resolved config is saved in the run directory and is
what every part of a run reads; nothing downstream derives these choices again.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from datetime import UTC, datetime
from pathlib import Path
from typing import get_args

from msjax.config import Config, MeshConfig, ModelConfig
from msjax.config_checks import check_divisible_by_mesh
from msjax.errors import ConfigError
from msjax.llama_config import model_from_init
from msjax.moe_config import MoeConfig

RUNS_FOLDER = Path("runs")
# Kernels with no interpreter: they run on a GPU or not at all.
GPU_ONLY_IMPLS = ("cudnn", "triton")


@functools.cache
def impl_choices(key: str) -> tuple[str, ...]:
    """What `model.<key>` accepts besides `auto`, read from the config's own Literal type (a key
    of the MoE section as `moe.matmul_impl`)."""
    section, _, name = key.rpartition(".")
    owner = MoeConfig if section == "moe" else ModelConfig
    choices = get_args(typing.get_type_hints(owner)[name])
    return tuple(choice for choice in choices if choice != "auto")


IMPL_KEYS = ("attention_impl", "norm_impl", "loss_impl")
# What `auto` runs on a GPU. cuDNN's fused attention and XLA's norm and loss: the Pallas kernels
# sit on the deprecated Pallas Triton backend and have no device figures yet showing them at
# least as fast (benchmarks/gpu_suite.py measures that); `pallas` stays selectable.
# The experts' grouped matmul: ragged_dot until a device figure shows the Pallas kernel faster.
GPU_AUTO_IMPLS = {
    "attention_impl": "cudnn",
    "norm_impl": "xla",
    "loss_impl": "xla",
    "moe.matmul_impl": "xla",
}
# What `auto` runs on CPU where it is not the reference: the padded row blocks run the routed
# experts alone, where XLA's CPU ragged_dot runs every expert on every routed row (exact, and
# 1.45-1.77x the MoE step's tokens/s of ragged_dot in benchmarks/moe.py).
CPU_AUTO_IMPLS = {"moe.matmul_impl": "blocks"}
CUDNN_DTYPES = ("bfloat16", "float16")  # cuDNN flash attention takes 16-bit inputs only
CUDNN_MAX_HEAD_DIM = 256


def cudnn_attention_fits(model: ModelConfig) -> bool:
    """Whether cuDNN fused attention takes this model: 16-bit compute, head_dim % 8 == 0, <= 256."""
    head_dim = model.resolved_head_dim
    return (
        model.compute_dtype in CUDNN_DTYPES and head_dim % 8 == 0 and head_dim <= CUDNN_MAX_HEAD_DIM
    )


def resolve_impl(impl: str, key: str, backend: str, cudnn_fits: bool = True) -> str:
    """`auto` -> GPU_AUTO_IMPLS on GPU, CPU_AUTO_IMPLS (or `xla`) on CPU and `xla` elsewhere; a
    GPU-only kernel off GPU is a
    ConfigError. On GPU, `auto` attention is `xla` where cuDNN does not take the model
    (cudnn_fits, from cudnn_attention_fits).

    key is the config knob's name in its section (`attention_impl`), so the message names the fix.
    """
    choices = impl_choices(key)
    if impl not in ("auto", *choices):
        raise ConfigError(
            f"model.{key}={impl!r} is not accepted; choose one of auto, {', '.join(choices)}"
        )
    if impl == "auto":
        if backend == "cpu" and key in CPU_AUTO_IMPLS:
            return CPU_AUTO_IMPLS[key]
        if backend != "gpu" or (GPU_AUTO_IMPLS[key] == "cudnn" and not cudnn_fits):
            return "xla"
        return GPU_AUTO_IMPLS[key]
    if impl in GPU_ONLY_IMPLS and backend != "gpu":
        runnable = [choice for choice in ("auto", *choices) if choice not in GPU_ONLY_IMPLS]
        raise ConfigError(
            f"model.{key}={impl} needs a GPU, but this run's backend is {backend}; "
            f"use {', '.join(runnable)}"
        )
    return impl


def resolve_layer_loop(layer_loop: str, backend: str, pipe: int, remat: str) -> str:
    """`auto` -> unroll on CPU without a pipeline or recomputation (small models, where the
    loop's slicing and stacking cost a tenth of a step), scan elsewhere: one compiled body however
    deep the model, a pipeline stage's layers inside its schedule's loop as the planner counts
    them, and `model.remat`'s memory saved (unrolled, XLA:CPU keeps every layer's recomputed
    activations alive at once: 2.7 GB of temp under each policy at the side-by-side shape,
    against 0.6-1.1 GB scanned)."""
    if layer_loop != "auto":
        return layer_loop
    return "unroll" if backend == "cpu" and pipe == 1 and remat == "none" else "scan"


def with_layer_loop(config: Config, backend: str) -> Config:
    """The config (its mesh resolved) with `model.layer_loop` resolved."""
    model = config.model
    loop = resolve_layer_loop(model.layer_loop, backend, config.mesh.pipe, model.remat)
    return dataclasses.replace(config, model=dataclasses.replace(model, layer_loop=loop))


def resolve_model(model: ModelConfig, backend: str) -> ModelConfig:
    """The model section with each `*_impl` resolved to the implementation that will run."""
    fits = cudnn_attention_fits(model)
    moe_impl = resolve_impl(model.moe.matmul_impl, "moe.matmul_impl", backend)
    return dataclasses.replace(
        model,
        moe=dataclasses.replace(model.moe, matmul_impl=moe_impl),
        **{key: resolve_impl(getattr(model, key), key, backend, fits) for key in IMPL_KEYS},
    )


def mesh_device_count(mesh: MeshConfig, unknown: int = 1) -> int:
    """The devices a mesh config asks for; an axis of -1 counts as `unknown`."""
    return math.prod(unknown if size == -1 else size for size in mesh.axis_sizes().values())


def fixed_mesh_device_count(mesh: MeshConfig) -> int | None:
    """The devices a mesh config asks for; None when an axis is -1 (the devices decide it)."""
    if -1 in mesh.axis_sizes().values():
        return None
    return mesh_device_count(mesh)


def resolve_mesh_shape(mesh: MeshConfig, device_count: int) -> dict[str, int]:
    """Mesh axis sizes with -1 filled in; ConfigError if they cannot cover device_count exactly."""
    sizes = mesh.axis_sizes()
    if list(sizes.values()).count(-1) > 1:
        raise ConfigError("only one mesh axis may be -1 (the rest of the devices)")
    known = 1
    for size in sizes.values():
        if size != -1:
            known *= size
    shape_text = " x ".join(f"{axis} {size}" for axis, size in sizes.items())
    if -1 in sizes.values():
        if device_count % known:
            raise ConfigError(
                f"mesh ({shape_text}) cannot fill {device_count} devices: "
                f"{device_count} is not divisible by {known}"
            )
        sizes = {
            axis: device_count // known if size == -1 else size for axis, size in sizes.items()
        }
    elif known != device_count:
        raise ConfigError(
            f"mesh ({shape_text}) has {known} devices but {device_count} are available; "
            "make mesh.data x mesh.fsdp x mesh.expert x mesh.pipe x mesh.tensor equal the "
            "device count or set one axis to -1"
        )
    return sizes


def check_device_count(config: Config, device_count: int) -> Config:
    """The config with -1 mesh axes resolved for device_count; ConfigError if it does not fit."""
    sizes = resolve_mesh_shape(config.mesh, device_count)
    resolved = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, **sizes))
    check_divisible_by_mesh(resolved, sizes)
    return resolved


def utc_stamp(now: datetime | None = None) -> str:
    """A UTC timestamp for names that must sort by time: 20261130-174252."""
    return (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")


def default_run_dir(name: str, now: datetime | None = None) -> Path:
    """runs/<name>-<UTC timestamp>: where a run goes when run.dir is not set."""
    return RUNS_FOLDER / f"{name}-{utc_stamp(now)}"


def resolve_run_dir(config: Config, now: datetime | None = None) -> Config:
    """The config with run.dir chosen (kept when set)."""
    if config.run.dir:
        return config
    path = default_run_dir(config.run.name, now)
    return dataclasses.replace(config, run=dataclasses.replace(config.run, dir=str(path)))


def resolve_for_devices(config: Config, device_count: int, backend: str) -> Config:
    """What resolution needs the devices for: kernels chosen, the mesh filled in and checked, the
    layer loop chosen for it."""
    config = dataclasses.replace(config, model=resolve_model(config.model, backend))
    return with_layer_loop(check_device_count(config, device_count), backend)


def resolve(config: Config, device_count: int, backend: str) -> Config:
    """The run's resolved config: mesh filled in and checked, kernels chosen, run.dir set."""
    config = model_from_init(config)  # model.init_from: filled from, or checked against, it
    return resolve_run_dir(resolve_for_devices(config, device_count, backend))
