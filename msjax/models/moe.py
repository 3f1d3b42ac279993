"""Mixture of experts: the router, the MoE MLP (dropless grouped matmuls, or capped by a
capacity factor) and its dense reference.

Parameters carry logical axis names (`expert`, `embed`, `expert_mlp`, `mlp`); where experts live
on a mesh is decided outside. The block returns its statistics (auxiliary losses, tokens per
expert, dropped share) beside its output; the caller adds the losses to the training loss.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from msjax import ops
from msjax.config import ModelConfig
from msjax.models.params import param
from msjax.moe_config import MoeConfig
from msjax.parallel.context import compute_weight, constrain

EXPERT_IN = ("expert", "embed", "expert_mlp")  # each expert's gate and up weights
EXPERT_OUT = ("expert", "expert_mlp", "embed")  # each expert's down weights


class Routing(NamedTuple):
    """What the router decided for tokens [tokens, embed], and its losses."""

    weights: jax.Array  # [tokens, k] float32: each chosen expert's share of the token's output
    experts: jax.Array  # [tokens, k] int32: the chosen experts, best first
    load_balance_loss: jax.Array  # scalar: num_experts * sum_e f_e * P_e (1 when balanced)
    z_loss: jax.Array  # scalar: mean over tokens of logsumexp(logits)^2
    tokens_per_expert: jax.Array  # [experts] float32: routed token choices per expert


class MoeStats(NamedTuple):
    """One MoE layer's statistics (stacked over layers by the layer scan)."""

    load_balance_loss: jax.Array  # scalar
    z_loss: jax.Array  # scalar
    tokens_per_expert: jax.Array  # [experts], before capacity drops
    dropped_share: jax.Array  # scalar: the share of token choices past an expert's capacity


def route(logits: jax.Array, k: int, normalize: bool, bias: jax.Array | None = None) -> Routing:
    """Softmax over expert logits [tokens, experts], top-k, optionally renormalised.

    bias [experts] (auxiliary-loss-free balancing, DeepSeek-V3 §2.1.2) shifts the scores only for
    the choice of experts; the weights stay the softmax's. The load-balancing loss is Switch's
    num_experts * sum_e f_e * P_e with f_e the share of the k * tokens choices that went to e
    and P_e the mean router probability of e.
    """
    tokens, num_experts = logits.shape
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)  # [tokens, experts]
    scores = probs if bias is None else probs + jax.lax.stop_gradient(bias)
    _, experts = jax.lax.top_k(scores, k)  # [tokens, k]
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    chosen = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32)  # [tokens, k, experts]
    tokens_per_expert = jnp.sum(chosen, axis=(0, 1))
    choice_share = tokens_per_expert / (tokens * k)  # f_e
    load_balance = num_experts * jnp.sum(choice_share * jnp.mean(probs, axis=0))
    z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return Routing(weights, experts.astype(jnp.int32), load_balance, z_loss, tokens_per_expert)


def expert_capacity(capacity_factor: float, tokens: int, k: int, num_experts: int) -> int | None:
    """Token choices one expert takes at most: ceil(factor * tokens * k / experts); None: all."""
    if capacity_factor <= 0:
        return None
    return math.ceil(capacity_factor * tokens * k / num_experts)


def kept_choices(experts: jax.Array, num_experts: int, capacity: int | None) -> jax.Array:
    """[tokens, k] bool: the choices within their expert's capacity, earlier tokens first."""
    if capacity is None:
        return jnp.ones(experts.shape, bool)
    flat = experts.reshape(-1)  # [tokens * k], in token order
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num_experts)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(flat.size) - starts[flat[order]]  # place within its expert's queue
    rank = jnp.zeros_like(flat).at[order].set(rank_sorted)
    return (rank < capacity).reshape(experts.shape)


