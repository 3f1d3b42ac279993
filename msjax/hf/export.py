"""A run's checkpoint written as a Hugging Face Llama directory (Mixtral for a mixture of
experts; Qwen3 or Qwen3-MoE for a model with model.qk_norm) that transformers loads.

Only the parameters are read (onto one device, whatever mesh saved them); everything that can
refuse is checked before OUT_DIR is written, and OUT_DIR appears whole or not at all.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError

from msjax.checkpoint.hf_weights import MAX_SHARD_BYTES, hf_tensors, write_safetensors
from msjax.checkpoint.run_params import checkpoint_source, load_run_params, saved_config
from msjax.config import Config, ModelConfig
from msjax.errors import MsjaxError
from msjax.llama_config import (
    CONFIG_FILE,
    llama_config,
    mixtral_config,
    unsupported_by_llama,
    unsupported_by_mixtral,
)
from msjax.qwen_config import qwen3_config, qwen3_moe_config, unsupported_by_qwen3


class ExportWriteFailed(Exception):
    """OUT_DIR could not be written (a full disk, an I/O error): an infrastructure fault, not a
    user mistake; the staging directory is removed, so no half-written export is left."""


def hf_form(model: ModelConfig) -> tuple[str, str | None, Any]:
    """(the transformers class, why it cannot run the model or None, its config.json maker):
    Qwen3 (Qwen3-MoE with experts) with model.qk_norm, else Llama (Mixtral with experts)."""
    if model.qk_norm:
        qwen = qwen3_moe_config if model.moe.enabled else qwen3_config
        form = "Qwen3MoeForCausalLM" if model.moe.enabled else "Qwen3ForCausalLM"

        def form_config(model: ModelConfig, *args: Any) -> dict[str, Any]:
            return qwen(llama_config(model, *args), model)

        return form, unsupported_by_qwen3(model), form_config
    if model.moe.enabled:
        return "MixtralForCausalLM", unsupported_by_mixtral(model), mixtral_config
    return "LlamaForCausalLM", unsupported_by_llama(model), llama_config


def tokenizer_files(config: Config) -> tuple[int | None, dict[str, bytes]]:
    """The end-of-text id and the tokenizer files to write beside the weights."""
    from msjax.data.tokenizer import HuggingFaceTokenizer, load_tokenizer

    spec = config.data.tokenizer
    tokenizer = load_tokenizer(spec)
    if spec == "byte":
        return tokenizer.eos_id, {}  # transformers has no byte tokenizer of this vocabulary
    content = Path(spec).expanduser().read_bytes()
    if isinstance(tokenizer, HuggingFaceTokenizer):
        settings = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": tokenizer.eos_token,
            "add_bos_token": False,
            "add_eos_token": False,
        }
        files = {"tokenizer.json": content}
    else:
        settings = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False}
        files = {"tokenizer.model": content}
    files["tokenizer_config.json"] = json.dumps(settings, indent=2).encode()
    return tokenizer.eos_id, files


def export_checkpoint(
    source: str, out_dir: Path, dtype: str = "float32", max_shard_bytes: int = MAX_SHARD_BYTES
) -> list[str]:
    """Write the checkpoint named by source into out_dir; the names of the files written."""
    import jax

    if out_dir.is_symlink():  # its target is never written, nor the link replaced
        raise MsjaxError(f"{out_dir} is a symbolic link; give a new or empty directory")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise MsjaxError(f"{out_dir} exists and is not empty; give a new or empty directory")
    for parent in out_dir.absolute().parents:
        if parent.exists() and not parent.is_dir():
            raise MsjaxError(f"{out_dir}: {parent} is a file, not a directory")
    checkpointer, step = checkpoint_source(source)
    config = saved_config(checkpointer, step)
    form, reason, form_config = hf_form(config.model)
    if reason is not None:
        raise MsjaxError(f"cannot export to a Hugging Face {form}: {reason}")
    eos_id, tokenizer_content = tokenizer_files(config)
    run_params = load_run_params(checkpointer, step, config)
    checkpointer.close()
    host_params = jax.device_get(run_params.params)
    if dtype == "bfloat16":
        import ml_dtypes

        host_params = jax.tree.map(lambda a: np.asarray(a).astype(ml_dtypes.bfloat16), host_params)

    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as error:
        raise ExportWriteFailed(f"cannot write beside {out_dir}: {error.strerror}") from None
    try:
        written = write_safetensors(hf_tensors(host_params, config.model), staging, max_shard_bytes)
        files = {
            CONFIG_FILE: form_config(config.model, eos_id, config.data.seq_len, dtype),
            "generation_config.json": {"eos_token_id": eos_id, "do_sample": False},
        }
        for name, content in files.items():
            (staging / name).write_text(json.dumps(content, indent=2) + "\n")
        for name, content in tokenizer_content.items():
            (staging / name).write_bytes(content)
        staging.chmod(0o755)  # mkdtemp makes it private; an export is meant to be shared
        for entry in staging.iterdir():
            entry.chmod(0o644)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        staging.rename(out_dir)
    except (OSError, SafetensorError) as error:  # a full disk, an I/O error: OUT_DIR not made
        shutil.rmtree(staging, ignore_errors=True)
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ExportWriteFailed(
            f"writing {out_dir} failed ({reason}); nothing was left there, free space and rerun"
        ) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [*sorted(files), *written, *sorted(tokenizer_content)]
