"""The typed config tree: frozen dataclasses, YAML loading, `section.key=value` overrides, checks,
and which keys define a run (`differences`: what a run dir and a checkpoint hold to).

Every knob has one home and one default here. The defaults are the `tiny` run that
`python -m msjax.train` starts with no arguments; `configs/tiny.yaml` spells the same values out.
The checks every loaded config passes are in `config_checks`; what depends on the devices and
backend is filled in by `msjax.resolve`.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from msjax.checkpoint_config import CheckpointConfig
from msjax.config_checks import validate
from msjax.config_file import read_config_file
from msjax.errors import ConfigError
from msjax.moe_config import MoeConfig
from msjax.resilience_config import ResilienceConfig

DType = Literal["float32", "bfloat16"]


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention."""

    vocab_size: int = 264  # 256 bytes + end-of-document, padded to a multiple of 8
    num_layers: int = 4  # transformer blocks, stacked (scanned or unrolled: layer_loop)
    embed_dim: int = 128  # the residual stream's width
    num_heads: int = 8  # query heads; divisible by mesh.tensor
    num_kv_heads: int = 4  # key/value heads (grouped-query attention); divides num_heads
    head_dim: int | None = None  # None: embed_dim // num_heads
    mlp_dim: int = 384  # the SwiGLU hidden width
    rope_theta: float = 10000.0  # the base of RoPE's frequencies; > 1
    norm_eps: float = 1e-5  # RMSNorm's epsilon; in (0, 1)
    init_std: float = 0.02  # standard deviation of the initial weights; in (0, 1]
    tied_embeddings: bool = False  # the unembedding reuses the embedding table
    parallel_block: bool = False  # MegaScale §3.1: y = x + Attn(LN(x)) + MLP(LN(x))
    attention_window: int | None = None  # sliding-window attention; None: full causal
    # Qwen3: an RMSNorm over each query and key head's head_dim (one scale of head_dim for the
    # queries, one for the keys, per layer) before RoPE
    qk_norm: bool = False
    # what the backward pass recomputes instead of keeping: none; full (keeps each layer's
    # input); dots (also the projection and MLP matmuls' outputs); attention (dots and
    # attention's output: only the attention scores and softmax are recomputed)
    remat: Literal["none", "full", "dots", "attention"] = "none"
    # how the stacked layers run: scan (one loop body, compiled once: the compile time of a deep
    # model) or unroll (each layer its own code: no per-layer slicing of the stacked weights nor
    # stacking of saved activations, 6-13% more tokens/s on CPU at benchmarks' shape); `auto`
    # is unroll on CPU without a pipeline or remat, scan elsewhere (msjax.resolve)
    layer_loop: Literal["auto", "scan", "unroll"] = "auto"
    # parameters stay float32 (master copy); fsdp gathers each layer's weights in this dtype,
    # cast on the shard, inside the layer loop
    compute_dtype: DType = "float32"
    # msjax.resolve makes `auto` cuDNN attention with the XLA norm and loss on GPU (XLA attention
    # where cuDNN does not take the model), the XLA reference elsewhere; pallas
    # off GPU runs the kernels in the Pallas interpreter (slow; for tests); cudnn and triton (a
    # jax-triton kernel) need a GPU. loss_impl=pallas is the fused unembedding + cross-entropy
    # that never holds [tokens, vocab] logits.
    attention_impl: Literal["auto", "xla", "pallas", "cudnn"] = "auto"
    norm_impl: Literal["auto", "xla", "pallas", "triton"] = "auto"  # as attention_impl; triton: GPU
    loss_impl: Literal["auto", "xla", "pallas"] = "auto"  # as attention_impl; pallas: fused loss
    # hf:PATH, a local Hugging Face Llama, Mixtral, Qwen3 or Qwen3-MoE directory: a new run
    # starts from its weights (a run with checkpoints resumes from them instead); the keys above
    # (and a mixture's model.moe shape) must match its config.json, or are filled from it with
    # from_hf=true
    init_from: str | None = None
    from_hf: bool = False  # fill the model section from init_from's config.json
    moe: MoeConfig = field(default_factory=MoeConfig)  # mixture of experts: `model.moe.*` below

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.embed_dim // self.num_heads


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes, outermost first; -1 on one axis means "the rest of the devices"."""

    data: int = 2  # data-parallel replicas: the batch is split over data and fsdp together
    fsdp: int = 2  # ZeRO-3: parameters and optimizer state split along embed
    # expert parallelism (MoE only): devices carved out of the data-parallel ones; the experts
    # are split over them (tokens reach theirs by all-to-all), everything else is data-parallel
    # over them too (the batch splits over data x fsdp x expert); divides model.moe.num_experts
    expert: int = 1
    pipe: int = 1  # pipeline stages (msjax.parallel.pipeline); spans nodes, tensor stays inside
    tensor: int = 2  # Megatron tensor parallelism: heads, MLP units and the vocabulary split
    sequence_parallel: bool = False  # shard activations between blocks along seq over `tensor`

    def axis_sizes(self) -> dict[str, int]:
        """Sizes in mesh order, outermost first (msjax.parallel.mesh.MESH_AXES)."""
        return {
            "data": self.data,
            "fsdp": self.fsdp,
            "expert": self.expert,
            "pipe": self.pipe,
            "tensor": self.tensor,
        }

    def batch_split(self) -> int:
        """Data-parallel ways the batch is split: data x fsdp x expert (resolved sizes)."""
        return self.data * self.fsdp * self.expert


@dataclass(frozen=True)
class PipelineConfig:
    """How the layer stack runs over the `pipe` mesh axis (used when mesh.pipe > 1)."""

    # gpipe: each microbatch passes the stages once; circular (interleaved): each device holds
    # `repeats` virtual stages (layers s, s+P, ...), which shrinks the bubble R times; 1f1b:
    # forward and backward interleaved, a stage keeps at most 2 x pipe - 1 microbatches' inputs.
    schedule: Literal["gpipe", "circular", "1f1b"] = "gpipe"
    microbatches: int = 4  # each data-parallel replica's batch is split into this many
    repeats: int = 1  # virtual stages per device (circular only)
    # with fsdp beside pipe: per_iteration gathers each layer's weights (and reduce-scatters
    # their gradient) where the stage's layer scan runs it, every pipeline iteration, one layer
    # whole at a time; once gathers the stage's weights (float32) before the loop and
    # reduce-scatters their gradient (in optim.grad_reduce_dtype) after it, once per step,
    # holding the stage's float32 weights and gradient whole through the loop
    fsdp_gather: Literal["per_iteration", "once"] = "per_iteration"


@dataclass(frozen=True)
class SourceConfig:
    """One corpus of the training mixture: `stdlib`, text files, or pre-tokenized token files."""

    # `stdlib` (the running Python's standard library sources), or a path or glob of .txt,
    # .jsonl, .jsonl.gz or .parquet text files, or of .bin / .npy pre-tokenized token files.
    path: str = "stdlib"
    weight: float = 1.0  # relative share of this source's sequences in every stretch of batches
    text_field: str = "text"  # the field holding the text in .jsonl and .parquet records
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # element type of .bin token files


@dataclass(frozen=True)
class DataConfig:
    """The training corpus, its tokenizer, and how it is packed into sequences and fed."""

    # One source or a weighted mixture; in YAML a list of paths or {path, weight, ...} mappings,
    # on the command line e.g. data.sources='[{path: a/*.jsonl.gz, weight: 3}, stdlib]'.
    sources: tuple[SourceConfig, ...] = (SourceConfig(),)
    tokenizer: str = "byte"  # byte, or a SentencePiece .model or Hugging Face tokenizer.json file
    cache_dir: str | None = None  # tokenized corpora; None: $MSJAX_CACHE_DIR or ~/.cache/msjax
    seq_len: int = 128  # tokens per sequence; documents are packed and cut to this length
    cross_document_attention: bool = False  # false: tokens attend within their own document only
    eval_fraction: float = 0.01  # share of documents held out for validation
    max_corpus_mib: int = 24  # stdlib source: read at most this much text (keeps start-up fast)
    num_workers: int = 0  # Grain worker processes preparing batches; 0: a thread in the trainer
    prefetch_batches: int = 2  # batches placed on the devices ahead of the step
    # resume even when the corpus differs from the one the checkpoint was trained on (recorded)
    allow_changed: bool = False


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer, its learning-rate schedule and gradient clipping."""

    # lamb: one trust ratio per layer, also within stacked layers
    name: Literal["adamw", "lamb"] = "adamw"
    learning_rate: float = 3e-3  # the peak, reached at the end of the warmup
    warmup_steps: int = 30  # linear warmup from 0; >= 0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"  # the decay after the warmup
    final_lr_fraction: float = 0.1  # the decay ends at learning_rate * final_lr_fraction
    b1: float = 0.9  # the first moment's decay; in [0, 1)
    b2: float = 0.95  # the second moment's decay; in [0, 1)
    eps: float = 1e-8  # added to the second moment's root; > 0
    weight_decay: float = 0.1  # never applied to norms and biases; >= 0
    grad_clip_norm: float | None = 1.0  # clip the global gradient norm to this; > 0, null: none
    # the dtype fsdp reduce-scatters gradients in when weights are gathered in a narrower
    # model.compute_dtype; float32 keeps the sum exact to float32 rounding
    grad_reduce_dtype: DType = "float32"


