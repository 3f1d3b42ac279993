"""The experts' grouped matmul: `jax.lax.ragged_dot` (xla, the reference) or the Pallas kernel,
and the routed experts of a mixture of experts run with it on each device's own tokens.

Each device sorts its own tokens by expert and runs every expert's weights (whole on every
device; experts split over a mesh axis come with expert parallelism) on them: no token leaves
its device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from msjax.ops.dispatch import resolved_impl
from msjax.ops.sharding import per_shard
from msjax.parallel.context import interpret_kernels
from pallas_kernels import grouped_matmul as kernels


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: str = "xla"
) -> jax.Array:
    """x [rows, k] in groups of group_sizes [experts], w [experts, k, n] -> [rows, n]."""
    if resolved_impl(impl, "moe.matmul_impl") == "xla":
        return kernels.reference(x, w, group_sizes)
    return kernels.grouped_matmul(x, w, group_sizes, interpret=interpret_kernels())


TOKENS = ("batch", "seq", "act_embed")  # [batch, seq, embed]
CHOICES = ("batch", "seq", None)  # [batch, seq, k]
EXPERT_WEIGHT = (None, None, None)  # [experts, in, out], whole on every device


def routed_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    impl: str = "xla",
) -> jax.Array:
    """sum_k weights[..., k] * SwiGLU_{experts[..., k]}(x), per device over its tokens.

    x [batch, seq, embed]; experts [batch, seq, k] int32, num_experts for a dropped choice (it
    contributes nothing); weights [batch, seq, k] in x's dtype; gate, up [experts, embed,
    hidden]; down [experts, hidden, embed].
    """

    def local(x, experts, weights, gate, up, down):
        num_experts, k, embed = gate.shape[0], experts.shape[-1], x.shape[-1]
        tokens = x.reshape(-1, embed)  # [tokens, embed]
        # dropped choices sort past every group: the grouped matmul gives their rows zeros
        choices = experts.reshape(-1)  # [tokens * k]
        order = jnp.argsort(choices, stable=True)
        group_sizes = jnp.bincount(choices, length=num_experts + 1)[:num_experts]
        grouped = tokens[order // k]  # [tokens * k, embed], grouped by expert
        hidden = jax.nn.silu(grouped_matmul(grouped, gate, group_sizes, impl=impl))
        hidden = hidden * grouped_matmul(grouped, up, group_sizes, impl=impl)
        out = grouped_matmul(hidden, down, group_sizes, impl=impl)
        out = jnp.zeros_like(out).at[order].set(out).reshape(-1, k, embed)  # token order
        combined = jnp.einsum("tke,tk->te", out, weights.reshape(-1, k))
        return combined.reshape(x.shape)

    in_axes = (TOKENS, CHOICES, CHOICES, EXPERT_WEIGHT, EXPERT_WEIGHT, EXPERT_WEIGHT)
    return per_shard(local, in_axes, TOKENS)(x, experts, weights, gate, up, down)
