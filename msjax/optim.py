"""The optimizer: learning-rate schedule, weight-decay mask, clipping and AdamW or LAMB (optax).

Gradients and sharding are not here; this file only turns an `OptimConfig` into optax objects.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from msjax.config import OptimConfig
from msjax.errors import ConfigError


def learning_rate_schedule(optim: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then cosine, linear or no decay until total_steps.

    The schedule is called with the optimizer's update count, which optax starts at 0, so the
    first update uses lr 0 when warmup_steps > 0 and the peak is reached at step warmup_steps.
    Cosine and linear decay reach `learning_rate * final_lr_fraction` at step total_steps and
    stay there. With warmup_steps=0 step 0 is already at the peak; with warmup_steps >=
    total_steps the run ends inside the warmup.
    """
    if total_steps < 1:
        raise ConfigError(f"total_steps={total_steps} (train.steps) must be positive")
    if optim.schedule not in ("cosine", "linear", "constant"):
        raise ConfigError(
            f"optim.schedule={optim.schedule!r} is not accepted; choose one of "
            "cosine, linear, constant"
        )
    if optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={optim.warmup_steps} must be >= 0")
    peak = optim.learning_rate
    final = optim.learning_rate * optim.final_lr_fraction
    warmup_steps = optim.warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)  # >= 1: no division by zero in any case
    kind = optim.schedule

    def schedule(step: jax.typing.ArrayLike) -> jax.Array:
        step = jnp.asarray(step, jnp.float32)
        warmup = peak * step / max(warmup_steps, 1)  # unused when warmup_steps == 0
        progress = jnp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
        if kind == "cosine":
            after = final + (peak - final) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        elif kind == "linear":
            after = peak + (final - peak) * progress
        else:
            after = jnp.full_like(step, peak)
        return jnp.where(step < warmup_steps, warmup, after)

    return schedule


def _is_logical_axes(node: Any) -> bool:
    """A plain tuple of axis names (str or None), one entry per array dimension; or None."""
    if node is None:
        return True  # caught as a leaf so weight_decay_mask can name it instead of skipping it
    return isinstance(node, tuple) and all(a is None or isinstance(a, str) for a in node)


def weight_decay_mask(logical_axes: Any) -> Any:
    """True for each parameter with at least two axes besides "layers" (matrices, embeddings).

    `logical_axes` is shaped like the params; each leaf is a plain tuple with one entry per
    array dimension, a logical axis name or None (an unnamed axis still counts as an axis):
    ("layers", "embed", "mlp") decays, ("layers", "embed") (a stacked RMSNorm scale) and
    ("embed",) do not, () (a scalar) does not. Because tuples are pytree nodes in JAX, a leaf is
    recognised as a tuple whose entries are all str or None. A `PartitionSpec` is not accepted,
    since it may leave out trailing dimensions; pass `tuple(spec)` only when it is full length.
    Returns the same tree with a bool at each leaf, as optax's `mask=` takes it.
    """

    def decays(path: Any, axes: Any) -> bool:
        if axes is None or not isinstance(axes, tuple):
            where = jax.tree_util.keystr(path) or "<root>"
            raise TypeError(
                f"parameter {where} has logical axes {axes!r}; expected a tuple of axis names "
                "(str or None), one per dimension"
            )
        return sum(1 for axis in axes if axis != "layers") >= 2

    return jax.tree_util.tree_map_with_path(decays, logical_axes, is_leaf=_is_logical_axes)


def stacked_over_layers(logical_axes: Any) -> Any:
    """True for each parameter whose leading axis is "layers" (one slice per transformer layer)."""
    return jax.tree.map(
        lambda axes: bool(axes) and axes[0] == "layers", logical_axes, is_leaf=_is_logical_axes
    )


