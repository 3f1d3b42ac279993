"""Measuring and tabulating kernels for benchmarks/kernels_gpu.py and gpu_suite.py: amortised
median wall time, relative error, a jitted forward + backward, and the rows and tables of
results."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

Row = dict[str, object]


@dataclass(frozen=True)
class Timing:
    """How to time a call: `calls` dispatched back to back and blocked on once make a batch, so
    Python dispatch and launch overlap the device's work; the median over `batches` batches."""

    calls: int = 20
    batches: int = 7


SMOKE_TIMING = Timing(calls=2, batches=1)  # the interpreter on CPU: the times mean nothing


def time_ms(fn: Callable, *args, timing: Timing = Timing()) -> float:
    """Median wall time of one call in ms, after a compile-and-warm-up call."""
    jax.block_until_ready(fn(*args))
    per_call = []
    for _ in range(timing.batches):
        started = time.perf_counter()
        for _ in range(timing.calls):
            out = fn(*args)  # a device runs its queue in order: the last done means all are
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - started) / timing.calls)
    return 1e3 * float(np.median(per_call))


def relative_error(actual, expected) -> float:
    """Max |actual - expected| over max |expected| (at least 1), over every leaf."""
    worst = 0.0
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        if not np.isfinite(got).all():
            return float("inf")
        worst = max(
            worst, float(np.max(np.abs(got - want))) / max(1.0, float(np.max(np.abs(want))))
        )
    return worst


def forward_and_backward(fn: Callable) -> Callable:
    """jit of (output, gradients of <output, cotangent> wrt the float arguments)."""

    def run(args, cotangent):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(cotangent)

    return jax.jit(run)


def normal(shape, dtype, seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def failed_row(kernel, shape, window, name, error) -> Row:
    return {
        "kernel": kernel,
        "case": f"{shape} window={window}",
        "impl": name,
        "ms": float("nan"),
        "rate": f"failed: {type(error).__name__}",
    }


def with_speedups(rows: list[Row]) -> list[Row]:
    """Speed-up of our kernel over each baseline (baseline ms / our ms) on the baseline's row."""
    ours = next((row["ms"] for row in rows if row["impl"].endswith("(ours)")), float("nan"))
    for row in rows:
        row["ours_vs_this"] = row["ms"] / ours if ours == ours and ours > 0 else float("nan")
    return rows


def print_checks(rows: list[Row]) -> None:
    """Correctness (forward and gradients vs the float32 reference) and fwd+bwd time."""
    print(f"{'check':<62} {'impl':<16} {'dtype':<9} {'error':>9} {'tol':>7} ok  {'ms':>9}")
    for row in rows:
        ok = "yes" if row["max_error"] <= row["tolerance"] else "NO "
        label = f"{row['kernel']} {row['check']}"
        print(
            f"{label:<62} {row['impl']:<16} {row['dtype']:<9} {row['max_error']:>9.2e} "
            f"{row['tolerance']:>7.0e} {ok} {row['ms']:>9.2f}"
        )


def print_timings(rows: list[Row]) -> None:
    print(f"{'kernel':<22} {'case':<36} {'impl':<20} {'ms':>9}  {'ours x':>7}  rate")
    for row in rows:
        print(
            f"{row['kernel']:<22} {row['case']:<36} {row['impl']:<20} {row['ms']:>9.3f}  "
            f"{row['ours_vs_this']:>7.2f}  {row['rate']}"
        )
