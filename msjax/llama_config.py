"""The model section as a Hugging Face Llama `config.json` and back, and what cannot cross.

Plain data, no arrays: `msjax.resolve` fills or checks `model` against the directory named by
`model.init_from`, and the export writes the same mapping the other way.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from msjax.config import Config, ModelConfig
from msjax.config_checks import validate
from msjax.errors import ConfigError

HF_PREFIX = "hf:"
CONFIG_FILE = "config.json"


def unsupported_by_llama(model: ModelConfig) -> str | None:
    """Why transformers' LlamaForCausalLM cannot run this model, or None if it can."""
    if model.parallel_block:
        return "model.parallel_block=true (a parallel attention + MLP block) has no Llama form"
    if model.attention_window is not None:
        return (
            f"model.attention_window={model.attention_window} (sliding-window attention) has "
            "no Llama form; Llama attends to every earlier token"
        )
    return None


def llama_config(
    model: ModelConfig, eos_id: int | None, max_positions: int, dtype: str
) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM with the model's shapes (transformers 4.x and 5.x keys)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.embed_dim,
        "intermediate_size": model.mlp_dim,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": model.tied_embeddings,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def hf_directory(init_from: str) -> Path:
    """The directory of `hf:PATH`; ConfigError if it holds no config.json."""
    path = Path(init_from.removeprefix(HF_PREFIX)).expanduser()
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(
            f"model.init_from={init_from}: no {CONFIG_FILE} in {path}; give a local Hugging Face "
            "Llama directory"
        )
    return path


def model_fields_from_llama(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig keys from a config.json; ConfigError naming what msjax cannot represent."""
    model_type = hf.get("model_type")
    if model_type != "llama":
        raise ConfigError(f"{where}: model_type={model_type!r} is not accepted; only llama")
    refusals = {
        "hidden_act": ("silu", hf.get("hidden_act", "silu")),
        "attention_bias": (False, bool(hf.get("attention_bias", False))),
        "mlp_bias": (False, bool(hf.get("mlp_bias", False))),
    }
    for key, (accepted, value) in refusals.items():
        if value != accepted:
            raise ConfigError(f"{where}: {key}={value} is not accepted; msjax needs {accepted}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(
            f"{where}: rope_type={rope_type!r} is not accepted; msjax has plain RoPE (default)"
        )
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    heads = hf["num_attention_heads"]
    fields = {
        "vocab_size": hf["vocab_size"],
        "num_layers": hf["num_hidden_layers"],
        "embed_dim": hf["hidden_size"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "mlp_dim": hf["intermediate_size"],
        "rope_theta": float(theta),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tied_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "parallel_block": False,
        "attention_window": None,
    }
    return fields


def read_llama_config(directory: Path) -> dict[str, Any]:
    """The config.json of a Hugging Face directory."""
    return json.loads((directory / CONFIG_FILE).read_text())


def model_from_init(config: Config) -> Config:
    """The config with `model` filled from (from_hf) or checked against model.init_from."""
    model = config.model
    if model.init_from is None:
        return config
    directory = hf_directory(model.init_from)
    where = f"model.init_from={model.init_from}"
    try:
        fields = model_fields_from_llama(read_llama_config(directory), where)
    except KeyError as missing:
        raise ConfigError(f"{where}: {CONFIG_FILE} has no {missing} (a Llama config has)") from None
    except ValueError:
        raise ConfigError(f"{where}: {CONFIG_FILE} is not valid JSON") from None
    if model.from_hf:
        filled = dataclasses.replace(config, model=dataclasses.replace(model, **fields))
        validate(filled)  # the checks the loaded config passed, now on the filled model
        return filled
    mismatched = []
    for key, value in fields.items():
        ours = model.resolved_head_dim if key == "head_dim" else getattr(model, key)
        if ours != value:
            mismatched.append(f"model.{key}={ours} but {CONFIG_FILE} has {value}")
    if mismatched:
        raise ConfigError(
            f"{where} does not match the model section: {'; '.join(mismatched)} "
            "(set model.from_hf=true to take them from it)"
        )
    return config
