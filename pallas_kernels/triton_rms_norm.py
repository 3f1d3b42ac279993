"""RMSNorm as raw Triton kernels called through jax-triton, alone or fused with the residual add.
Import it on a GPU only: triton and jax-triton load with it, and not on a CPU-only jaxlib.
`reference` and `reference_add` are the plain-JAX versions from `pallas_kernels.rms_norm`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import jax_triton
import triton
import triton.language as tl

from pallas_kernels.rms_norm import norms_with_vjp, reference, reference_add

__all__ = ["add_rms_norm", "reference", "reference_add", "rms_norm"]

# The one jax-triton op: a row-wise norm is the simplest kernel there is, and a raw Triton kernel
# states its schedule (one row per program, num_warps across the row) directly instead of
# through Pallas block specs. The backward saves nothing but a per-row 1/rms from the forward
# and sums the scale gradient from per-program partial sums in JAX.

# The backward's per-program partial scale gradients ([programs, padded_dim] float32) stay at
# most 1024 rows, 16 MiB at dim 4096, however many rows x has.
MAX_BACKWARD_PROGRAMS = 1024


@dataclass(frozen=True)
class _Static:
    eps: float
    dim: int
    padded_dim: int  # a power of two: one row is one Triton block
    num_warps: int
    zero_outputs: bool


def rms_norm(
    x: jax.Array, scale: jax.Array, *, eps: float = 1e-5, zero_outputs: bool = False
) -> jax.Array:
    """The kernel form of `reference`: x [..., dim], scale [dim].

    zero_outputs: clear every output buffer before its kernel runs (for tests: an element a
    kernel never writes then reads 0 rather than whatever the allocator left there).
    """
    return _norm(x, scale, _static(x, scale, eps, zero_outputs))


def add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    scale: jax.Array,
    *,
    eps: float = 1e-5,
    zero_outputs: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The kernel form of `reference_add`: one pass over x and residual gives both outputs."""
    return _add_norm(x, residual, scale, _static(x, scale, eps, zero_outputs))