@dataclass(frozen=True)
class TrainConfig:
    """How long to train, on how much data per step, and how often to evaluate."""

    steps: int = 300  # optimizer steps of the whole run
    # sequences per step, over all devices; divisible by data x fsdp x expert
    global_batch: int = 16
    # gradient accumulation: each step runs its global batch as this many microbatches, one after
    # another inside the compiled step (activations of one microbatch alive at a time, beside a
    # float32 sum of the gradients); the same loss, gradients and update as one pass over the
    # whole batch (each microbatch's loss divided by the whole batch's real tokens). It divides
    # each replica's batch, global_batch / (data x fsdp x expert); on a pipe mesh
    # pipeline.microbatches splits what is left. Each microbatch gathers the fsdp weights and
    # reduces its gradients again: K times one pass's traffic over fsdp and data, which the
    # planner counts
    grad_accum_steps: int = 1
    eval_every: int = 100  # 0: never
    eval_batches: int = 4  # held-out batches per evaluation
    # per device, for MFU; None: the A100/H100/H200 table, or a matmul measured on CPU
    peak_tflops: float | None = None
    # overlap: on a GPU, XLA flags for the latency-hiding scheduler, pipelined all-gather /
    # reduce-scatter / all-reduce / point-to-point, while-loop double buffering and collective
    # matmul, spelled as the installed jaxlib knows them (unknown ones are never passed;
    # msjax.parallel.xla_flags); flags already in the XLA_FLAGS environment variable win; a
    # no-op on CPU. none: no flags
    xla_profile: Literal["none", "overlap"] = "overlap"


