"""Fused RMSNorm in Pallas (Triton backend), optionally fused with the residual add before it.

`reference` and `reference_add` are the plain-JAX versions, same signatures.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# One read of x (and the residual), one write of the output (and the sum); the backward reads x,
# the upstream gradient and a per-row 1/rms saved by the forward, and sums the scale gradient
# over row blocks.


def reference(x: jax.Array, scale: jax.Array, *, eps: float = 1e-5) -> jax.Array:
    """x / rms(x) * scale over the last axis, in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale).astype(x.dtype)


def reference_add(
    x: jax.Array, residual: jax.Array, scale: jax.Array, *, eps: float = 1e-5
) -> tuple[jax.Array, jax.Array]:
    """(x + residual, rms_norm(x + residual)); the sum is rounded to x's dtype first."""
    total = x + residual.astype(x.dtype)
    return total, reference(total, scale, eps=eps)


@dataclass(frozen=True)
class _Static:
    eps: float
    dim: int
    block_rows: int
    blocks_per_program: int  # backward: row blocks one program walks, summing the scale grad
    num_warps: int
    interpret: bool


def rms_norm(
    x: jax.Array,
    scale: jax.Array,
    *,
    eps: float = 1e-5,
    block_rows: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """The kernel form of `reference`: x [..., dim], scale [dim]."""
    return _norm(x, scale, _static(x, scale, eps, block_rows, interpret))


def add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    scale: jax.Array,
    *,
    eps: float = 1e-5,
    block_rows: int | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The kernel form of `reference_add`: one pass over x and residual gives both outputs."""
    return _add_norm(x, residual, scale, _static(x, scale, eps, block_rows, interpret))


def _static(x, scale, eps, block_rows, interpret) -> _Static:
    dim = x.shape[-1]
    if scale.shape != (dim,):
        raise ValueError(f"scale {scale.shape} must be [{dim}] for x {x.shape}")
    padded_dim = pl.next_power_of_2(dim)
    rows = max(1, x.size // dim)
    if block_rows is None:
        # About 4096 elements a program (Triton's layer-norm tutorial keeps a row in registers).
        block_rows = max(1, min(4096 // padded_dim, pl.next_power_of_2(rows)))
    # The backward walks several row blocks per program so the per-program partial scale
    # gradients ([programs, dim] float32) stay small next to x.
    blocks = -(-rows // block_rows)
    blocks_per_program = max(1, min(16, blocks // 512))
    elements = block_rows * padded_dim
    return _Static(
        eps=float(eps),
        dim=dim,
        block_rows=block_rows,
        blocks_per_program=blocks_per_program,
        num_warps=min(max(elements // 512, 1), 8),
        interpret=jax.default_backend() != "gpu" if interpret is None else bool(interpret),
    )


def _masks(row_block, static: _Static, num_rows: int):
    rows = row_block * static.block_rows + jnp.arange(static.block_rows)
    columns = jnp.arange(pl.next_power_of_2(static.dim))
    row_ok = rows < num_rows
    column_ok = columns < static.dim
    return row_ok, column_ok, row_ok[:, None] & column_ok[None, :]


def _rows_spec(static: _Static) -> pl.BlockSpec:
    return pl.BlockSpec((static.block_rows, pl.next_power_of_2(static.dim)), lambda i: (i, 0))


def _params(static: _Static) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=static.num_warps, num_stages=1)


# ---- forward ----------------------------------------------------------------------------------


def _forward_kernel(x_ref, residual_ref, scale_ref, out_ref, total_ref, rstd_ref, *, static, rows):
    row_ok, column_ok, mask = _masks(pl.program_id(0), static, rows)
    x = plgpu.load(x_ref, mask=mask, other=0.0)  # [block_rows, padded_dim]
    if residual_ref is not None:
        x = x + plgpu.load(residual_ref, mask=mask, other=0.0)
        plgpu.store(total_ref, x, mask=mask)
    x32 = x.astype(jnp.float32)
    rstd = lax.rsqrt(jnp.sum(x32 * x32, axis=1) / static.dim + static.eps)  # [block_rows]
    scale = plgpu.load(scale_ref, mask=column_ok, other=0.0).astype(jnp.float32)
    out = x32 * rstd[:, None] * scale[None, :]
    plgpu.store(out_ref, out.astype(out_ref.dtype), mask=mask)
    plgpu.store(rstd_ref, rstd, mask=row_ok)


def _forward(x, residual, scale, static: _Static):
    """(out, total or None, rstd [rows] float32) for x, residual: [rows, dim]."""
    num_rows, dim = x.shape
    padded_dim = pl.next_power_of_2(dim)
    fused = residual is not None

    def kernel(x_ref, residual_ref, scale_ref, out_ref, *rest):
        total_ref, rstd_ref = rest if fused else (None, *rest)
        _forward_kernel(
            x_ref,
            residual_ref,
            scale_ref,
            out_ref,
            total_ref,
            rstd_ref,
            static=static,
            rows=num_rows,
        )

    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    out_specs = [_rows_spec(static)]
    if fused:
        out_shape.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
        out_specs.append(_rows_spec(static))
    out_shape.append(jax.ShapeDtypeStruct((num_rows,), jnp.float32))
    out_specs.append(pl.BlockSpec((static.block_rows,), lambda i: (i,)))
    outs = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_rows, static.block_rows),),
        in_specs=[
            _rows_spec(static),
            _rows_spec(static) if fused else None,
            pl.BlockSpec((padded_dim,), lambda i: (0,)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(static),
        interpret=static.interpret,
        name="rms_norm_forward",
    )(x, residual, scale)
    if fused:
        return outs[0], outs[1], outs[2]
    return outs[0], None, outs[1]


# ---- backward ---------------------------------------------------------------------------------


def _backward_kernel(
    x_ref, rstd_ref, scale_ref, dout_ref, dtotal_ref, dx_ref, dscale_ref, *, static, rows
):
    """dx for `blocks_per_program` row blocks and their partial sum of the scale gradient.

    With x_hat = x * rstd and g = dout * scale: dx = rstd * (g - x_hat * mean(g * x_hat)),
    dscale = sum over rows of dout * x_hat.
    """
    block_rows, padded_dim = static.block_rows, pl.next_power_of_2(static.dim)
    column_ok = jnp.arange(padded_dim) < static.dim
    scale = plgpu.load(scale_ref, mask=column_ok, other=0.0).astype(jnp.float32)
    # program_id is read outside the loop: the Pallas interpreter cannot see it inside one.
    first_block = pl.program_id(0) * static.blocks_per_program

    def body(step, dscale):
        row_block = first_block + step
        row_ok, _, mask = _masks(row_block, static, rows)
        window = pl.ds(row_block * block_rows, block_rows)
        x = plgpu.load(x_ref.at[window, :], mask=mask, other=0.0).astype(jnp.float32)
        dout = plgpu.load(dout_ref.at[window, :], mask=mask, other=0.0).astype(jnp.float32)
        rstd = plgpu.load(rstd_ref.at[window], mask=row_ok, other=0.0)
        x_hat = x * rstd[:, None]
        g = dout * scale[None, :]
        mean_gx = jnp.sum(g * x_hat, axis=1) / static.dim
        dx = rstd[:, None] * (g - x_hat * mean_gx[:, None])
        if dtotal_ref is not None:  # the sum was an output too: its gradient flows into x
            dx = dx + plgpu.load(dtotal_ref.at[window, :], mask=mask, other=0.0).astype(jnp.float32)
        plgpu.store(dx_ref.at[window, :], dx.astype(dx_ref.dtype), mask=mask)
        return dscale + jnp.sum(dout * x_hat, axis=0)

    dscale = lax.fori_loop(
        0, static.blocks_per_program, body, jnp.zeros((padded_dim,), jnp.float32)
    )
    dscale_ref[...] = dscale


def _backward_call(x, rstd, scale, dout, dtotal, static: _Static):
    num_rows, dim = x.shape
    padded_dim = pl.next_power_of_2(dim)
    rows_per_program = static.block_rows * static.blocks_per_program
    programs = pl.cdiv(num_rows, rows_per_program)
    # Whole arrays per program (the kernel walks its own row blocks): pointers, not copies,
    # on Triton; rounded up to whole programs so every program's row blocks exist.
    padded_rows = programs * rows_per_program
    whole = pl.BlockSpec((padded_rows, padded_dim), lambda i: (0, 0))
    fused = dtotal is not None
    dx, partial_dscale = pl.pallas_call(
        functools.partial(_backward_kernel, static=static, rows=num_rows),
        grid=(programs,),
        in_specs=[
            whole,
            pl.BlockSpec((padded_rows,), lambda i: (0,)),
            pl.BlockSpec((padded_dim,), lambda i: (0,)),
            whole,
            whole if fused else None,
        ],
        out_specs=[whole, pl.BlockSpec((None, padded_dim), lambda i: (i, 0))],
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((programs, padded_dim), jnp.float32),
        ],
        compiler_params=_params(static),
        interpret=static.interpret,
        name="rms_norm_backward",
    )(x, rstd, scale, dout, dtotal)
    dscale = jnp.sum(partial_dscale[:, :dim], axis=0).astype(scale.dtype)
    return dx, dscale


def norms_with_vjp(forward, backward):
    """(norm, add_norm) with custom VJPs, from a forward and a backward kernel call.

    forward(x, residual | None, scale, static) -> (out, total, rstd) normalises x (+ residual);
    backward(x, rstd, scale, dout, dtotal | None, static) -> (dx, dscale), where x is what was
    normalised (the sum, when fused) and dtotal the sum's own cotangent; both see [rows, dim].
    The pair returned takes x [..., dim]: norm(x, scale, static) -> out and
    add_norm(x, residual, scale, static) -> (total, out).
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
    def norm_rows(x, scale, static):
        return forward(x, None, scale, static)[0]

    def norm_forward(x, scale, static):
        out, _, rstd = forward(x, None, scale, static)
        return out, (x, rstd, scale)

    def norm_backward(static, residuals, dout):
        x, rstd, scale = residuals
        return backward(x, rstd, scale, dout, None, static)

    norm_rows.defvjp(norm_forward, norm_backward)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def add_norm_rows(x, residual, scale, static):
        out, total, _ = forward(x, residual, scale, static)
        return total, out

    def add_norm_forward(x, residual, scale, static):
        out, total, rstd = forward(x, residual, scale, static)
        return (total, out), (total, rstd, scale)

    def add_norm_backward(static, residuals, cotangents):
        total, rstd, scale = residuals
        dtotal, dout = cotangents
        dx, dscale = backward(total, rstd, scale, dout, dtotal, static)
        return dx, dx, dscale

    add_norm_rows.defvjp(add_norm_forward, add_norm_backward)

    def norm(x, scale, static):
        return norm_rows(x.reshape(-1, x.shape[-1]), scale, static).reshape(x.shape)

    def add_norm(x, residual, scale, static):
        if residual.shape != x.shape:
            raise ValueError(f"residual {residual.shape} must have the shape of x {x.shape}")
        dim = x.shape[-1]
        total, normed = add_norm_rows(
            x.reshape(-1, dim), residual.astype(x.dtype).reshape(-1, dim), scale, static
        )
        return total.reshape(x.shape), normed.reshape(x.shape)

    return norm, add_norm


_norm, _add_norm = norms_with_vjp(_forward, _backward_call)
