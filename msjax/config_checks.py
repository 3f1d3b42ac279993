"""Checks of a config that need no devices: ranges, combinations, divisibility by the mesh.

`validate` runs on every loaded config; `check_divisible_by_mesh` runs again once the mesh
sizes are resolved for the devices (msjax.resolve).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from msjax.errors import ConfigError
from msjax.moe_config import check_moe

if TYPE_CHECKING:
    from msjax.config import (
        CheckpointConfig,
        Config,
        DataConfig,
        ModelConfig,
        ObserveConfig,
        OptimConfig,
        PipelineConfig,
        ResilienceConfig,
    )

# Integers end up in int32 step counters, shapes and loop bounds: larger ones cannot be right.
MAX_INT = 2**31 - 1
MAX_SEED = 2**32 - 1  # jax.random.key takes a 32-bit unsigned seed whole (checked on its own)


def validate(config: Config) -> None:
    """Check every combination that can be checked without devices; raise ConfigError if bad."""
    model, train, data = config.model, config.train, config.data
    _check_numbers_in_range(config)
    _check_data(data)
    positive = {
        "model.vocab_size": model.vocab_size,
        "model.num_layers": model.num_layers,
        "model.embed_dim": model.embed_dim,
        "model.num_heads": model.num_heads,
        "model.num_kv_heads": model.num_kv_heads,
        "model.mlp_dim": model.mlp_dim,
        "data.seq_len": data.seq_len,
        "data.max_corpus_mib": data.max_corpus_mib,
        "train.steps": train.steps,
        "train.global_batch": train.global_batch,
        "train.grad_accum_steps": train.grad_accum_steps,
        "train.eval_batches": train.eval_batches,
        "optim.learning_rate": config.optim.learning_rate,
    }
    for name, value in positive.items():
        if not value > 0:  # also catches NaN
            raise ConfigError(f"{name}={value} must be positive")
    _check_model(model)
    _check_optim(config.optim)
    if not 0 <= config.run.seed <= MAX_SEED:
        raise ConfigError(f"run.seed={config.run.seed} must be in [0, {MAX_SEED}]")
    if not 0.0 <= data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={data.eval_fraction} must be in [0, 1)")
    _check_checkpoint(config.checkpoint)
    if train.eval_every < 0:
        raise ConfigError(f"train.eval_every={train.eval_every} must be 0 (never) or positive")
    if config.optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={config.optim.warmup_steps} must be >= 0")
    if train.peak_tflops is not None and not train.peak_tflops > 0:
        raise ConfigError(f"train.peak_tflops={train.peak_tflops} must be positive (or null)")
    _check_resilience(config.resilience)
    _check_pipeline(config.pipeline)
    _check_observe(config.observe)
    _check_run_name(config.run.name)
    _check_mesh(config)


def _check_numbers_in_range(config: Config) -> None:
    """Every float finite, every integer but the seed small enough for int32 counters."""
    for section in dataclasses.fields(config):
        for key, value in dataclasses.asdict(getattr(config, section.name)).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section.name}.{key}={value} must be a finite number")
            is_int = isinstance(value, int) and not isinstance(value, bool)
            if is_int and abs(value) > MAX_INT and f"{section.name}.{key}" != "run.seed":
                raise ConfigError(
                    f"{section.name}.{key}={value} is out of range; it must be at most "
                    f"{MAX_INT:,} in size"
                )


def _check_data(data: DataConfig) -> None:
    for index, source in enumerate(data.sources):
        if not (math.isfinite(source.weight) and source.weight > 0):
            raise ConfigError(f"data.sources[{index}].weight={source.weight} must be positive")
        if not source.path.strip():
            raise ConfigError(f"data.sources[{index}].path is empty; give a path, glob or stdlib")
    if data.num_workers < 0:
        raise ConfigError(f"data.num_workers={data.num_workers} must be >= 0")
    if data.prefetch_batches < 0:
        raise ConfigError(f"data.prefetch_batches={data.prefetch_batches} must be >= 0")


def _check_mesh(config: Config) -> None:
    """Mesh sizes positive or one -1, and the sizes the mesh splits divisible by it."""
    sizes = config.mesh.axis_sizes()
    _check_expert_axis(config, sizes["expert"])
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}={size} must be a positive size or -1 (the rest)")
    if list(sizes.values()).count(-1) > 1:
        raise ConfigError("only one mesh axis may be -1 (the rest of the devices)")
    if config.model.moe.enabled and sizes["pipe"] != 1:
        raise ConfigError("model.moe.num_experts > 0 runs without a pipeline; set mesh.pipe=1")
    check_divisible_by_mesh(config, sizes)


def _check_expert_axis(config: Config, expert: int) -> None:
    """mesh.expert: a positive size (never -1), only with MoE layers, dividing the experts."""
    num_experts = config.model.moe.num_experts
    if expert < 1:
        raise ConfigError(
            f"mesh.expert={expert} must be a positive size (1: no expert parallelism)"
        )
    if expert > 1 and num_experts == 0:
        raise ConfigError(
            f"mesh.expert={expert} splits the experts of MoE layers; the model has none "
            "(model.moe.num_experts=0): set mesh.expert=1"
        )
    if num_experts % expert:
        raise ConfigError(
            f"model.moe.num_experts={num_experts} is not divisible by mesh.expert={expert}"
        )


def _check_model(model: ModelConfig) -> None:
    if model.head_dim is not None and model.head_dim <= 0:
        raise ConfigError(f"model.head_dim={model.head_dim} must be positive (or null)")
    if model.head_dim is None and model.embed_dim % model.num_heads:
        raise ConfigError(
            f"model.embed_dim={model.embed_dim} is not divisible by model.num_heads="
            f"{model.num_heads}; set model.head_dim or change one of them"
        )
    if model.resolved_head_dim % 2:
        raise ConfigError(
            f"the head dimension {model.resolved_head_dim} (model.embed_dim / model.num_heads, "
            "or model.head_dim) must be even for rotary embeddings"
        )
    if model.num_heads % model.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={model.num_heads} must be a multiple of "
            f"model.num_kv_heads={model.num_kv_heads} (grouped-query attention)"
        )
    if model.attention_window is not None and model.attention_window <= 0:
        raise ConfigError(f"model.attention_window={model.attention_window} must be positive")
    if model.init_from is not None and not model.init_from.startswith("hf:"):
        raise ConfigError(
            f"model.init_from={model.init_from} is not accepted; give hf:PATH, a local "
            "Hugging Face Llama, Mixtral, Qwen3 or Qwen3-MoE directory"
        )
    if model.from_hf and model.init_from is None:
        raise ConfigError("model.from_hf=true needs model.init_from=hf:PATH to read config.json")
    if not model.rope_theta > 1:  # the base of the rotary frequencies theta^(-2i/d)
        raise ConfigError(f"model.rope_theta={model.rope_theta} must be greater than 1")
    if not 0 < model.norm_eps < 1:
        raise ConfigError(f"model.norm_eps={model.norm_eps} must be in (0, 1), e.g. 1e-5")
    if not 0 < model.init_std <= 1:
        raise ConfigError(f"model.init_std={model.init_std} must be in (0, 1], e.g. 0.02")
    check_moe(model.moe, model.num_layers)


def _check_optim(optim: OptimConfig) -> None:
    for key in ("b1", "b2"):
        if not 0 <= getattr(optim, key) < 1:
            raise ConfigError(f"optim.{key}={getattr(optim, key)} must be in [0, 1)")
    if not optim.eps > 0:
        raise ConfigError(f"optim.eps={optim.eps} must be positive, e.g. 1e-8")
    if not optim.weight_decay >= 0:
        raise ConfigError(f"optim.weight_decay={optim.weight_decay} must be >= 0")
    if not 0 <= optim.final_lr_fraction <= 1:
        raise ConfigError(f"optim.final_lr_fraction={optim.final_lr_fraction} must be in [0, 1]")
    if optim.grad_clip_norm is not None and not optim.grad_clip_norm > 0:
        raise ConfigError(
            f"optim.grad_clip_norm={optim.grad_clip_norm} must be positive (or null: no clipping)"
        )


def _check_checkpoint(checkpoint: CheckpointConfig) -> None:
    if checkpoint.every_steps < 0:
        raise ConfigError(f"checkpoint.every_steps={checkpoint.every_steps} must be >= 0")
    if checkpoint.memory_every_steps < 0:
        raise ConfigError(
            f"checkpoint.memory_every_steps={checkpoint.memory_every_steps} must be >= 0 (0: off)"
        )
    if not 0 < checkpoint.memory_max_fraction <= 1:
        raise ConfigError(
            f"checkpoint.memory_max_fraction={checkpoint.memory_max_fraction} must be in (0, 1]"
        )
    if checkpoint.every_minutes is not None and not checkpoint.every_minutes > 0:
        raise ConfigError(f"checkpoint.every_minutes={checkpoint.every_minutes} must be positive")
    unsaved = checkpoint.max_unsaved_minutes
    if unsaved is not None and not unsaved > 0:
        raise ConfigError(
            f"checkpoint.max_unsaved_minutes={unsaved} must be positive (or null: no bound)"
        )
    if checkpoint.max_to_keep < 1:
        raise ConfigError(f"checkpoint.max_to_keep={checkpoint.max_to_keep} must be at least 1")
    if checkpoint.keep_every_steps is not None and checkpoint.keep_every_steps < 1:
        raise ConfigError(
            f"checkpoint.keep_every_steps={checkpoint.keep_every_steps} must be positive (or null)"
        )


def _check_pipeline(pipeline: PipelineConfig) -> None:
    for key in ("microbatches", "repeats"):
        if getattr(pipeline, key) < 1:
            raise ConfigError(f"pipeline.{key}={getattr(pipeline, key)} must be at least 1")
    if pipeline.repeats > 1 and pipeline.schedule != "circular":
        raise ConfigError(
            f"pipeline.repeats={pipeline.repeats} needs pipeline.schedule=circular "
            f"(got {pipeline.schedule}); gpipe runs each stage once per microbatch"
        )


def _check_pipeline_fits(config: Config, sizes: dict[str, int]) -> None:
    """The layer stack splits evenly into stages and the batch into microbatches."""
    pipe, pipeline, model = sizes["pipe"], config.pipeline, config.model
    if pipe <= 1:
        return
    virtual_stages = pipe * pipeline.repeats
    if model.num_layers % virtual_stages:
        raise ConfigError(
            f"model.num_layers={model.num_layers} is not divisible by mesh.pipe x "
            f"pipeline.repeats = {pipe} x {pipeline.repeats} = {virtual_stages} (virtual stages)"
        )
    if pipeline.repeats > 1 and pipeline.microbatches < pipe:
        raise ConfigError(
            f"pipeline.microbatches={pipeline.microbatches} must be at least mesh.pipe={pipe} "
            "for the circular schedule (a microbatch re-enters stage 0 only after leaving the last)"
        )
    if pipeline.schedule == "1f1b" and pipeline.microbatches < pipe:
        raise ConfigError(
            f"pipeline.microbatches={pipeline.microbatches} must be at least mesh.pipe={pipe} "
            "for the 1f1b schedule (with fewer, every microbatch stays alive and only the bubble "
            "grows; use gpipe)"
        )
    data_parallel = sizes["data"] * sizes["fsdp"]
    if data_parallel > 0 and config.train.global_batch % data_parallel == 0:
        # the pipeline splits what one replica runs at once: its share of one accumulation step
        per_replica = config.train.global_batch // data_parallel // config.train.grad_accum_steps
        if per_replica % pipeline.microbatches:
            raise ConfigError(
                f"each data-parallel replica's batch (train.global_batch / (mesh.data x "
                f"mesh.fsdp) / train.grad_accum_steps = {per_replica}) is not divisible by "
                f"pipeline.microbatches={pipeline.microbatches}"
            )


def _check_run_name(name: str) -> None:
    """run.name names a folder inside the runs folder, so it cannot lead out of it."""
    if not name.strip() or name in (".", "..") or any(sep in name for sep in "/\\"):
        raise ConfigError(
            f"run.name={name!r} must be a plain name (no / or \\, not . or ..); "
            "use run.dir to put a run elsewhere"
        )


def _check_observe(observe: ObserveConfig) -> None:
    steps = observe.profile_steps
    if steps and not (len(steps) == 2 and 0 <= steps[0] <= steps[1]):
        raise ConfigError(
            f"observe.profile_steps={list(steps)} must be [first, last] with "
            "0 <= first <= last (or [] for no profile)"
        )
    for key in ("straggler_window_steps", "straggler_windows"):
        if getattr(observe, key) < 1:
            raise ConfigError(f"observe.{key}={getattr(observe, key)} must be at least 1")
    for key in ("straggler_min_excess", "straggler_min_score"):
        if not getattr(observe, key) > 0:
            raise ConfigError(f"observe.{key}={getattr(observe, key)} must be positive")
    if observe.flight_recorder_events < 0:
        raise ConfigError(
            f"observe.flight_recorder_events={observe.flight_recorder_events} must be >= 0"
        )


# Each phase's hang deadline (msjax/launch/fault_detection.py maps phases to them).
PHASE_DEADLINE_KEYS = (
    "step_deadline_s",
    "compile_deadline_s",
    "init_deadline_s",
    "data_deadline_s",
    "restore_deadline_s",
    "checkpoint_deadline_s",
)


def _check_resilience(resilience: ResilienceConfig) -> None:
    """Heartbeats and deadlines (configured and measured), then the supervisor's recovery."""
    for key in ("heartbeat_every_s", "peer_timeout_s", *PHASE_DEADLINE_KEYS, "stop_grace_s"):
        value = getattr(resilience, key)
        if not value > 0:
            raise ConfigError(f"resilience.{key}={value} must be positive")
    for key in PHASE_DEADLINE_KEYS:
        # a heartbeat as rare as a deadline makes a busy rank look hung between two beats
        if resilience.heartbeat_every_s >= getattr(resilience, key):
            raise ConfigError(
                f"resilience.heartbeat_every_s={resilience.heartbeat_every_s} must be shorter "
                f"than resilience.{key}={getattr(resilience, key)} (and every phase deadline)"
            )
    if not (
        math.isfinite(resilience.measured_deadline_factor)
        and (resilience.measured_deadline_factor == 0 or resilience.measured_deadline_factor >= 1)
    ):
        raise ConfigError(
            f"resilience.measured_deadline_factor={resilience.measured_deadline_factor} must be "
            "0 (configured deadlines only) or at least 1"
        )
    if not resilience.measured_deadline_floor_s > 0:
        raise ConfigError(
            f"resilience.measured_deadline_floor_s={resilience.measured_deadline_floor_s} "
            "must be positive"
        )
    for key in ("measured_deadline_after_steps", "measured_deadline_after_saves"):
        if getattr(resilience, key) < 1:
            raise ConfigError(f"resilience.{key}={getattr(resilience, key)} must be at least 1")
    if not resilience.warm_standby_after_s >= 0:
        raise ConfigError(
            f"resilience.warm_standby_after_s={resilience.warm_standby_after_s} must be at "
            "least 0 (seconds of an attempt's steps before its warm standbys start)"
        )
    _check_recovery(resilience)


