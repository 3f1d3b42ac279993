"""Ahead-of-time compilation of the train step for one mesh, and what XLA says about it.

A mesh of k devices is built on the first k local devices, so a smaller mesh (1,1,1 among eight)
runs beside the full ones. Compiles are cached per (config, mesh): the sweep, the plan's XLA check
and their tests compile each pair once per process.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from msjax.config import Config
from msjax.errors import MsjaxError
from msjax.observe.collectives import CollectiveStats, count_collectives
from msjax.observe.memory import CompiledMemory, compiled_memory
from msjax.parallel.candidates import MeshShape, config_for_mesh
from msjax.parallel.mesh import build_mesh
from msjax.step import TrainProgram, build_program

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids")


@dataclass(frozen=True)
class CompiledStep:
    """The train step of one config on one mesh, compiled, with XLA's accounts of it."""

    config: Config  # with the mesh filled in
    mesh: MeshShape
    program: TrainProgram
    compiled: Any  # jax.stages.Compiled: (state, batch) -> (state, metrics)
    compile_s: float
    memory: CompiledMemory | None
    collectives: dict[str, CollectiveStats]

    @property
    def collective_executions(self) -> int:
        return sum(stats.executions for stats in self.collectives.values())

    @property
    def collective_bytes(self) -> int:
        return sum(stats.result_bytes for stats in self.collectives.values())


def abstract_batch(program: TrainProgram) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and shardings of one global batch: [global_batch, seq_len] int32 arrays."""
    config = program.config
    shape = (config.train.global_batch, config.data.seq_len)
    return {
        key: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=program.batch_sharding)
        for key in BATCH_KEYS
    }


@functools.lru_cache(maxsize=32)
def compile_step(config: Config, mesh: MeshShape) -> CompiledStep:
    """Compile `config`'s train step on the first `mesh.devices` local devices."""
    available = jax.device_count()
    if mesh.devices > available:
        raise MsjaxError(
            f"mesh {mesh} (data,fsdp,tensor) needs {mesh.devices} devices; {available} are here"
        )
    config = config_for_mesh(config, mesh)
    device_mesh = build_mesh(config.mesh, jax.devices()[: mesh.devices])
    started = time.perf_counter()
    program = build_program(config, device_mesh)
    lowered = program.train_step.lower(program.abstract_state(), abstract_batch(program))
    compiled = lowered.compile()
    compile_s = time.perf_counter() - started
    return CompiledStep(
        config=config,
        mesh=mesh,
        program=program,
        compiled=compiled,
        compile_s=compile_s,
        memory=compiled_memory(compiled),
        collectives=count_collectives(compiled.as_text()),
    )
