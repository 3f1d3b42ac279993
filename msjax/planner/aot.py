"""Ahead-of-time compilation of the train step for one mesh, and what XLA says about it; lowering
for an abstract mesh of any size, which needs no devices.

A mesh of k devices is built on the first k local devices, so a smaller mesh (1,1,1 among eight)
runs beside the full ones. The config is resolved for this host's backend, and compiles are cached
per resolved (config, mesh): the sweep, the plan's XLA check and their tests compile each pair once
per process. On CPU a bfloat16 step's collectives are counted as a GPU would send them; the dot
FLOPs are read from the optimised program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import AbstractMesh, AxisType

from msjax.config import Config
from msjax.errors import MsjaxError
from msjax.observe.collectives import (
    CollectiveStats,
    bytes_sent_by_axes,
    collective_ops,
    count_collectives,
)
from msjax.observe.compiled_flops import CompiledFlops, compiled_flops
from msjax.observe.memory import CompiledMemory, compiled_memory
from msjax.parallel.mesh import MESH_AXES, build_mesh
from msjax.parallel.pipeline import PipelineLayout
from msjax.planner.candidates import PLANNED_BACKEND, MeshShape, config_for_mesh
from msjax.step import TrainProgram, build_program

# On CPU the collectives are read from the partitioned program once XLA has hoisted
# loop-invariant work out of loops and counted their trips (this pass), and before it fuses each
# gradient all-reduce with the slice a device keeps of it (a GPU makes the pair a reduce-scatter);
# collectives XLA's CPU backend widened from bfloat16 count at their narrow width
# (msjax.observe.hlo_dataflow). What is counted is then what a GPU would send.
CPU_COUNTED_AFTER_PASS = "while-loop-trip-count-annotator"
LOWERING_PLATFORMS = {"gpu": "cuda", "tpu": "tpu", "cpu": "cpu"}  # backend -> JAX's platform name


@dataclass(frozen=True)
class CompiledStep:
    """The train step of one config on one mesh, compiled, with XLA's accounts of it."""

    config: Config  # with the mesh filled in and the kernels resolved
    mesh: MeshShape
    program: TrainProgram
    compiled: Any  # jax.stages.Compiled: (state, batch) -> (state, metrics)
    compile_s: float
    memory: CompiledMemory | None
    collectives: dict[str, CollectiveStats]
    sent_by_axes: dict[str, float]  # ring bytes one device sends per step, by the axes crossed
    sent_by_axes_in_loops: dict[str, float]  # of those, what collectives inside loops send
    flops: CompiledFlops  # dot and convolution FLOPs one device runs per step

    @property
    def collective_executions(self) -> int:
        return sum(stats.executions for stats in self.collectives.values())

    @property
    def collective_bytes(self) -> int:
        return sum(stats.result_bytes for stats in self.collectives.values())


def compile_step(config: Config, mesh: MeshShape) -> CompiledStep:
    """Compile `config`'s train step on the first `mesh.devices` local devices (an `auto` layer
    loop scanned: planned_loop)."""
    available = jax.device_count()
    if mesh.devices > available:
        raise MsjaxError(
            f"mesh {mesh} (data,fsdp,tensor) needs {mesh.devices} devices; {available} are here"
        )
    return _compile_resolved(
        config_for_mesh(planned_loop(config), mesh, jax.default_backend()), mesh
    )


def planned_loop(config: Config) -> Config:
    """The config with an `auto` layer loop as the planner counts it: scanned, as it runs on a
    GPU (unrolled on CPU, XLA's buffers, gathers and recomputation differ by 10-20% from what the
    planner's models count; a config that names its loop compiles that one)."""
    if config.model.layer_loop != "auto":
        return config
    return dataclasses.replace(config, model=dataclasses.replace(config.model, layer_loop="scan"))