def make_optimizer(
    optim: OptimConfig, total_steps: int, decay_mask: Any, stacked_layers: Any = None
) -> optax.GradientTransformation:
    """Global-norm clipping (unless grad_clip_norm is None), then AdamW or LAMB on the schedule.

    Weight decay is decoupled and scaled by the learning rate (optax's convention, as PyTorch),
    and applied only where `decay_mask` (a bool tree shaped like the params, as from
    `weight_decay_mask`, or a function of the params returning one) is True. The optimizer
    state takes the params' dtype, so `init` insists on float32 params (the master copy).
    LAMB's trust ratio is per layer, as in the paper: per parameter array, and per slice of an
    array stacked over "layers" where `stacked_layers` (a bool tree shaped like the params, as
    from `stacked_over_layers`) says so.
    """
    schedule = learning_rate_schedule(optim, total_steps)
    if optim.name == "adamw":
        update_rule = optax.adamw(
            schedule,
            b1=optim.b1,
            b2=optim.b2,
            eps=optim.eps,
            mu_dtype=jnp.float32,
            weight_decay=optim.weight_decay,
            mask=decay_mask,
        )
    elif optim.name == "lamb":
        # You et al. 2020, Alg. 2: Adam direction plus weight decay, scaled by ||w|| / ||r + wd w||
        # (optax.lamb's chain, with the trust ratio taken per layer of a stacked parameter).
        update_rule = optax.chain(
            optax.scale_by_adam(b1=optim.b1, b2=optim.b2, eps=optim.eps),
            optax.add_decayed_weights(optim.weight_decay, mask=decay_mask),
            scale_by_layerwise_trust_ratio(stacked_layers),
            optax.scale_by_learning_rate(schedule),
        )
    else:
        raise ConfigError(f"optim.name={optim.name!r} is not accepted; choose one of adamw, lamb")
    if optim.grad_clip_norm is not None:
        update_rule = optax.chain(optax.clip_by_global_norm(optim.grad_clip_norm), update_rule)
    return _float32_params_only(update_rule)


def scale_by_layerwise_trust_ratio(stacked_layers: Any = None) -> optax.GradientTransformation:
    """Scale each update by ||param|| / ||update|| (1 if either is 0), per layer.

    stacked_layers: None (one ratio per array) or a bool tree shaped like the params; where True
    the leading axis indexes layers and each layer's slice gets its own ratio.
    """

    def scale(update: jax.Array, param: jax.Array, stacked: bool) -> jax.Array:
        axes = tuple(range(1, param.ndim)) if stacked and param.ndim > 1 else None
        param_norm = jnp.sqrt(jnp.sum(jnp.square(param), axis=axes, keepdims=True))
        update_norm = jnp.sqrt(jnp.sum(jnp.square(update), axis=axes, keepdims=True))
        either_zero = (param_norm == 0) | (update_norm == 0)
        ratio = jnp.where(either_zero, 1.0, param_norm / jnp.where(either_zero, 1.0, update_norm))
        return update * ratio.astype(update.dtype)

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if params is None:
            raise ValueError("the layer-wise trust ratio needs the params")
        stacked = stacked_layers
        if stacked is None:
            stacked = jax.tree.map(lambda _: False, params)
        return jax.tree.map(scale, updates, params, stacked), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def advance_schedule(opt_state: Any) -> Any:
    """opt_state with the learning-rate schedule one step further and nothing else changed.

    For a skipped step: the schedule follows the step counter, while the moments and Adam's
    bias-correction count stay as they were (no gradient was taken in).
    """

    def advance(node: Any) -> Any:
        if isinstance(node, optax.ScaleByScheduleState):
            return node._replace(count=node.count + 1)
        return node

    return jax.tree.map(
        advance, opt_state, is_leaf=lambda node: isinstance(node, optax.ScaleByScheduleState)
    )


def _float32_params_only(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` whose init raises TypeError unless every floating-point param is float32."""

    def init(params: Any) -> Any:
        for path, param in jax.tree_util.tree_leaves_with_path(params):
            dtype = jnp.result_type(param)
            if jnp.issubdtype(dtype, jnp.floating) and dtype != jnp.float32:
                raise TypeError(
                    f"parameter {jax.tree_util.keystr(path)} is {dtype}; the optimizer needs "
                    "float32 master params so that its state is float32"
                )
        return inner.init(params)

    return optax.GradientTransformationExtraArgs(init, inner.update)
