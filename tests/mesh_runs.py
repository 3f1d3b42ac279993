"""A small model trained a few steps on fixed batches through the compiled program, on any mesh:
what the sharding and pipeline tests compare."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import numpy as np

from msjax.config import Config, config_from_dict
from msjax.data.batches import pack_rows
from msjax.data.tokenizer import ByteTokenizer
from msjax.parallel.mesh import build_mesh
from msjax.resolve import resolve
from msjax.step import build_program

STEPS = 5


def small_config(
    data: int,
    fsdp: int,
    tensor: int,
    sequence_parallel: bool = False,
    pipe: int = 1,
    model: dict[str, Any] | None = None,
    pipeline: dict[str, Any] | None = None,
) -> Config:
    return config_from_dict(
        {
            "model": {
                "vocab_size": 264,
                "num_layers": 2,
                "embed_dim": 64,
                "num_heads": 8,
                "num_kv_heads": 4,
                "mlp_dim": 128,
                **(model or {}),
            },
            "mesh": {
                "data": data,
                "fsdp": fsdp,
                "pipe": pipe,
                "tensor": tensor,
                "sequence_parallel": sequence_parallel,
            },
            "pipeline": pipeline or {},
            "data": {"seq_len": 32},
            "optim": {"learning_rate": 1e-2, "warmup_steps": 2},
            "train": {"steps": STEPS, "global_batch": 16},
        }
    )


def fixed_batches(config: Config) -> list[dict[str, np.ndarray]]:
    text = Path(__file__).read_bytes() * 40  # learnable, unlike random tokens
    tokens = ByteTokenizer().encode(text)  # one document, no EOS: one segment per row
    seq_len, rows = config.data.seq_len, config.train.global_batch
    windows = [tokens[i * seq_len : (i + 1) * seq_len + 1] for i in range(STEPS * rows)]
    return [
        pack_rows(windows[step * rows : (step + 1) * rows], seq_len, ByteTokenizer.eos_id, False)
        for step in range(STEPS)
    ]


def packed_batches(config: Config, steps: int) -> list[dict[str, np.ndarray]]:
    """Rows packed from documents of different lengths, some padded: positions, segment ids and
    real-token weights differ from row to row (and so between pipeline microbatches)."""
    text = Path(__file__).read_bytes() * 40
    tokens = ByteTokenizer().encode(text)
    seq_len, rows, eos = config.data.seq_len, config.train.global_batch, ByteTokenizer.eos_id
    windows, start = [], 0
    for row in range(steps * rows):
        length = seq_len + 1 - (row * 7) % (seq_len // 2)  # every other row padded, by more
        window = np.array(tokens[start : start + length])
        window[(row % 5) + 3 :: 9 + row % 6] = eos  # documents end at row-dependent places
        windows.append(window)
        start += length
    return [
        pack_rows(windows[step * rows : (step + 1) * rows], seq_len, eos, False)
        for step in range(steps)
    ]


def train_program(
    config: Config, batches: list[dict[str, np.ndarray]] | None = None
) -> tuple[list[float], dict[str, Any]]:
    """Losses of STEPS steps (or one per given batch), and the final parameters in canonical
    layer order (numpy)."""
    device_count = math.prod(config.mesh.axis_sizes().values())
    config = resolve(config, device_count, jax.default_backend())  # as a run does: impls chosen
    mesh = build_mesh(config.mesh, jax.devices()[:device_count])
    program = build_program(config, mesh)
    state = program.init_state()
    losses = []
    for batch in fixed_batches(config) if batches is None else batches:
        state, metrics = program.train_step(state, jax.device_put(batch, program.batch_sharding))
        losses.append(float(metrics["loss"]))
    params = jax.tree.map(np.asarray, program.to_canonical(state).params)
    return losses, params


def train_losses(config: Config) -> list[float]:
    return train_program(config)[0]