def _check_recovery(resilience: ResilienceConfig) -> None:
    """The supervisor's side of resilience: restarts and their backoff, its records, the checks
    it runs, and when a slot is left out."""
    if resilience.restart_backoff_s < 0:
        raise ConfigError(
            f"resilience.restart_backoff_s={resilience.restart_backoff_s} must be >= 0"
        )
    if not 0 <= resilience.infrastructure_backoff_s <= resilience.infrastructure_backoff_max_s:
        raise ConfigError(
            f"resilience.infrastructure_backoff_s={resilience.infrastructure_backoff_s} and "
            f"resilience.infrastructure_backoff_max_s={resilience.infrastructure_backoff_max_s}: "
            "need 0 <= infrastructure_backoff_s <= infrastructure_backoff_max_s (seconds)"
        )
    if not resilience.launch_record_every_s > 0:
        raise ConfigError(
            f"resilience.launch_record_every_s={resilience.launch_record_every_s} must be > 0 "
            "(seconds between a running launcher's records in launches.jsonl)"
        )
    if resilience.replica_check_every < 0:
        raise ConfigError(
            f"resilience.replica_check_every={resilience.replica_check_every} must be >= 0 "
            "(0: no replica checks)"
        )
    if resilience.compute_check_every < 0:
        raise ConfigError(
            f"resilience.compute_check_every={resilience.compute_check_every} must be >= 0 "
            "(0: no in-training known-answer checks)"
        )
    if resilience.max_restarts < 0:
        raise ConfigError(f"resilience.max_restarts={resilience.max_restarts} must be >= 0")
    if resilience.max_attempts_without_progress < 1:
        raise ConfigError(
            "resilience.max_attempts_without_progress="
            f"{resilience.max_attempts_without_progress} must be >= 1"
        )
    if resilience.max_faults_per_slot < 1:
        raise ConfigError(
            f"resilience.max_faults_per_slot={resilience.max_faults_per_slot} must be >= 1"
        )
    if resilience.readmit_after_s < 0:
        raise ConfigError(
            f"resilience.readmit_after_s={resilience.readmit_after_s} must be >= 0 (0: never)"
        )
    if resilience.compile_cache_dir is not None and not resilience.compile_cache_dir.strip():
        raise ConfigError("resilience.compile_cache_dir is empty; give a path (or null)")
    if not (math.isfinite(resilience.check_budget_s) and resilience.check_budget_s >= 0):
        raise ConfigError(
            f"resilience.check_budget_s={resilience.check_budget_s} must be >= 0 seconds "
            "(0: no self-checks)"
        )
    if not (math.isfinite(resilience.slow_device_factor) and resilience.slow_device_factor > 1):
        raise ConfigError(
            f"resilience.slow_device_factor={resilience.slow_device_factor} must be a number > 1"
        )


