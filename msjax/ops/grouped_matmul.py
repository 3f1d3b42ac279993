"""The experts' grouped matmul: `jax.lax.ragged_dot` (xla, the reference), padded row blocks in
plain JAX (blocks, msjax.ops.grouped_matmul_blocks) or the Pallas kernel, and the routed experts
of a mixture of experts run with it, per device.

Without expert parallelism each device sorts its own tokens by expert and runs every expert's
weights (whole on every device) on them: no token leaves its device. With the experts split over
a mesh axis, each device sends its token choices to the devices holding their experts and gets
the outputs back (msjax.parallel.experts), running its own experts on what it receives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from msjax.ops.dispatch import resolved_impl
from msjax.ops.grouped_matmul_blocks import grouped_matmul_blocks
from msjax.ops.sharding import per_shard
from msjax.parallel.context import interpret_kernels, kernel_mesh
from msjax.parallel.experts import buffer_rows, return_outputs, send_to_experts
from pallas_kernels import grouped_matmul as kernels


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: str = "xla"
) -> jax.Array:
    """x [rows, k] in groups of group_sizes [experts], w [experts, k, n] -> [rows, n]."""
    chosen = resolved_impl(impl, "moe.matmul_impl")
    if chosen == "xla":
        return kernels.reference(x, w, group_sizes)
    if chosen == "blocks":
        return grouped_matmul_blocks(x, w, group_sizes)
    return kernels.grouped_matmul(x, w, group_sizes, interpret=interpret_kernels())


TOKENS = ("batch", "seq", "act_embed")  # [batch, seq, embed]
CHOICES = ("batch", "seq", None)  # [batch, seq, k]
EXPERT_WEIGHT = ("expert", None, None)  # [experts, in, out], split only over the expert axis


def _grouped_swiglu(
    grouped: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    group_sizes: jax.Array,
    impl: str,
) -> jax.Array:
    """Rows [rows, embed] grouped by expert (group_sizes [experts]; rows past them give zeros)
    through their expert's SwiGLU -> [rows, embed]."""
    hidden = jax.nn.silu(grouped_matmul(grouped, gate, group_sizes, impl=impl))
    hidden = hidden * grouped_matmul(grouped, up, group_sizes, impl=impl)
    return grouped_matmul(hidden, down, group_sizes, impl=impl)


def _expert_axis() -> str | None:
    """The mesh axis the experts are split over while tracing, or None (whole on every device)."""
    mesh = kernel_mesh()
    if mesh is None:
        return None
    axis = mesh.spec(("expert",))[0]
    return axis if isinstance(axis, str) and mesh.mesh.shape[axis] > 1 else None


def routed_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    impl: str = "xla",
    capacity: int | None = None,
) -> jax.Array:
    """sum_k weights[..., k] * SwiGLU_{experts[..., k]}(x), per device over its tokens.

    x [batch, seq, embed]; experts [batch, seq, k] int32, num_experts for a dropped choice (it
    contributes nothing); weights [batch, seq, k] in x's dtype; gate, up [experts, embed,
    hidden]; down [experts, hidden, embed]; capacity: the most choices one expert takes of the
    whole batch (None: dropless), which bounds the expert-parallel exchange's buffers.
    """
    axis = _expert_axis()
    if axis is not None:
        return _expert_parallel(x, experts, weights, (gate, up, down), axis, impl, capacity)

    def local(x, experts, weights, gate, up, down):
        num_experts, k, embed = gate.shape[0], experts.shape[-1], x.shape[-1]
        tokens = x.reshape(-1, embed)  # [tokens, embed]
        # dropped choices sort past every group: the grouped matmul gives their rows zeros
        choices = experts.reshape(-1)  # [tokens * k]
        order = jnp.argsort(choices, stable=True)
        group_sizes = jnp.bincount(choices, length=num_experts + 1)[:num_experts]
        grouped = tokens[order // k]  # [tokens * k, embed], grouped by expert
        out = _grouped_swiglu(grouped, gate, up, down, group_sizes, impl)
        out = jnp.zeros_like(out).at[order].set(out).reshape(-1, k, embed)  # token order
        combined = jnp.einsum("tke,tk->te", out, weights.reshape(-1, k))
        return combined.reshape(x.shape)

    in_axes = (TOKENS, CHOICES, CHOICES, EXPERT_WEIGHT, EXPERT_WEIGHT, EXPERT_WEIGHT)
    return per_shard(local, in_axes, TOKENS)(x, experts, weights, gate, up, down)


def _expert_parallel(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    expert_weights: tuple[jax.Array, jax.Array, jax.Array],
    axis: str,
    impl: str,
    capacity: int | None,
) -> jax.Array:
    """`routed_experts` with the experts split over mesh axis `axis`: each device routes its own
    tokens, sends each choice to its expert's device by all-to-all, runs its local experts on
    what it receives, and combines the outputs it gets back with the router weights."""
    num_experts = expert_weights[0].shape[0]

    def local(x, experts, weights, gate, up, down):
        k, embed = experts.shape[-1], x.shape[-1]
        tokens = x.reshape(-1, embed)  # [tokens, embed]
        experts_here = gate.shape[0]  # [experts_here, embed, hidden]: this device's experts
        rows_per_device = buffer_rows(tokens.shape[0] * k, experts_here, capacity)
        received, sent = send_to_experts(
            tokens, experts.reshape(-1, k), num_experts, axis, rows_per_device
        )
        # empty slots (expert experts_here) sort past every group: the matmul gives them zeros
        order = jnp.argsort(received.local_experts, stable=True)
        group_sizes = jnp.bincount(received.local_experts, length=experts_here + 1)[:experts_here]
        out = _grouped_swiglu(received.rows[order], gate, up, down, group_sizes, impl)
        out = jnp.zeros_like(out).at[order].set(out)  # [devices * rows_per_device, embed]
        per_choice = return_outputs(out, sent, axis, k)  # [tokens, k, embed]
        combined = jnp.einsum("tke,tk->te", per_choice, weights.reshape(-1, k))
        return combined.reshape(x.shape)

    in_axes = (TOKENS, CHOICES, CHOICES, EXPERT_WEIGHT, EXPERT_WEIGHT, EXPERT_WEIGHT)
    return per_shard(local, in_axes, TOKENS)(x, experts, weights, *expert_weights)
