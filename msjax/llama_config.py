"""The model section as a Hugging Face Llama `config.json` (or Mixtral's, for a mixture of
experts, or Qwen3's and Qwen3-MoE's; what Qwen3 exports is in msjax.qwen_config) and back, its
fields read and type-checked, what cannot cross, and which weight files such a directory names
(plain file names inside it, nothing else).

No arrays: `msjax.resolve` fills or checks `model` against the directory named by
`model.init_from` (and opens its weight files' headers), and the export writes the other way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from msjax.config import Config, ModelConfig
from msjax.config_checks import validate
from msjax.errors import ConfigError
from msjax.qwen_config import QWEN3_TYPES

HF_PREFIX = "hf:"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# keys a config.json may fill (from_hf) that only shape training, not the model it describes
TRAINING_ONLY = ("model.moe.load_balance_loss_weight",)

CONFIG_FILE = "config.json"


def integer_field(hf: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    """A positive integer field of config.json (a float, a bool or a string is refused)."""
    value = hf.get(key)
    if value is None:
        if default is None:
            raise ConfigError(
                f"{where}: {CONFIG_FILE} has no {key} (a {hf.get('model_type')} config has)"
            )
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{where}: {CONFIG_FILE} has {key}={json.dumps(value)}; it must be a positive integer"
        )
    return value


def boolean_field(hf: dict[str, Any], key: str, where: str, default: bool) -> bool:
    """A true/false field of config.json (the string "false" is not false, nor true)."""
    value = default if hf.get(key) is None else hf[key]
    if not isinstance(value, bool):
        raise ConfigError(
            f"{where}: {CONFIG_FILE} has {key}={json.dumps(value)}; it must be true or false"
        )
    return value


def number_field(hf: dict[str, Any], key: str, where: str, default: float) -> float:
    """A finite positive number field of config.json."""
    value = default if hf.get(key) is None else hf[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(
            f"{where}: {CONFIG_FILE} has {key}={json.dumps(value)}; it must be a finite "
            "positive number"
        )
    return float(value)


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


def unsupported_by_llama(model: ModelConfig) -> str | None:
    """Why transformers' LlamaForCausalLM cannot run this model, or None if it can."""
    if model.moe.enabled:
        return (
            f"model.moe.num_experts={model.moe.num_experts} (a mixture of experts) has no "
            "LlamaForCausalLM form"
        )
    if model.parallel_block:
        return "model.parallel_block=true (a parallel attention + MLP block) has no Llama form"
    if model.attention_window is not None:
        return (
            f"model.attention_window={model.attention_window} (sliding-window attention) has "
            "no Llama form; Llama attends to every earlier token"
        )
    return None


def unsupported_by_mixtral(model: ModelConfig) -> str | None:
    """Why transformers' MixtralForCausalLM cannot run this mixture of experts, or None if it can.

    Mixtral routes every layer's tokens with a bias-free softmax router to the top-k of its
    experts and renormalises their weights; it runs every choice (dropless), so a capacity
    factor, a training-time budget, is not part of the exported model.
    """
    moe = model.moe
    if model.parallel_block:
        return "model.parallel_block=true (a parallel attention + MLP block) has no Mixtral form"
    if moe.shared_experts:
        return (
            f"model.moe.shared_experts={moe.shared_experts} has no Mixtral form; Mixtral runs "
            "only routed experts"
        )
    if moe.first_dense_layers:
        return (
            f"model.moe.first_dense_layers={moe.first_dense_layers} has no Mixtral form; every "
            "Mixtral layer is a mixture of experts"
        )
    if moe.bias_balancing:
        return (
            "model.moe.bias_balancing=true has no Mixtral form; its routing bias changes which "
            "experts a token gets, and Mixtral's router has no bias"
        )
    if not moe.normalize_top_k:
        return (
            "model.moe.normalize_top_k=false has no Mixtral form; Mixtral divides the top-k "
            "router weights by their sum"
        )
    return None


def mixtral_config(
    model: ModelConfig, eos_id: int | None, max_positions: int, dtype: str
) -> dict[str, Any]:
    """config.json of a MixtralForCausalLM with the model's shapes (transformers 4.x and 5.x)."""
    llama = llama_config(model, eos_id, max_positions, dtype)
    for key in ("mlp_bias", "attention_bias"):
        del llama[key]
    return {
        **llama,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": model.moe.expert_mlp_dim or model.mlp_dim,
        "num_local_experts": model.moe.num_experts,
        "num_experts_per_tok": model.moe.experts_per_token,
        "sliding_window": model.attention_window,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    }


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
            "Llama, Mixtral, Qwen3 or Qwen3-MoE directory"
        )
    return path