@dataclass(frozen=True)
class RunConfig:
    """Identity of a run: its name, its directory and its seed."""

    name: str = "tiny"  # a plain name (the folder under runs/), never a path
    dir: str | None = None  # None: runs/<name>-<UTC timestamp>; an existing run resumes
    seed: int = 0  # initial weights and the data order; in [0, 2^32 - 1]
    overwrite: bool = False  # start afresh in a run dir of another config (its files kept aside)


@dataclass(frozen=True)
class ObserveConfig:
    """Per-rank timing, straggler detection, the flight recorder, TensorBoard and profiles."""

    rank_timing: bool = True  # every rank's own work per step, gathered into RUN_DIR/ranks.jsonl
    straggler_window_steps: int = 5  # ranks are compared over windows of this many steps
    straggler_windows: int = 2  # flagged this many windows in a row before it is reported
    # A rank is a straggler when its own work exceeds the ranks' median by this share of the
    # step time, and by this many robust deviations (MAD) of the ranks around that median.
    straggler_min_excess: float = 0.1
    straggler_min_score: float = 4.0  # the deviations (MAD) above, see straggler_min_excess
    flight_recorder_events: int = 256  # each rank's ring buffer of its last events; 0: off
    tensorboard: bool = False  # also write the scalars as TensorBoard events, RUN_DIR/tensorboard
    # [first, last]: a JAX profiler trace of those steps (metrics.jsonl's step numbers) on every
    # rank, in RUN_DIR/profiles/rank<r>; empty: none
    profile_steps: tuple[int, ...] = ()


@dataclass(frozen=True)
class Config:
    """The whole config tree of one msjax run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return _lists_for_tuples(dataclasses.asdict(self))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# Keys that may change between the runs that share a run directory (a resume may run on another
# mesh, train longer, evaluate differently, or run the same math through another kernel);
# everything else defines the run.
MAY_CHANGE_ON_RESUME = frozenset(
    {
        "mesh",
        "pipeline",
        "checkpoint",
        "model.init_from",  # where a new run's weights came from; a resumed run restores its own
        "model.from_hf",
        "observe",
        "resilience",
        "run.dir",
        "run.name",
        "run.overwrite",
        "train.steps",
        "train.grad_accum_steps",  # the same batch, loss and update, in fewer or more passes
        "train.eval_every",
        "train.eval_batches",
        "train.peak_tflops",
        "data.prefetch_batches",
        "data.num_workers",
        "data.cache_dir",
        "data.allow_changed",
        "model.attention_impl",
        "model.norm_impl",
        "model.loss_impl",
        "model.moe.matmul_impl",
        "model.layer_loop",  # how the layers run, not what they compute
    }
)


def differences(before: Config, after: Config) -> list[str]:
    """`section.key: old -> new` for each key that defines the run and differs."""
    changed = []
    old, new = before.to_dict(), after.to_dict()
    for section, values in new.items():
        if section in MAY_CHANGE_ON_RESUME:
            continue
        for key, value in values.items():
            name, old_value = f"{section}.{key}", old[section].get(key)
            pairs = [(name, old_value, value)]
            if isinstance(value, dict):  # a section inside a section (model.moe): key by key
                inner = old_value if isinstance(old_value, dict) else {}
                pairs = [(f"{name}.{k}", inner.get(k), v) for k, v in value.items()]
            for pair_name, was, now in pairs:
                if pair_name not in MAY_CHANGE_ON_RESUME and was != now:
                    changed.append(f"{pair_name}: {was!r} -> {now!r}")
    return changed


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """The config from a YAML file (or the defaults) with `section.key=value` overrides applied."""
    root: dict[str, Any] = {} if path is None else read_config_file(Path(path))
    for override in overrides:
        section, key, value = _parse_override(override)
        mapping = root
        for part in (section, *key.split(".")[:-1]):  # model.moe.num_experts: two mappings deep
            if mapping.get(part) is None:
                mapping[part] = {}  # a section left empty in the file, or not there at all
            if not isinstance(mapping[part], dict):
                raise ConfigError(f"config section '{part}' must be a mapping of keys")
            mapping = mapping[part]
        mapping[key.split(".")[-1]] = value
    config = config_from_dict(root)
    validate(config)
    return config


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Build a Config from nested dicts, checking every section, key and value type."""
    if not isinstance(tree, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(tree).__name__}")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    built = {}
    for section_name, values in tree.items():
        if section_name not in sections:
            raise ConfigError(_unknown("section", section_name, sections))
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"config section '{section_name}' must be a mapping of keys")
        section_type = _hints(Config)[section_name]
        built[section_name] = _build_section(section_name, section_type, values)
    return Config(**built)