def _static(x, scale, eps, zero_outputs) -> _Static:
    dim = x.shape[-1]
    if scale.shape != (dim,):
        raise ValueError(f"scale {scale.shape} must be [{dim}] for x {x.shape}")
    if x.size == 0:
        raise ValueError(f"x {x.shape} has no rows to normalize")
    padded_dim = triton.next_power_of_2(dim)
    # Triton's layer-norm tutorial: a row of at most 64 KiB stays in registers.
    if padded_dim * jnp.dtype(x.dtype).itemsize > 65536:
        raise ValueError(f"dim {dim} of {x.dtype} is over 64 KiB a row; use model.norm_impl=pallas")
    return _Static(
        eps=float(eps),
        dim=dim,
        padded_dim=padded_dim,
        num_warps=min(max(padded_dim // 256, 1), 8),  # as in the same tutorial
        zero_outputs=bool(zero_outputs),
    )


# ---- kernels ------------------------------------------------------------------------------------
# Pointers index row-major [rows, DIM] arrays; offsets are int64, as rows * DIM can pass 2**31.


@triton.jit
def _normalize_row(
    row, x, columns, mask, scale_ptr, out_ptr, rstd_ptr, DIM: tl.constexpr, EPS: tl.constexpr
):
    """Writes x * rstd * scale for one row, and rstd = 1 / rms(x); x: [BLOCK] float32."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / DIM + EPS)
    scale = tl.load(scale_ptr + columns, mask=mask, other=0.0).to(tl.float32)
    out = x * rstd * scale
    tl.store(out_ptr + row * DIM + columns, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _forward_kernel(
    x_ptr,
    scale_ptr,
    out_ptr,
    rstd_ptr,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    EPS: tl.constexpr,
):
    """One program per row: out = x / rms(x) * scale."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < DIM
    x = tl.load(x_ptr + row * DIM + columns, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    _normalize_row(row, x, columns, mask, scale_ptr, out_ptr, rstd_ptr, DIM, EPS)


@triton.jit
def _add_forward_kernel(
    x_ptr,
    residual_ptr,
    scale_ptr,
    total_ptr,
    out_ptr,
    rstd_ptr,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    EPS: tl.constexpr,
):
    """One program per row: total = x + residual (rounded to x's dtype), out = norm(total)."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < DIM
    offsets = row * DIM + columns
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    total = (x + residual).to(total_ptr.dtype.element_ty)
    tl.store(total_ptr + offsets, total, mask=mask)
    _normalize_row(row, total.to(tl.float32), columns, mask, scale_ptr, out_ptr, rstd_ptr, DIM, EPS)


@triton.jit
def _backward_kernel(
    x_ptr,
    rstd_ptr,
    scale_ptr,
    dout_ptr,
    dtotal_ptr,
    dx_ptr,
    partial_dscale_ptr,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    FUSED: tl.constexpr,
):
    """dx for ROWS_PER_PROGRAM consecutive rows and their sum of the scale gradient.

    With x_hat = x * rstd and g = dout * scale: dx = rstd * (g - x_hat * mean(g * x_hat)),
    dscale = sum over rows of dout * x_hat. FUSED: the sum x + residual was an output too, and
    its gradient dtotal adds into dx (dtotal_ptr is not read otherwise).
    """
    program = tl.program_id(0)
    columns = tl.arange(0, BLOCK)
    mask = columns < DIM
    scale = tl.load(scale_ptr + columns, mask=mask, other=0.0).to(tl.float32)
    dscale = tl.zeros((BLOCK,), dtype=tl.float32)
    first = program.to(tl.int64) * ROWS_PER_PROGRAM  # int64: so is the loop's row
    for row in range(first, tl.minimum(first + ROWS_PER_PROGRAM, ROWS)):
        offsets = row * DIM + columns
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(dout_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        g = dout * scale
        mean_gx = tl.sum(g * x_hat, axis=0) / DIM
        dx = rstd * (g - x_hat * mean_gx)
        if FUSED:
            dx += tl.load(dtotal_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dscale += dout * x_hat
    # Every column, padding included (zeros there): the row is written whole.
    tl.store(partial_dscale_ptr + program * BLOCK + columns, dscale)


# ---- calls --------------------------------------------------------------------------------------


def _call(*args, kernel, out_shape, grid: int, static: _Static, name: str, **constexprs):
    return jax_triton.triton_call(
        *args,
        kernel=kernel,
        out_shape=out_shape,
        grid=(grid,),
        num_warps=static.num_warps,
        zeroed_outputs=tuple(range(len(out_shape))) if static.zero_outputs else (),
        name=name,
        DIM=static.dim,
        BLOCK=static.padded_dim,
        **constexprs,
    )


def _forward(x, residual, scale, static: _Static):
    """(out, total or None, rstd [rows] float32) for x, residual: [rows, dim]."""
    num_rows = x.shape[0]
    like_x = jax.ShapeDtypeStruct(x.shape, x.dtype)
    per_row = jax.ShapeDtypeStruct((num_rows,), jnp.float32)
    if residual is None:
        out, rstd = _call(
            x,
            scale,
            kernel=_forward_kernel,
            out_shape=[like_x, per_row],
            grid=num_rows,
            static=static,
            name="msjax_triton_rms_norm_forward",
            EPS=static.eps,
        )
        return out, None, rstd
    total, out, rstd = _call(
        x,
        residual,
        scale,
        kernel=_add_forward_kernel,
        out_shape=[like_x, like_x, per_row],
        grid=num_rows,
        static=static,
        name="msjax_triton_add_rms_norm_forward",
        EPS=static.eps,
    )
    return out, total, rstd


def _backward(x, rstd, scale, dout, dtotal, static: _Static):
    """(dx, dscale); dtotal: the gradient of the fused sum output, or None."""
    num_rows = x.shape[0]
    programs = min(num_rows, MAX_BACKWARD_PROGRAMS)
    rows_per_program = triton.cdiv(num_rows, programs)
    programs = triton.cdiv(num_rows, rows_per_program)  # every program has at least one row
    fused = dtotal is not None
    dx, partial_dscale = _call(
        x,
        rstd,
        scale,
        dout,
        dtotal if fused else dout,  # a pointer the kernel does not read when not FUSED
        kernel=_backward_kernel,
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((programs, static.padded_dim), jnp.float32),
        ],
        grid=programs,
        static=static,
        name="msjax_triton_rms_norm_backward",
        ROWS=num_rows,
        ROWS_PER_PROGRAM=rows_per_program,
        FUSED=fused,
    )
    dscale = jnp.sum(partial_dscale[:, : static.dim], axis=0).astype(scale.dtype)
    return dx, dscale


_norm, _add_norm = norms_with_vjp(_forward, _backward)