@functools.lru_cache(maxsize=32)
def _compile_resolved(config: Config, mesh: MeshShape) -> CompiledStep:
    """The compile behind compile_step, cached on the config as resolved for this host."""
    device_mesh = build_mesh(config.mesh, jax.devices()[: mesh.devices])
    on_cpu = jax.default_backend() == "cpu"
    started = time.perf_counter()
    program = build_program(config, device_mesh)
    lowered = program.train_step.lower(program.abstract_state(), program.abstract_batch())
    with tempfile.TemporaryDirectory(prefix="msjax-hlo-") as dump, _no_persistent_cache(on_cpu):
        dumped = {"xla_dump_to": dump, "xla_dump_hlo_pass_re": CPU_COUNTED_AFTER_PASS}
        compiled = lowered.compile(dumped if on_cpu else None)
        program_text = _program_as_counted(Path(dump)) if on_cpu else compiled.as_text()
    mesh_shape = tuple(mesh.sizes()[axis] for axis in MESH_AXES)
    ops = collective_ops(program_text, _branch_shares(config))
    compile_s = time.perf_counter() - started
    return CompiledStep(
        config=config,
        mesh=mesh,
        program=program,
        compiled=compiled,
        compile_s=compile_s,
        memory=compiled_memory(compiled),
        collectives=count_collectives(ops),
        sent_by_axes=bytes_sent_by_axes(ops, MESH_AXES, mesh_shape),
        sent_by_axes_in_loops=bytes_sent_by_axes(ops, MESH_AXES, mesh_shape, True),
        # the optimised program, as it runs; a loop that branches per device counts each branch
        # as often as the schedule runs it
        flops=compiled_flops(compiled.as_text(), _branch_shares(config)),
    )


@contextlib.contextmanager
def _no_persistent_cache(needed: bool) -> Iterator[None]:
    """Compile for real while XLA dumps the program: JAX's persistent compilation cache keys
    leave the dump options out, so a hit (JAX_COMPILATION_CACHE_DIR set, an earlier plan of
    the same step) would load the program and dump nothing."""
    if not needed or not jax.config.jax_enable_compilation_cache:
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # it remembers whether it is in use
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def _branch_shares(config: Config) -> tuple[float, ...] | None:
    """How often each branch of the pipeline's per-device switch runs (None: no such switch)."""
    if config.mesh.pipe == 1:
        return None
    return PipelineLayout.of(config).table.branch_shares()


def _program_as_counted(dump: Path) -> str:
    """The partitioned train step as XLA dumped it just after CPU_COUNTED_AFTER_PASS."""
    found = sorted(dump.glob(f"*jit_train_step*after_{CPU_COUNTED_AFTER_PASS}.*.txt"))
    if len(found) != 1:
        raise RuntimeError(
            f"expected one HLO dump after {CPU_COUNTED_AFTER_PASS} in {dump}: {found}"
        )
    return found[0].read_text()


@dataclass(frozen=True)
class LoweredStep:
    """The train step of one config lowered for an abstract mesh, and its state's shard sizes."""

    config: Config  # with the mesh filled in and the kernels resolved
    mesh: MeshShape
    platform: str  # what it was lowered for: `cuda`, `tpu` or `cpu`
    lower_s: float
    state_bytes_per_device: int  # parameters and optimizer state, from JAX's shardings


def lower_on_abstract_mesh(
    config: Config, mesh: MeshShape, backend: str = PLANNED_BACKEND
) -> LoweredStep:
    """Trace and lower the step for `mesh` with no devices: the program and its shardings hold.

    JAX lowers for an `AbstractMesh` when given a platform; compiling needs real devices (a
    device assignment), so XLA's memory analysis is out of reach. Raises if the step does not
    trace or its shardings do not fit the mesh.
    """
    config = config_for_mesh(config, mesh, backend)
    if config.model.attention_impl == "cudnn" and jax.default_backend() != "gpu":
        # JAX's cuDNN attention looks for the library while tracing, which a host without a GPU
        # lacks; the state and its shardings, what this lowering checks, do not depend on it
        model = dataclasses.replace(config.model, attention_impl="xla")
        config = dataclasses.replace(config, model=model)
    platform = LOWERING_PLATFORMS[backend]
    sizes = tuple(mesh.sizes()[axis] for axis in MESH_AXES)
    abstract = AbstractMesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(sizes))
    started = time.perf_counter()
    program = build_program(config, abstract)  # type: ignore[arg-type]
    state = program.abstract_state()
    program.train_step.trace(state, program.abstract_batch()).lower(lowering_platforms=(platform,))
    state_bytes = sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(state)
    )
    return LoweredStep(config, mesh, platform, time.perf_counter() - started, state_bytes)
