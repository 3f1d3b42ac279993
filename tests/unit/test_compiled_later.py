"""The periodic checks' programs compile on threads of their own, beside the loop's steps, not
before the first one: a (re)start's first step does not wait for XLA to compile what runs every
hundred steps."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from msjax.config import MeshConfig
from msjax.parallel.mesh import build_mesh
from msjax.resilience.compiled_later import CompiledLater
from msjax.resilience.compute_checks import ComputeCheck
from msjax.resilience.replica_guard import ReplicaFingerprints

LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # a program lowered for XLA


@pytest.fixture
def lowered_on_threads():
    """The names of the threads that lowered a program while the test ran."""
    names: list[str] = []

    def listen(event: str, duration_s: float, **kwargs) -> None:
        if event == LOWERED:
            names.append(threading.current_thread().name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield names
    jax.monitoring.unregister_event_duration_listener(listen)


def data_mesh():
    return build_mesh(MeshConfig(data=2, fsdp=2, tensor=1), jax.devices()[:4])


def test_the_compute_check_compiles_on_a_thread_of_its_own(lowered_on_threads):
    caller = threading.current_thread().name
    check = ComputeCheck(data_mesh())
    assert check.failing_ranks() == ()  # every device gets the known answer right
    assert lowered_on_threads and caller not in lowered_on_threads
    assert set(lowered_on_threads) == {"msjax-compile-compute-check"}


def test_replica_fingerprints_compile_on_a_thread_of_their_own(lowered_on_threads):
    mesh = data_mesh()
    sharding = NamedSharding(mesh, PartitionSpec(("fsdp",)))
    state = {"w": jax.device_put(np.arange(8, dtype=np.float32), sharding)}
    fingerprints = ReplicaFingerprints(mesh, {"w": sharding})
    fingerprints.compile(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
    table = fingerprints.table(state)
    assert table.shape == (*mesh.devices.shape, 1)
    # replicas over data hold the same block: their fingerprints agree; fsdp blocks differ
    assert (table[0] == table[1]).all() and (table[:, 0] != table[:, 1]).any()
    assert set(lowered_on_threads) == {"msjax-compile-replica-fingerprints"}


def test_a_failed_compile_is_raised_where_the_program_is_used():
    def fails() -> None:
        raise ValueError("no such program")

    later = CompiledLater(fails, "broken")
    with pytest.raises(ValueError, match="no such program"):
        later.get()