class Router(nnx.Module):
    """Expert logits from the residual stream; an optional per-expert balancing bias."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        experts = config.moe.num_experts
        init = nnx.initializers.normal(config.init_std)
        self.weight = param(rngs, init, (config.embed_dim, experts), ("embed", None))
        if config.moe.bias_balancing:
            # state, not trained: its gradient is zero (stop_gradient in `route`); the step moves
            # it from the load it sees (balance_routing_bias)
            self.bias = param(rngs, nnx.initializers.zeros, (experts,), (None,))
        self.moe = config.moe

    def __call__(self, tokens: jax.Array) -> Routing:
        """tokens [tokens, embed] -> their routing (computed in float32)."""
        weight = compute_weight(self.weight[...], ("embed", None), jnp.float32)
        logits = tokens.astype(jnp.float32) @ weight  # [tokens, experts]
        bias = self.bias[...] if self.moe.bias_balancing else None
        return route(logits, self.moe.experts_per_token, self.moe.normalize_top_k, bias)


def _swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, spec: str) -> jax.Array:
    """down(silu(x gate) * x up) for einsum specs "in,hidden->out" given as `spec` parts."""
    into, out = spec.split("|")
    hidden = jax.nn.silu(jnp.einsum(into, x, gate)) * jnp.einsum(into, x, up)
    return jnp.einsum(out, hidden, down)


class MoeMLP(nnx.Module):
    """Routed SwiGLU experts run as grouped matmuls, plus shared experts every token runs."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        moe: MoeConfig = config.moe
        embed, experts = config.embed_dim, moe.num_experts
        hidden = moe.expert_mlp_dim or config.mlp_dim
        init = nnx.initializers.normal(config.init_std)
        out_init = nnx.initializers.normal(config.init_std / (2 * config.num_layers) ** 0.5)
        self.router = Router(config, rngs)
        self.gate = param(rngs, init, (experts, embed, hidden), EXPERT_IN)
        self.up = param(rngs, init, (experts, embed, hidden), EXPERT_IN)
        self.down = param(rngs, out_init, (experts, hidden, embed), EXPERT_OUT)
        if moe.shared_experts:  # as one SwiGLU as wide as all shared experts together
            shared = moe.shared_experts * hidden
            self.shared_gate = param(rngs, init, (embed, shared), ("embed", "mlp"))
            self.shared_up = param(rngs, init, (embed, shared), ("embed", "mlp"))
            self.shared_down = param(rngs, out_init, (shared, embed), ("mlp", "embed"))
        self.moe = moe

    def _expert_weights(self, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        gate = compute_weight(self.gate[...], EXPERT_IN, dtype)
        up = compute_weight(self.up[...], EXPERT_IN, dtype)
        return gate, up, compute_weight(self.down[...], EXPERT_OUT, dtype)

    def _shared(self, tokens: jax.Array) -> jax.Array:
        if not self.moe.shared_experts:
            return jnp.zeros_like(tokens)
        dtype = tokens.dtype
        gate = compute_weight(self.shared_gate[...], ("embed", "mlp"), dtype)
        up = compute_weight(self.shared_up[...], ("embed", "mlp"), dtype)
        down = compute_weight(self.shared_down[...], ("mlp", "embed"), dtype)
        return _swiglu(tokens, gate, up, down, "te,em->tm|tm,me->te")

    def _capacity(self, tokens: int) -> int | None:
        moe = self.moe
        return expert_capacity(moe.capacity_factor, tokens, moe.experts_per_token, moe.num_experts)

    def _routing(self, tokens: jax.Array) -> tuple[Routing, jax.Array]:
        """The routing of tokens [tokens, embed] and which choices fit the capacity [tokens, k]."""
        routing = self.router(tokens)
        capacity = self._capacity(tokens.shape[0])
        return routing, kept_choices(routing.experts, self.moe.num_experts, capacity)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoeStats]:
        """x [batch, seq, embed] -> (the experts' output, this layer's statistics)."""
        x = constrain(x, ("batch", "seq", "act_embed"))
        tokens = x.reshape(-1, x.shape[-1])  # [tokens, embed]
        routing, kept = self._routing(tokens)
        dropped_as = jnp.where(kept, routing.experts, self.moe.num_experts)  # [tokens, k]
        weights = (routing.weights * kept).astype(x.dtype)
        gate, up, down = self._expert_weights(x.dtype)
        choices_shape = (*x.shape[:-1], self.moe.experts_per_token)  # [batch, seq, k]
        combined = ops.routed_experts(
            x,
            dropped_as.reshape(choices_shape),
            weights.reshape(choices_shape),
            gate,
            up,
            down,
            impl=self.moe.matmul_impl,
            capacity=self._capacity(tokens.shape[0]),
        ).reshape(tokens.shape)
        combined = combined + self._shared(tokens)
        return combined.reshape(x.shape), _stats(routing, kept)

    def dense_reference(self, x: jax.Array) -> tuple[jax.Array, MoeStats]:
        """The same function with every expert run on every token and masked by the routing
        (E times the work: for tests)."""
        tokens = x.reshape(-1, x.shape[-1])
        routing, kept = self._routing(tokens)
        gate, up, down = self._expert_weights(x.dtype)
        every = _swiglu(tokens, gate, up, down, "td,edh->eth|eth,ehd->etd")  # [experts, tokens, d]
        chosen = jax.nn.one_hot(routing.experts, self.moe.num_experts, dtype=x.dtype)
        share = jnp.einsum("tke,tk->te", chosen, (routing.weights * kept).astype(x.dtype))
        combined = jnp.einsum("te,etd->td", share, every) + self._shared(tokens)
        return combined.reshape(x.shape), _stats(routing, kept)