def _build_section(section_name: str, section_type: type, values: dict[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(section_type)}
    hints = _hints(section_type)
    checked = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(_unknown("key", f"{section_name}.{key}", fields, prefix=section_name))
        checked[key] = _coerce(f"{section_name}.{key}", value, hints[key])
    return section_type(**checked)


def _lists_for_tuples(tree: Any) -> Any:
    """The tree with tuples as lists, so YAML and JSON write them as plain sequences."""
    if isinstance(tree, dict):
        return {key: _lists_for_tuples(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_lists_for_tuples(value) for value in tree]
    return tree


def _coerce_sources(name: str, value: Any) -> tuple[SourceConfig, ...]:
    """A source list from a path, a {path, weight, ...} mapping, or a list of either."""
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ConfigError(f"{name} is empty; give at least one source (e.g. stdlib)")
    sources = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            item = {"path": item}
        if not isinstance(item, dict):
            raise ConfigError(
                f"{name}[{index}]={item!r} must be a path or a mapping with keys "
                + ", ".join(f.name for f in dataclasses.fields(SourceConfig))
            )
        sources.append(_build_section(f"{name}[{index}]", SourceConfig, item))
    return tuple(sources)


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """Return value as the annotated type, or raise a ConfigError naming what is accepted."""
    origin = get_origin(annotation)
    if annotation == tuple[SourceConfig, ...]:
        return _coerce_sources(name, value)
    if dataclasses.is_dataclass(annotation):  # a section inside a section: model.moe
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a mapping of keys")
        return _build_section(name, annotation, value)
    if annotation == tuple[int, ...]:
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(_coerce(f"{name}[{index}]", item, int) for index, item in enumerate(items))
    if origin in (typing.Union, types.UnionType):
        options = get_args(annotation)
        is_null = value is None or (isinstance(value, str) and value.lower() in ("null", "none"))
        if is_null and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(name, value, option)
            except ConfigError as error:
                errors.append(error)
        raise errors[0]
    if origin is Literal:
        choices = get_args(annotation)
        if value in choices:
            return value
        raise ConfigError(f"{name}={value!r} is not accepted; choose one of {', '.join(choices)}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}={value!r} must be a boolean (true or false)")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name}={value!r} must be an integer")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads "3e-4" as a string
            except ValueError:
                pass
        raise ConfigError(f"{name}={value!r} must be a number")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}={value!r} must be a string")
    raise TypeError(f"unsupported config annotation {annotation!r} for {name}")


def _parse_override(override: str) -> tuple[str, str, Any]:
    name, equals, text = override.partition("=")
    section, dot, key = name.strip().partition(".")
    nested = section == "model" and key.count(".") == 1 and key.startswith("moe.")  # model.moe.*
    if not equals or not dot or not section or not key or ("." in key and not nested):
        raise ConfigError(f"override {override!r} must look like section.key=value")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    sections = {f.name for f in dataclasses.fields(Config)}
    if section not in sections:
        raise ConfigError(_unknown("section", section, sections))
    return section, key, value


def _unknown(kind: str, name: str, valid: typing.Iterable[str], prefix: str = "") -> str:
    candidates = [f"{prefix}.{v}" if prefix else v for v in valid]
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]}?" if close else f"; valid: {', '.join(sorted(candidates))}"
    return f"unknown config {kind} '{name}'{hint}"


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, globalns=globals())
