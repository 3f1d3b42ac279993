"""One table from logical axis names to mesh axes, for parameters and activations alike, and the
placement that installs it in the context (msjax.parallel.context) while model code is traced.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from msjax.config import Config
from msjax.parallel.context import (
    KernelMesh,
    LogicalAxes,
    WeightGather,
    use_kernel_mesh,
    use_placement,
    use_weight_gather,
)

MeshAxes = str | tuple[str, ...] | None
Rules = dict[str, MeshAxes]
STORAGE_AXES = ("fsdp",)  # mesh axes that split a weight only while stored, never for compute


def logical_axis_rules(config: Config) -> Rules:
    """The mapping for this config; kv heads stay whole when `tensor` does not divide them.

    - ZeRO-3 (FSDP): parameters and optimizer state are sharded along `embed` over `fsdp`; XLA
      all-gathers a layer's weights before use and reduce-scatters its gradients.
    - Megatron tensor parallelism: `heads`, `kv_heads`, `mlp` and `vocab` split over `tensor`.
    - Data parallelism: `batch` is split over `data` and `fsdp` together (and `expert`).
    - Expert parallelism: the experts of MoE layers split over `expert` (tokens reach them by
      all-to-all, msjax.parallel.experts); the expert devices are data-parallel for the rest.
    - Sequence parallelism (a switch): the residual stream between blocks is split along the
      sequence over `tensor`, so norms and residual adds are not repeated on every tensor rank.
    - Pipeline parallelism: the stacked layers are split over `pipe` (each stage holds its own,
      msjax.parallel.pipeline), as are the pipeline's per-stage activation buffers (`stage`).
    """
    kv_heads_split = config.model.num_kv_heads % config.mesh.tensor == 0
    pipelined = config.mesh.pipe > 1
    expert_split = config.mesh.expert > 1
    return {
        # parameters
        "vocab": "tensor",
        "embed": "fsdp",
        "heads": "tensor",
        "kv_heads": "tensor" if kv_heads_split else None,
        "head_dim": None,
        "mlp": "tensor",
        "layers": "pipe" if pipelined else None,
        # mixture of experts: the experts split over the `expert` axis (whole on every device
        # without one), each split along embed over fsdp as every weight
        "expert": "expert" if expert_split else None,
        "expert_mlp": None,
        # activations
        "batch": ("data", "fsdp", "expert") if expert_split else ("data", "fsdp"),
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


def without_storage_axes(spec: PartitionSpec) -> PartitionSpec:
    """The spec a weight is computed with: its stored spec less the fsdp axis (gathered)."""

    def keep(entry: MeshAxes) -> MeshAxes:
        if entry is None or isinstance(entry, str):
            return None if entry in STORAGE_AXES else entry
        kept = tuple(axis for axis in entry if axis not in STORAGE_AXES)
        return kept[0] if len(kept) == 1 else (kept or None)

    return PartitionSpec(*(keep(entry) for entry in spec))


def placed_on(mesh: Mesh, spec: PartitionSpec) -> NamedSharding:
    """A NamedSharding on `mesh`; inside a shard_map that is manual over some axes (1F1B's loop
    over `pipe`), on the mesh in context, which marks those axes manual."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        return NamedSharding(context, spec)
    return NamedSharding(mesh, spec)


def weight_gather(mesh: Mesh, rules: Rules, grad_reduce_dtype: str = "float32") -> WeightGather:
    """Cast each weight on its shard, then gather it: the all-gather moves compute-dtype bytes.

    The backward pass turns the gathered weight's gradient into `grad_reduce_dtype` before it is
    reduced back to the shard (float32 by default, whatever the compute dtype), then into the
    parameter's own dtype. XLA may still move a narrower reduction past the widening cast (it does
    on CPU). A weight already in the compute dtype keeps XLA's placement.
    """
    reduce_dtype = jnp.dtype(grad_reduce_dtype)

    def gather(weight: jax.Array, axes: LogicalAxes, dtype: jnp.dtype) -> jax.Array:
        if weight.dtype == dtype:
            return weight
        stored = placed_on(mesh, logical_to_spec(axes, rules))
        computed = placed_on(mesh, without_storage_axes(stored.spec))
        param_dtype = weight.dtype

        @jax.custom_vjp
        def cast_then_gather(shard: jax.Array) -> jax.Array:
            narrow = jax.lax.with_sharding_constraint(shard.astype(dtype), stored)
            return jax.lax.with_sharding_constraint(narrow, computed)

        def forward(shard: jax.Array) -> tuple[jax.Array, None]:
            return cast_then_gather(shard), None

        def backward(_: None, grad: jax.Array) -> tuple[jax.Array]:
            wide = jax.lax.with_sharding_constraint(grad.astype(reduce_dtype), computed)
            reduced = jax.lax.with_sharding_constraint(wide, stored)
            return (reduced.astype(param_dtype),)

        cast_then_gather.defvjp(forward, backward)
        return cast_then_gather(weight)

    return gather