def _stats(routing: Routing, kept: jax.Array) -> MoeStats:
    dropped = 1.0 - jnp.mean(kept.astype(jnp.float32))
    return MoeStats(routing.load_balance_loss, routing.z_loss, routing.tokens_per_expert, dropped)


def balanced_bias(bias: jax.Array, tokens_per_expert: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's bias update: each expert's bias moves by `rate` up when it got fewer tokens
    than the mean, down when more (bias, tokens_per_expert: [..., experts])."""
    mean = jnp.mean(tokens_per_expert, axis=-1, keepdims=True)
    return bias + rate * jnp.sign(mean - tokens_per_expert)


def moe_aux_loss(stats: MoeStats, moe: MoeConfig) -> jax.Array:
    """The weighted auxiliary losses added to the training loss, each averaged over layers."""
    return moe.load_balance_loss_weight * jnp.mean(
        stats.load_balance_loss
    ) + moe.router_z_loss_weight * jnp.mean(stats.z_loss)


def moe_metrics(stats: MoeStats) -> dict[str, jax.Array]:
    """A step's MoE metrics from its statistics stacked over layers: the auxiliary losses (mean
    over layers), the dropped share, and the load: tokens per expert summed over layers, and the
    most loaded expert's count over the mean (max) and its mean over layers (mean)."""
    load = stats.tokens_per_expert  # [layers, experts]
    imbalance = jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
    return {
        "moe_load_balance_loss": jnp.mean(stats.load_balance_loss),
        "moe_router_z_loss": jnp.mean(stats.z_loss),
        "moe_dropped_share": jnp.mean(stats.dropped_share),
        "moe_tokens_per_expert": jnp.sum(load, axis=0),
        "moe_max_load_imbalance": jnp.max(imbalance),
        "moe_mean_load_imbalance": jnp.mean(imbalance),
    }


def balance_routing_bias(params: dict, stats: MoeStats, moe: MoeConfig) -> dict:
    """params (a pure dict of a Transformer's) with every MoE layer's routing bias moved by
    `balanced_bias` from the step's load; params itself without bias balancing."""
    if not moe.bias_balancing:
        return params
    layers = params["moe_layers"]
    router = layers["mlp"]["router"]
    bias = balanced_bias(router["bias"], stats.tokens_per_expert, moe.bias_update_rate)
    mlp = {**layers["mlp"], "router": {**router, "bias": bias}}
    return {**params, "moe_layers": {**layers, "mlp": mlp}}


def stats_share(stats: MoeStats, share: jax.Array) -> MoeStats:
    """A microbatch's statistics to sum over microbatches: the scalars weighted by its `share`
    of the batch's tokens, the token counts as they are."""
    scaled = (stats.load_balance_loss, stats.z_loss, stats.dropped_share)
    loss, z_loss, dropped = (value * share for value in scaled)
    return MoeStats(loss, z_loss, stats.tokens_per_expert, dropped)


def zero_stats(config: ModelConfig) -> MoeStats:
    """Zeros shaped as the MoE layers' statistics stacked over them."""
    layers = config.num_layers - config.moe.first_dense_layers
    scalars = jnp.zeros((layers,), jnp.float32)
    load = jnp.zeros((layers, config.moe.num_experts), jnp.float32)
    return MoeStats(scalars, scalars, load, scalars)


def zero_objective(config: ModelConfig) -> tuple[jax.Array, tuple[jax.Array, MoeStats]]:
    """Zeros shaped as a step's (objective, (loss, statistics)): where microbatches sum from."""
    zero = jnp.zeros((), jnp.float32)
    return zero, (zero, zero_stats(config))
