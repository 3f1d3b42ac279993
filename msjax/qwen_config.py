"""The model section as a Hugging Face Qwen3 or Qwen3-MoE `config.json` and back: the keys that
differ from a Llama's (per-head query/key norm, which layers are mixtures, the router's options),
and what cannot cross.

No arrays: msjax.llama_config reads the keys Llama shares and calls `qwen3_fields` for the rest;
the export (msjax.hf) writes `qwen3_config` or `qwen3_moe_config` over a Llama config.json.
"""

from __future__ import annotations

import json
from typing import Any

from msjax.config import ModelConfig
from msjax.errors import ConfigError
from msjax.hf_config_values import CONFIG_FILE, boolean_field, integer_field

QWEN3_TYPES = ("qwen3", "qwen3_moe")


def _moe_layers(hf: dict[str, Any], where: str, num_layers: int) -> list[int]:
    """The layers transformers makes mixtures of experts (Qwen3MoeDecoderLayer's rule)."""
    step = integer_field(hf, "decoder_sparse_step", where, default=1)
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense
    ):
        raise ConfigError(
            f"{where}: {CONFIG_FILE} has mlp_only_layers={json.dumps(dense)}; it must be a list "
            f"of layer indices in [0, {num_layers})"
        )
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]


def _qwen3_moe_fields(hf: dict[str, Any], where: str, num_layers: int) -> dict[str, Any]:
    """model.moe keys of a Qwen3-MoE: routed experts only, bias-free softmax router, its top-k
    renormalised or not (norm_topk_prob), the first layers dense and the rest mixtures."""
    key = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
    experts = integer_field(hf, key, where)
    top_k = integer_field(hf, "num_experts_per_tok", where)
    if top_k > experts:
        raise ConfigError(
            f"{where}: {CONFIG_FILE} has num_experts_per_tok={top_k} > {key}={experts}"
        )
    moe_layers = _moe_layers(hf, where, num_layers)
    if not moe_layers:  # every layer dense: a Qwen3 in all but name
        return {"num_experts": 0}
    first_moe = moe_layers[0]
    if moe_layers != list(range(first_moe, num_layers)):
        raise ConfigError(
            f"{where}: decoder_sparse_step={hf.get('decoder_sparse_step', 1)} and "
            f"mlp_only_layers={json.dumps(hf.get('mlp_only_layers') or [])} make layers "
            f"{moe_layers} mixtures of experts; msjax accepts only dense layers first and every "
            "layer after them a mixture (model.moe.first_dense_layers)"
        )
    # transformers' load-balancing loss sums over the k choices, msjax's over their shares
    aux_weight = hf.get("router_aux_loss_coef") or 0.0
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "expert_mlp_dim": integer_field(hf, "moe_intermediate_size", where),
        "shared_experts": 0,
        "first_dense_layers": first_moe,
        "normalize_top_k": boolean_field(hf, "norm_topk_prob", where, default=False),
        "load_balance_loss_weight": float(aux_weight) * top_k if aux_weight else 0.0,
    }


def qwen3_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig keys of a Qwen3 or Qwen3-MoE config.json beyond the Llama ones (`moe` a dict
    of model.moe keys); ConfigError naming what msjax cannot represent."""
    if boolean_field(hf, "use_sliding_window", where, default=False):
        raise ConfigError(
            f"{where}: use_sliding_window=true is not accepted; msjax's Qwen3 attends to every "
            "earlier token in every layer (use_sliding_window=false)"
        )
    if hf.get("model_type") == "qwen3_moe":
        moe = _qwen3_moe_fields(hf, where, integer_field(hf, "num_hidden_layers", where))
    else:
        moe = {"num_experts": 0}
    return {"moe": moe, "attention_window": None, "qk_norm": True}


def unsupported_by_qwen3(model: ModelConfig) -> str | None:
    """Why transformers' Qwen3ForCausalLM (or with experts, Qwen3MoeForCausalLM) cannot run this
    model with model.qk_norm=true, or None if it can.

    Qwen3-MoE routes with a bias-free softmax router to the top-k of its routed experts
    (renormalised by norm_topk_prob) and runs every choice (dropless), so a capacity factor, a
    training-time budget, is not part of the exported model.
    """
    form = "Qwen3-MoE" if model.moe.enabled else "Qwen3"
    if model.parallel_block:
        return f"model.parallel_block=true (a parallel attention + MLP block) has no {form} form"
    if model.attention_window is not None:
        return (
            f"model.attention_window={model.attention_window} (sliding-window attention) has "
            f"no {form} form here; msjax exports every layer attending to every earlier token"
        )
    moe = model.moe
    if moe.shared_experts:
        return (
            f"model.moe.shared_experts={moe.shared_experts} has no Qwen3-MoE form; Qwen3-MoE "
            "runs only routed experts"
        )
    if moe.bias_balancing:
        return (
            "model.moe.bias_balancing=true has no Qwen3-MoE form; its routing bias changes which "
            "experts a token gets, and Qwen3-MoE's router has no bias"
        )
    return None


def qwen3_config(llama: dict[str, Any], model: ModelConfig) -> dict[str, Any]:
    """config.json of a Qwen3ForCausalLM, from the Llama one of the same model."""
    qwen = {key: value for key, value in llama.items() if key != "mlp_bias"}
    return {
        **qwen,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": model.num_layers,
    }


def qwen3_moe_config(llama: dict[str, Any], model: ModelConfig) -> dict[str, Any]:
    """config.json of a Qwen3MoeForCausalLM, from the Llama one of the same model."""
    moe = model.moe
    return {
        **qwen3_config(llama, model),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "intermediate_size": model.mlp_dim,  # the dense layers' MLP
        "moe_intermediate_size": moe.expert_mlp_dim or model.mlp_dim,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token,
        "norm_topk_prob": moe.normalize_top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(moe.first_dense_layers)),
        "router_aux_loss_coef": moe.load_balance_loss_weight / moe.experts_per_token,
        "output_router_logits": False,
    }
