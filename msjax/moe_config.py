"""The mixture-of-experts settings of the model (`model.moe`) and their checks.

num_experts=0 (the default) is the dense model; everything else here is read only when it is
positive. The MoE layers themselves are in msjax.models.moe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from msjax.errors import ConfigError


@dataclass(frozen=True)
class MoeConfig:
    """Mixture of experts: a router picks experts_per_token of num_experts SwiGLU experts."""

    num_experts: int = 0  # routed experts per MoE layer; 0: a dense model (no MoE layer at all)
    experts_per_token: int = 2  # top-k: the routed experts each token runs; in [1, num_experts]
    shared_experts: int = 0  # experts every token runs besides its routed ones (DeepSeekMoE)
    # the first this many layers keep the dense MLP, the rest are MoE layers (DeepSeek-V3's
    # first_k_dense_replace); in [0, model.num_layers)
    first_dense_layers: int = 0
    expert_mlp_dim: int | None = None  # each expert's SwiGLU hidden width; null: model.mlp_dim
    normalize_top_k: bool = True  # divide a token's top-k router weights by their sum
    # Switch/GShard load-balancing loss num_experts * sum_e f_e * P_e, averaged over the MoE
    # layers, added to the training loss with this weight; >= 0
    load_balance_loss_weight: float = 0.01
    # ST-MoE router z-loss mean(logsumexp(logits)^2), averaged over the MoE layers, added to the
    # training loss with this weight; >= 0
    router_z_loss_weight: float = 0.001
    # DeepSeek-V3 auxiliary-loss-free balancing: a per-expert bias, added to the router scores
    # for the choice of experts only (never to their weights), moved after every step by
    # bias_update_rate toward the experts that got fewer tokens than the mean
    bias_balancing: bool = False
    bias_update_rate: float = 0.001  # the bias's step per update (bias_balancing); >= 0
    # 0: dropless (every routed token runs its experts); > 0: an expert takes at most
    # ceil(capacity_factor * tokens * experts_per_token / num_experts) of the tokens one layer
    # runs at once (the step's batch, or a microbatch); past that a token's choice of the expert
    # is dropped (the token keeps its residual, its other experts and the shared ones)
    capacity_factor: float = 0.0
    # the experts' grouped matmul: xla (jax.lax.ragged_dot, the reference; on CPU it runs every
    # expert on every routed row), blocks (plain JAX: rows padded per expert to blocks of 32, each
    # block times its expert's weights: the routed work alone, everywhere) or pallas (a Pallas
    # kernel, interpreted off GPU: slow, for tests); auto: blocks on CPU, xla elsewhere
    matmul_impl: Literal["auto", "xla", "blocks", "pallas"] = "auto"

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def layer_stacks(self, num_layers: int) -> list[tuple[str, int, bool]]:
        """(the Transformer's attribute, layer count, MoE) of each stack of `num_layers` layers,
        in layer order: one dense stack, or the first dense layers (if any) and then the MoE
        layers."""
        if not self.enabled:
            return [("layers", num_layers, False)]
        dense = self.first_dense_layers
        moe_stack = [("moe_layers", num_layers - dense, True)]
        return [("dense_layers", dense, False), *moe_stack] if dense else moe_stack


def check_moe(moe: MoeConfig, num_layers: int) -> None:
    """Raise a one-line ConfigError naming a bad `model.moe` key and what it accepts."""
    if moe.num_experts < 0:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} must be >= 0 (0: dense)")
    for name in ("load_balance_loss_weight", "router_z_loss_weight", "bias_update_rate"):
        value = getattr(moe, name)
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"model.moe.{name}={value} must be a finite number >= 0")
    if not (math.isfinite(moe.capacity_factor) and moe.capacity_factor >= 0):
        raise ConfigError(
            f"model.moe.capacity_factor={moe.capacity_factor} must be >= 0 (0: dropless)"
        )
    if moe.shared_experts < 0:
        raise ConfigError(f"model.moe.shared_experts={moe.shared_experts} must be >= 0")
    if moe.expert_mlp_dim is not None and moe.expert_mlp_dim <= 0:
        raise ConfigError(
            f"model.moe.expert_mlp_dim={moe.expert_mlp_dim} must be positive (or null)"
        )
    if not moe.enabled:
        return
    if not 1 <= moe.experts_per_token <= moe.num_experts:
        raise ConfigError(
            f"model.moe.experts_per_token={moe.experts_per_token} must be in [1, "
            f"model.moe.num_experts={moe.num_experts}]"
        )
    if not 0 <= moe.first_dense_layers < num_layers:
        raise ConfigError(
            f"model.moe.first_dense_layers={moe.first_dense_layers} must be in [0, "
            f"model.num_layers={num_layers}) so that one MoE layer is left"
        )
