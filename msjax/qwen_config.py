"""The model section as a Hugging Face Qwen3 or Qwen3-MoE `config.json` and back: the keys that
differ from a Llama's (per-head query/key norm, which layers are mixtures, the router's options),
and what cannot cross.

No arrays: msjax.llama_config reads a Qwen3 config.json (its `qwen3_fields`); the export
(msjax.hf) writes `qwen3_config` or `qwen3_moe_config` over a Llama config.json.
"""

from __future__ import annotations

from typing import Any

from msjax.config import ModelConfig

QWEN3_TYPES = ("qwen3", "qwen3_moe")


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