def _mixtral_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The mixture-of-experts and attention keys of a Mixtral config.json (every layer MoE, no
    shared experts, bias-free router, top-k weights renormalised as Mixtral does)."""
    experts = integer_field(hf, "num_local_experts", where)
    top_k = integer_field(hf, "num_experts_per_tok", where)
    if top_k > experts:
        raise ConfigError(
            f"{where}: {CONFIG_FILE} has num_experts_per_tok={top_k} > num_local_experts={experts}"
        )
    jitter = hf.get("router_jitter_noise") or 0
    if jitter != 0:
        raise ConfigError(
            f"{where}: router_jitter_noise={json.dumps(jitter)} is not accepted; msjax's router "
            "has no jitter (0)"
        )
    moe = {
        "num_experts": experts,
        "experts_per_token": top_k,
        "expert_mlp_dim": integer_field(hf, "intermediate_size", where),
        "shared_experts": 0,
        "first_dense_layers": 0,
        "normalize_top_k": True,
    }
    # the same window: a query at i sees keys i - sliding_window < j <= i
    window = (
        None if hf.get("sliding_window") is None else integer_field(hf, "sliding_window", where)
    )
    return {"moe": moe, "attention_window": window}


def model_fields_from_llama(hf: Any, where: str) -> dict[str, Any]:
    """ModelConfig keys from a Llama, Mixtral, Qwen3 or Qwen3-MoE config.json, each type-checked
    (`moe` a dict of model.moe keys); ConfigError naming what msjax cannot represent or what is
    not valid."""
    if not isinstance(hf, dict):
        raise ConfigError(f"{where}: {CONFIG_FILE} is not a JSON object")
    model_type = hf.get("model_type")
    if model_type not in ("llama", "mixtral", *QWEN3_TYPES):
        raise ConfigError(
            f"{where}: model_type={model_type!r} is not accepted; only llama, mixtral, qwen3 or "
            "qwen3_moe"
        )
    if model_type == "mixtral":
        mixtral = {**_mixtral_fields(hf, where), "qk_norm": False}
    elif model_type in QWEN3_TYPES:
        mixtral = qwen3_fields(hf, where)
    else:
        mixtral = {"moe": {"num_experts": 0}, "attention_window": None, "qk_norm": False}
    hidden_act = hf.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"{where}: hidden_act={hidden_act!r} is not accepted; msjax needs silu")
    for key in ("attention_bias", "mlp_bias"):  # Mixtral's config has neither
        if boolean_field(hf, key, where, default=False):
            raise ConfigError(f"{where}: {key}=true is not accepted; msjax needs false")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: {CONFIG_FILE}'s rope parameters are not a JSON object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(
            f"{where}: rope_type={rope_type!r} is not accepted; msjax has plain RoPE (default)"
        )
    theta_from = hf if hf.get("rope_theta") is not None else rope  # transformers 4.x, else 5.x
    theta = number_field(theta_from, "rope_theta", where, default=10000.0)
    embed = integer_field(hf, "hidden_size", where)
    heads = integer_field(hf, "num_attention_heads", where)
    if hf.get("head_dim") is None and embed < heads:
        raise ConfigError(
            f"{where}: {CONFIG_FILE} has hidden_size={embed} < num_attention_heads={heads} and "
            "no head_dim; each head needs at least one dimension"
        )
    return {
        "vocab_size": integer_field(hf, "vocab_size", where),
        "num_layers": integer_field(hf, "num_hidden_layers", where),
        "embed_dim": embed,
        "num_heads": heads,
        "num_kv_heads": integer_field(hf, "num_key_value_heads", where, default=heads),
        "head_dim": integer_field(hf, "head_dim", where, default=embed // heads),
        # Mixtral's: each expert's; Qwen3-MoE's: the dense layers' (moe_intermediate_size the
        # experts')
        "mlp_dim": integer_field(hf, "intermediate_size", where),
        "rope_theta": theta,
        "norm_eps": number_field(hf, "rms_norm_eps", where, default=1e-6),
        "tied_embeddings": boolean_field(hf, "tie_word_embeddings", where, default=False),
        "parallel_block": False,
        **mixtral,
    }


def read_llama_config(directory: Path) -> dict[str, Any]:
    """The config.json of a Hugging Face directory."""
    return json.loads((directory / CONFIG_FILE).read_text())


def weight_file_names(directory: Path) -> list[str]:
    """The safetensors files holding the weights: model.safetensors, or every file the index's
    weight_map names. MsjaxError unless each is a plain file name (no separator, no `..`, not
    absolute) of a regular file in the directory: an index never reaches outside it."""
    index = directory / INDEX_FILE
    if not index.exists():
        if not (directory / SINGLE_FILE).exists():
            raise ConfigError(f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        _check_regular_file(directory, SINGLE_FILE, f"{directory}:")
        return [SINGLE_FILE]
    _check_regular_file(directory, INDEX_FILE, f"{directory}:")
    try:
        weight_map = json.loads(index.read_bytes()).get("weight_map")
    except (ValueError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{index} is not a JSON object with a weight_map of tensor: file name")
    for name in weight_map.values():
        plain = isinstance(name, str) and name not in ("", ".", "..")
        if not plain or "/" in name or "\\" in name or "\0" in name:
            raise ConfigError(
                f"{index}: weight_map names {json.dumps(name)}; each entry must be a plain file "
                f"name inside {directory} (no separators, no '..', not absolute)"
            )
    names = sorted(set(weight_map.values()))
    for name in names:
        _check_regular_file(directory, name, f"{index}: weight_map names")
    return names


def _check_regular_file(directory: Path, name: str, context: str) -> None:
    """MsjaxError unless directory/name is a regular file (a link to one counts: the Hugging Face
    hub's snapshots link to their blobs); a FIFO or a device would block or never end."""
    path = directory / name
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(f"{context} {name}, which is not in {directory}") from None
    except OSError as error:
        raise ConfigError(f"{context} {name}, which cannot be read: {error.strerror}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{context} {path}, which is not a regular file; give a weight file")


def open_weight_files(directory: Path) -> dict[str, Any]:
    """file name -> a safetensors handle (header read, no tensor data) for each weight file;
    MsjaxError naming the file that safetensors cannot read."""
    from safetensors import SafetensorError, safe_open

    handles = {}
    for name in weight_file_names(directory):
        try:
            handles[name] = safe_open(str(directory / name), framework="np")
        except (SafetensorError, OSError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ConfigError(
                f"{directory / name} is not a readable safetensors file: {reason}"
            ) from None
    return handles


def model_from_init(config: Config) -> Config:
    """The config with `model` filled from (from_hf) or checked against model.init_from."""
    model = config.model
    if model.init_from is None:
        return config
    directory = hf_directory(model.init_from)
    where = f"model.init_from={model.init_from}"
    try:
        hf = read_llama_config(directory)
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: {CONFIG_FILE} is not UTF-8") from None
    except ValueError:
        raise ConfigError(f"{where}: {CONFIG_FILE} is not valid JSON") from None
    fields = model_fields_from_llama(hf, where)
    open_weight_files(directory)  # before any run dir: a bad weight file is refused here
    moe_fields = fields.pop("moe")
    if model.from_hf:
        moe = dataclasses.replace(model.moe, **moe_fields)
        filled = dataclasses.replace(config, model=dataclasses.replace(model, moe=moe, **fields))
        validate(filled)  # the checks the loaded config passed, now on the filled model
        return filled
    mismatched = []
    ours_and_theirs = [
        *((f"model.{key}", getattr(model, key), value) for key, value in fields.items()),
        *((f"model.moe.{key}", getattr(model.moe, key), v) for key, v in moe_fields.items()),
    ]
    for key, ours, value in ours_and_theirs:
        if key == "model.head_dim":
            ours = model.resolved_head_dim
        if key == "model.moe.expert_mlp_dim":
            ours = model.moe.expert_mlp_dim or model.mlp_dim
        if key in TRAINING_ONLY:  # filled with from_hf, never a mismatch
            continue
        if ours != value:
            mismatched.append(f"{key}={ours} but {CONFIG_FILE} has {value}")
    if mismatched:
        raise ConfigError(
            f"{where} does not match the model section: {'; '.join(mismatched)} "
            "(set model.from_hf=true to take them from it)"
        )
    return config