def check_divisible_by_mesh(config: Config, sizes: dict[str, int]) -> None:
    """Checks against mesh axes whose sizes are known (an axis of -1 is checked later)."""
    model, mesh = config.model, config.mesh
    split_axes = ("data", "fsdp", "expert") if sizes["expert"] > 1 else ("data", "fsdp")
    data_parallel = math.prod(sizes[axis] for axis in split_axes)
    split_text = " x ".join(f"mesh.{axis}" for axis in split_axes)
    if data_parallel > 0 and config.train.global_batch % data_parallel:
        raise ConfigError(
            f"train.global_batch={config.train.global_batch} is not divisible by the "
            f"data-parallel size {split_text} = {data_parallel}"
        )
    accum_steps = config.train.grad_accum_steps
    if data_parallel > 0 and (config.train.global_batch // data_parallel) % accum_steps:
        raise ConfigError(
            f"train.grad_accum_steps={accum_steps} does not divide each data-parallel replica's "
            f"batch (train.global_batch / ({split_text}) = "
            f"{config.train.global_batch // data_parallel}); use a divisor of it"
        )
    tensor = sizes["tensor"]
    if tensor > 0:
        if model.num_heads % tensor:
            raise ConfigError(
                f"model.num_heads={model.num_heads} is not divisible by mesh.tensor={tensor}"
            )
        if model.mlp_dim % tensor:
            raise ConfigError(
                f"model.mlp_dim={model.mlp_dim} is not divisible by mesh.tensor={tensor}"
            )
        if model.vocab_size % tensor:
            raise ConfigError(
                f"model.vocab_size={model.vocab_size} is not divisible by mesh.tensor={tensor}; "
                "pad the vocabulary to a multiple of it"
            )
        if mesh.sequence_parallel and config.data.seq_len % tensor:
            raise ConfigError(
                f"data.seq_len={config.data.seq_len} is not divisible by mesh.tensor={tensor}, "
                "which mesh.sequence_parallel=true needs"
            )
    if sizes["fsdp"] > 0 and model.embed_dim % sizes["fsdp"]:
        raise ConfigError(
            f"model.embed_dim={model.embed_dim} is not divisible by mesh.fsdp={sizes['fsdp']}"
        )
    _check_pipeline_fits(config, sizes)
