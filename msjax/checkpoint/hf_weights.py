"""msjax parameters as Hugging Face Llama, Mixtral, Qwen3 or Qwen3-MoE safetensors and back,
read shard by shard.

Linear weights are `[out, in]` there; the query, key and value heads are rows `head * head_dim
+ d`, the layout msjax's head axes flatten to; both rotate RoPE by halves, so nothing permutes.
A Mixtral file holds each expert's weights apart (`experts.{expert}.w1/w2/w3`, the names both
transformers 4.x and 5.x write; Qwen3-MoE's `mlp.experts.{expert}.gate_proj/up_proj/down_proj`),
where msjax stacks them along `expert`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from msjax.config import ModelConfig
from msjax.errors import MsjaxError
from msjax.llama_config import INDEX_FILE, SINGLE_FILE

MAX_SHARD_BYTES = 2 * 1024**3  # a file past this size is split, with an index naming each tensor


@dataclass(frozen=True)
class Mapping:
    """One msjax parameter and its Hugging Face tensor(s).

    layout: `same`, `transposed` (2-D `[in, out]` here), `heads_in` (`[embed, heads, dim]`
    here, `[heads * dim, embed]` there) or `heads_out` (`[heads, dim, embed]` here).
    """

    path: tuple[str, ...]  # keys in the params dict
    name: str  # the Hugging Face name; `{layer}` in per-layer ones, `{expert}` in per-expert ones
    layout: str
    per_layer: bool
    per_expert: bool = False  # [layers, experts, ...] here, one tensor per layer and expert there
    first_layer: int = 0  # the Hugging Face layer of the stack's first (dense layers come first)


def _stacks(model: ModelConfig) -> list[tuple[str, int, int, bool]]:
    """(params key, first layer, layer count, MoE) of each stack of layers, in layer order."""
    found, first = [], 0
    for name, count, moe in model.moe.layer_stacks(model.num_layers):
        found.append((name, first, count, moe))
        first += count
    return found


def _mlp_mappings(model: ModelConfig, stack: str, first: int, moe: bool) -> list[Mapping]:
    """A stack's MLP: Llama's (Qwen3's) dense SwiGLU, or Mixtral's (Qwen3-MoE's) router and
    experts."""
    layer = "model.layers.{layer}."
    if not moe:
        names = [(ours, layer + f"mlp.{ours}_proj.weight") for ours in ("gate", "up", "down")]
        return [
            Mapping((stack, "mlp", ours), name, "transposed", True, False, first)
            for ours, name in names
        ]
    if model.qk_norm:  # Qwen3-MoE
        router, experts = layer + "mlp.gate.weight", layer + "mlp.experts.{expert}."
        names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    else:  # Mixtral
        router = layer + "block_sparse_moe.gate.weight"
        experts = layer + "block_sparse_moe.experts.{expert}."
        names = {"gate": "w1", "up": "w3", "down": "w2"}
    found = [Mapping((stack, "mlp", "router", "weight"), router, "transposed", True, False, first)]
    for ours, theirs in names.items():
        name = experts + theirs + ".weight"
        found.append(Mapping((stack, "mlp", ours), name, "transposed", True, True, first))
    return found


def mappings(model: ModelConfig) -> list[Mapping]:
    """Every parameter of the model with its Hugging Face name and layout: a dense model as a
    Llama (a Qwen3 with model.qk_norm), a mixture of experts as a Mixtral (a Qwen3-MoE with
    model.qk_norm; msjax.llama_config and msjax.qwen_config say which can export)."""
    layer = "model.layers.{layer}."
    found = [
        Mapping(("embedding",), "model.embed_tokens.weight", "same", False),
        Mapping(("final_norm", "scale"), "model.norm.weight", "same", False),
    ]
    for stack, first, _, moe in _stacks(model):
        norms = [
            (("attention_norm", "scale"), "input_layernorm.weight"),
            (("mlp_norm", "scale"), "post_attention_layernorm.weight"),
        ]
        if model.qk_norm:  # Qwen3's per-head query and key norms
            norms.append((("attention", "query_norm", "scale"), "self_attn.q_norm.weight"))
            norms.append((("attention", "key_norm", "scale"), "self_attn.k_norm.weight"))
        for ours, theirs in norms:
            found.append(Mapping((stack, *ours), layer + theirs, "same", True, False, first))
        for ours, theirs in (("query", "q"), ("key", "k"), ("value", "v")):
            name = layer + f"self_attn.{theirs}_proj.weight"
            found.append(Mapping((stack, "attention", ours), name, "heads_in", True, False, first))
        name = layer + "self_attn.o_proj.weight"
        found.append(Mapping((stack, "attention", "out"), name, "heads_out", True, False, first))
        found += _mlp_mappings(model, stack, first, moe)
    if not model.tied_embeddings:
        found.append(Mapping(("unembedding",), "lm_head.weight", "transposed", False))
    return found


def _get(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _to_hf(value: np.ndarray, layout: str) -> np.ndarray:
    if layout == "same":
        return value
    if layout == "transposed":
        return value.T
    if layout == "heads_in":  # [embed, heads, dim] -> [heads * dim, embed]
        return value.reshape(value.shape[0], -1).T
    return value.reshape(-1, value.shape[-1]).T  # heads_out: [heads, dim, embed] -> [embed, h*d]


def hf_tensors(params: dict[str, Any], model: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) of every Hugging Face tensor, from host params (numpy) one at a time."""
    for mapping in mappings(model):
        value = np.asarray(_get(params, mapping.path))
        first = mapping.first_layer
        if mapping.per_expert:
            for index in range(value.shape[0]):
                for expert in range(model.moe.num_experts):
                    name = mapping.name.format(layer=first + index, expert=expert)
                    yield name, np.ascontiguousarray(_to_hf(value[index, expert], mapping.layout))
        elif mapping.per_layer:
            for index in range(value.shape[0]):
                name = mapping.name.format(layer=first + index)
                yield name, np.ascontiguousarray(_to_hf(value[index], mapping.layout))
        else:
            yield mapping.name, np.ascontiguousarray(_to_hf(value, mapping.layout))


def write_safetensors(
    tensors: Iterator[tuple[str, np.ndarray]],
    directory: Path,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[str]:
    """Write tensors as model.safetensors, or as numbered shards with an index past the limit."""
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    for name, array in tensors:
        if sizes[-1] and sizes[-1] + array.nbytes > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = array
        sizes[-1] += array.nbytes
    metadata = {"format": "pt"}  # transformers reads "pt" files with any framework
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE_FILE), metadata=metadata)
        return [SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file_name, shard in zip(names, shards, strict=True):
        save_file(shard, str(directory / file_name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file_name))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    return [*names, INDEX_FILE]


class SafetensorsReader:
    """Slices of the tensors of a Hugging Face directory, read without loading whole files, from
    the handles msjax.llama_config's `open_weight_files` gives (it opens only the weight files it
    accepts: plain names inside the directory)."""

    def __init__(self, directory: Path, files: dict[str, Any]):
        self._files = files
        self._file_of: dict[str, str] = {}
        for file_name, handle in self._files.items():
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                self._file_of[name] = file_name
        self.directory = directory

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._reading(name, lambda tensor: tensor.get_shape()))

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The slice as float32 (bfloat16 or float16 files too); MsjaxError if it holds a NaN or
        an infinity (a model that starts non-finite would only ever train to NaN)."""
        stored = np.asarray(self._reading(name, lambda tensor: tensor[index]))
        values = stored.astype(np.float32, copy=False)
        if not np.isfinite(values).all():
            where = self.directory / self._file_of[name]
            raise MsjaxError(
                f"{where}: tensor {name} holds non-finite values (NaN or infinity); "
                "give finite weights"
            )
        return values

    def _reading(self, name: str, read: Callable[[Any], Any]) -> Any:
        """read(the tensor's slice handle), with safetensors' errors naming the file."""
        from safetensors import SafetensorError

        if name not in self._file_of:
            raise MsjaxError(f"{self.directory} has no tensor {name} (the model needs it)")
        file_name = self._file_of[name]
        try:
            return read(self._files[file_name].get_slice(name))
        except (SafetensorError, OSError, ValueError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise MsjaxError(
                f"{self.directory / file_name}: tensor {name} cannot be read: {reason}"
            ) from None


def _bounds(index: slice, size: int) -> tuple[int, int]:
    start, stop, _ = index.indices(size)
    return start, stop


def _read_one(
    reader: SafetensorsReader, name: str, layout: str, index: tuple[slice, ...], shape: tuple
) -> np.ndarray:
    """The msjax-layout slice `index` of one Hugging Face tensor (one layer's)."""
    if layout == "same":
        return reader.read(name, index)
    if layout == "transposed":
        return reader.read(name, (index[1], index[0])).T
    if layout == "heads_in":  # ours [embed, heads, dim]; theirs [heads * dim, embed]
        (h0, h1), dim = _bounds(index[1], shape[1]), shape[2]
        rows = reader.read(name, (slice(h0 * dim, h1 * dim), index[0]))  # [h * dim, embed]
        return rows.T.reshape(-1, h1 - h0, dim)[:, :, index[2]]
    # heads_out: ours [heads, dim, embed]; theirs [embed, heads * dim]
    (h0, h1), dim = _bounds(index[0], shape[0]), shape[1]
    columns = reader.read(name, (index[2], slice(h0 * dim, h1 * dim)))  # [embed, h * dim]
    return columns.T.reshape(h1 - h0, dim, -1)[:, index[1], :]


def _expected_hf_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    if layout == "same":
        return shape
    if layout == "transposed":
        return shape[::-1]
    if layout == "heads_in":
        return (shape[1] * shape[2], shape[0])
    return (shape[2], shape[0] * shape[1])


def slice_reader(
    reader: SafetensorsReader, mapping: Mapping, shape: tuple[int, ...]
) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """index -> the float32 slice of the msjax parameter of `shape`, read from the files."""
    stacked = 2 if mapping.per_expert else int(mapping.per_layer)  # leading axes split apart
    one_shape = shape[stacked:]
    first = mapping.name.format(layer=mapping.first_layer, expert=0)
    expected = _expected_hf_shape(one_shape, mapping.layout)
    if reader.shape(first) != expected:
        raise MsjaxError(
            f"{reader.directory}: {first} has shape {list(reader.shape(first))}, the model "
            f"needs {list(expected)}"
        )

    def read(index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if not mapping.per_layer:
            return _read_one(reader, mapping.name, mapping.layout, index, shape)
        layers = []
        for layer in range(*_bounds(index[0], shape[0])):
            if not mapping.per_expert:
                name = mapping.name.format(layer=mapping.first_layer + layer)
                layers.append(_read_one(reader, name, mapping.layout, index[1:], one_shape))
                continue
            experts = [
                _read_one(
                    reader,
                    mapping.name.format(layer=mapping.first_layer + layer, expert=expert),
                    mapping.layout,
                    index[2:],
                    one_shape,
                )
                for expert in range(*_bounds(index[1], shape[1]))
            ]
            layers.append(np.stack(experts))
        return np.stack(layers)

    return read


def load_params(
    reader: SafetensorsReader, model: ModelConfig, shardings: dict[str, Any]
) -> dict[str, Any]:
    """The model's parameters from a Hugging Face directory's weight files (its reader), each
    device reading only its shard.

    shardings: a params-shaped dict of jax.sharding.Sharding; the arrays are float32.
    """
    import jax

    params: dict[str, Any] = {}
    for mapping in mappings(model):
        sharding = _get(shardings, mapping.path)
        shape = _param_shape(model, mapping.path)
        array = jax.make_array_from_callback(shape, sharding, slice_reader(reader, mapping, shape))
        _put(params, mapping.path, array)
    if model.moe.bias_balancing:  # no Mixtral holds one: it starts at zero, Mixtral's routing
        path = ("moe_layers", "mlp", "router", "bias")
        zeros = jax.numpy.zeros(_param_shape(model, path), jax.numpy.float32)
        _put(params, path, jax.device_put(zeros, _get(shardings, path)))
    return params


def _put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _param_shape(model: ModelConfig, path: tuple[str, ...]) -> tuple[int, ...]:
    """The shape of the parameter at `path` (a stack's: its layers first)."""
    embed, vocab, dim = model.embed_dim, model.vocab_size, model.resolved_head_dim
    heads, kv_heads = model.num_heads, model.num_kv_heads
    if path[0] not in ("layers", "dense_layers", "moe_layers"):
        return {
            ("embedding",): (vocab, embed),
            ("unembedding",): (embed, vocab),
            ("final_norm", "scale"): (embed,),
        }[path]
    layers, moe = next((count, moe) for key, _, count, moe in _stacks(model) if key == path[0])
    experts = model.moe.num_experts
    expert, hidden = (
        ((experts,), model.moe.expert_mlp_dim or model.mlp_dim) if moe else ((), model.mlp_dim)
    )
    shapes = {
        ("attention_norm", "scale"): (embed,),
        ("mlp_norm", "scale"): (embed,),
        ("attention", "query_norm", "scale"): (dim,),
        ("attention", "key_norm", "scale"): (dim,),
        ("attention", "query"): (embed, heads, dim),
        ("attention", "key"): (embed, kv_heads, dim),
        ("attention", "value"): (embed, kv_heads, dim),
        ("attention", "out"): (heads, dim, embed),
        ("mlp", "router", "weight"): (embed, experts),
        ("mlp", "router", "bias"): (experts,),
        ("mlp", "gate"): (*expert, embed, hidden),
        ("mlp", "up"): (*expert, embed, hidden),
        ("mlp", "down"): (*expert, hidden, embed),
    }
    return (layers, *shapes[path[1:]])
