"""The in-training known-answer check: every device multiplies the same small integer matrices
through msjax's own matmul path and counts the entries that differ from the answer computed on
the host; one all-gather gives every process the same count per device. It sees wrong compute
that replica fingerprints cannot (a matmul before the gradients' all-reduce: every replica then
holds the same wrong update)."""

from __future__ import annotations

from typing import Any

import numpy as np

from msjax.resilience.compiled_later import CompiledLater

SIZE = 64  # [SIZE, SIZE] @ [SIZE, SIZE]: a few microseconds on any device
SEED = 20240  # the same matrices in every process
# entries in [-4, 4]: every product and partial sum is a small integer, exact in float32 (and
# TF32) whatever the order of summation, so a sound device matches the answer bitwise
LIMIT = 4


def known_matrices() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 left [SIZE, SIZE], right [SIZE, SIZE] and their product, computed in int64."""
    rng = np.random.default_rng(SEED)
    left = rng.integers(-LIMIT, LIMIT + 1, (SIZE, SIZE))
    right = rng.integers(-LIMIT, LIMIT + 1, (SIZE, SIZE))
    return left.astype(np.float32), right.astype(np.float32), (left @ right).astype(np.float32)


class ComputeCheck:
    """One jitted program over the mesh: each device's matmul of the known matrices, compared
    there with the host's answer; the gathered table of wrong entries per device is the same
    in every process, so every process finds the same ranks bad."""

    def __init__(self, mesh: Any):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        from msjax.ops.matmul import einsum
        from msjax.parallel.mesh import MESH_AXES

        self.mesh = mesh
        everywhere = NamedSharding(mesh, PartitionSpec())
        self._inputs = [jax.device_put(matrix, everywhere) for matrix in known_matrices()]

        def local(left: Any, right: Any, answer: Any) -> Any:
            product = einsum("ik,kj->ij", left, right)  # [SIZE, SIZE]
            wrong = jax.numpy.sum(product != answer, dtype=jax.numpy.int32)
            return jax.lax.all_gather(wrong[None], MESH_AXES)  # [devices, 1], mesh order

        replicated = (PartitionSpec(),) * 3
        program = jax.shard_map(
            local, mesh=mesh, in_specs=replicated, out_specs=PartitionSpec(), check_vma=False
        )

        def compile() -> Any:
            # full float32 matmuls (no TF32 or bfloat16 passes): the answer is exact
            with jax.default_matmul_precision("highest"):
                return jax.jit(program).lower(*self._inputs).compile()

        # the steps go on meanwhile: a (re)start's first step does not wait for it
        self._compiled = CompiledLater(compile, "compute-check")

    def wrong_entries(self) -> np.ndarray:
        """int [data, fsdp, pipe, tensor]: each device's entries that differ from the answer."""
        gathered = self._compiled.get()(*self._inputs)
        local = np.asarray(gathered.addressable_shards[0].data)  # [devices, 1]
        return local.reshape(self.mesh.devices.shape)

    def failing_ranks(self) -> tuple[int, ...]:
        """The processes holding a device that got the known answer wrong (sorted)."""
        wrong = self.wrong_entries()
        places = zip(*np.nonzero(wrong), strict=True)
        return tuple(sorted({int(self.mesh.devices[place].process_index) for place in places}))