def gathered_stage_weights(
    layer_params: Any, mesh: Mesh, rules: Rules, grad_reduce_dtype: str = "float32"
) -> Any:
    """`pipeline.fsdp_gather=once`: the stacked layer parameters (an nnx.State, their logical
    axes in its metadata) gathered over fsdp before a pipeline loop, in their own dtype: each
    stage's layers whole on its devices, still split by pipe and tensor, so the loop gathers
    nothing. Their gradient comes summed over the replicas that used them (each fsdp rank its
    own rows) and is reduced onto the shards here, in `grad_reduce_dtype`, once per pass."""
    specs = nnx.get_partition_spec(layer_params)
    reduce_dtype = jnp.dtype(grad_reduce_dtype)

    def gather(weight: jax.Array, spec: PartitionSpec) -> jax.Array:
        stored = placed_on(mesh, logical_to_spec(tuple(spec), rules))
        whole = placed_on(mesh, without_storage_axes(stored.spec))

        @jax.custom_vjp
        def gathered(shard: jax.Array) -> jax.Array:
            return jax.lax.with_sharding_constraint(shard, whole)

        def forward(shard: jax.Array) -> tuple[jax.Array, None]:
            return gathered(shard), None

        def backward(_: None, grad: jax.Array) -> tuple[jax.Array]:
            reduced = jax.lax.with_sharding_constraint(grad.astype(reduce_dtype), stored)
            return (reduced.astype(weight.dtype),)

        gathered.defvjp(forward, backward)
        return gathered(weight)

    return jax.tree.map(gather, layer_params, specs)


def within_replica(rules: Rules, replica_axes: tuple[str, ...] = ("data",)) -> Rules:
    """The rules inside a computation vmapped over replicas with the replicas' axes as spmd
    axes (msjax.parallel.pipeline.Replicas): one replica's batch is split over the other batch
    axes only, and nothing else is split over the replicas' axes (under
    `pipeline.fsdp_gather=once` a replica's weights are whole over fsdp)."""

    def kept(entry: MeshAxes) -> MeshAxes:
        axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()))
        left = tuple(a for a in axes if a not in replica_axes)
        if isinstance(entry, str):
            return left[0] if left else None
        return left or None

    return {name: kept(entry) for name, entry in rules.items()}


def split_over_pipe(rules: Rules) -> Rules:
    """The rules for the tokens outside a pipeline's loop (embedding, loss head, loss): the
    batch split over `pipe` too, so every stage embeds and scores 1 / P of them."""
    batch = rules["batch"]
    return dict(rules, batch=("pipe", *((batch,) if isinstance(batch, str) else batch or ())))


@contextmanager
def placement_within_replica(
    mesh: Mesh, rules: Rules, replica_axes: tuple[str, ...] = ("data",)
) -> Iterator[None]:
    """While tracing code vmapped over replicas: activation hints and per-shard kernels follow
    `within_replica(rules, replica_axes)`; how weights are gathered stays as installed."""
    inner = within_replica(rules, replica_axes)

    def place(x: jax.Array, axes: LogicalAxes) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, placed_on(mesh, logical_to_spec(axes, inner)))

    kernels = KernelMesh(mesh, lambda axes: logical_to_spec(axes, inner))
    with use_placement(place), use_kernel_mesh(kernels):
        yield


@contextmanager
def activation_placement(
    mesh: Mesh, rules: Rules, weights: WeightGather | None = None
) -> Iterator[None]:
    """While tracing model code: turn logical activation hints into sharding constraints, give
    per-shard kernels (msjax.ops) the mesh and rules to build their shard_map from, and gather
    weights with `weights` (None: casts placed by XLA)."""

    def place(x: jax.Array, axes: LogicalAxes) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, placed_on(mesh, logical_to_spec(axes, rules)))

    kernels = KernelMesh(mesh, lambda axes: logical_to_spec(axes, rules))
    with use_placement(place), use_kernel_mesh(kernels), use_weight_gather(weights):
        yield


def _is_spec(leaf: Any) -> bool:
    return isinstance(leaf, PartitionSpec)
