"""One table from logical axis names to mesh axes, for parameters and activations alike, and the
placement that installs it in the context (msjax.parallel.context) while model code is traced.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from msjax.config import Config
from msjax.parallel.context import KernelMesh, LogicalAxes, use_kernel_mesh, use_placement

MeshAxes = str | tuple[str, ...] | None
Rules = dict[str, MeshAxes]


def logical_axis_rules(config: Config) -> Rules:
    """The mapping for this config; kv heads stay whole when `tensor` does not divide them.

    - ZeRO-3 (FSDP): parameters and optimizer state are sharded along `embed` over `fsdp`; XLA
      all-gathers a layer's weights before use and reduce-scatters its gradients.
    - Megatron tensor parallelism: `heads`, `kv_heads`, `mlp` and `vocab` split over `tensor`.
    - Data parallelism: `batch` is split over `data` and `fsdp` together.
    - Sequence parallelism (a switch): the residual stream between blocks is split along the
      sequence over `tensor`, so norms and residual adds are not repeated on every tensor rank.
    - Pipeline parallelism: the stacked layers are split over `pipe` (each stage holds its own,
      msjax.parallel.pipeline), as are the pipeline's per-stage activation buffers (`stage`).
    """
    kv_heads_split = config.model.num_kv_heads % config.mesh.tensor == 0
    pipelined = config.mesh.pipe > 1
    return {
        # parameters
        "vocab": "tensor",
        "embed": "fsdp",
        "heads": "tensor",
        "kv_heads": "tensor" if kv_heads_split else None,
        "head_dim": None,
        "mlp": "tensor",
        "layers": "pipe" if pipelined else None,
        # activations
        "batch": ("data", "fsdp"),
        "seq": None,
        "residual_seq": "tensor" if config.mesh.sequence_parallel else None,
        "act_embed": None,
        "stage": "pipe",
    }


def logical_to_spec(axes: LogicalAxes, rules: Rules) -> PartitionSpec:
    """PartitionSpec for a tuple of logical names; an unknown name is a programming error."""
    mesh_axes = []
    for name in axes:
        if name is None:
            mesh_axes.append(None)
        elif name in rules:
            mesh_axes.append(rules[name])
        else:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
    return PartitionSpec(*mesh_axes)


def logical_axes_of(abstract_state: nnx.State) -> dict[str, Any]:
    """Pure dict (like the parameters) of each parameter's logical axis names."""
    specs = nnx.get_partition_spec(abstract_state)
    return jax.tree.map(lambda spec: tuple(spec), nnx.to_pure_dict(specs), is_leaf=_is_spec)


def shardings_for(logical_axes: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for a pytree whose leaves are tuples of logical names."""
    return jax.tree.map(
        lambda axes: NamedSharding(mesh, logical_to_spec(axes, rules)),
        logical_axes,
        is_leaf=lambda leaf: isinstance(leaf, tuple),
    )


@contextmanager
def activation_placement(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """While tracing model code: turn logical activation hints into sharding constraints, and
    give per-shard kernels (msjax.ops) the mesh and rules to build their shard_map from."""

    def place(x: jax.Array, axes: LogicalAxes) -> jax.Array:
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, logical_to_spec(axes, rules))
        )

    kernels = KernelMesh(mesh, lambda axes: logical_to_spec(axes, rules))
    with use_placement(place), use_kernel_mesh(kernels):
        yield


def _is_spec(leaf: Any) -> bool:
    return isinstance(leaf, PartitionSpec)
