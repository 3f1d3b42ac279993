"""Which implementation an op runs: `auto` resolves by backend; impossible choices are errors."""

from __future__ import annotations

import jax

from msjax.errors import ConfigError

# What each `model.*_impl` key accepts besides `auto`.
ATTENTION_IMPLS = ("xla", "pallas", "cudnn")
NORM_IMPLS = ("xla", "pallas", "triton")
LOSS_IMPLS = ("xla", "pallas")
GPU_ONLY_IMPLS = ("cudnn", "triton")  # no interpreter off GPU


def resolve_impl(impl: str, key: str, choices: tuple[str, ...]) -> str:
    """`auto` -> `pallas` on GPU and `xla` elsewhere; `cudnn` or `triton` off GPU is a ConfigError.

    key names the config knob (`model.attention_impl`) so the message points at the fix.
    """
    if impl not in ("auto", *choices):
        raise ConfigError(
            f"{key}={impl!r} is not accepted; choose one of auto, {', '.join(choices)}"
        )
    backend = jax.default_backend()
    if impl == "auto":
        return "pallas" if backend == "gpu" else "xla"
    if impl in GPU_ONLY_IMPLS and backend != "gpu":
        runnable = [choice for choice in ("auto", *choices) if choice not in GPU_ONLY_IMPLS]
        raise ConfigError(
            f"{key}={impl} needs a GPU, but this run's backend is {backend}; "
            f"use {', '.join(runnable)}"
        )
    return impl


def interpret_kernels() -> bool:
    """Pallas kernels run in the interpreter (slow, exact) everywhere but on a GPU."""
    return jax.default_backend() != "gpu"
