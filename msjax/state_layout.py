"""The train state's layout: what it holds, its abstract arrays and their logical axes; no mesh,
nothing allocated. The shardings those axes give on a mesh, and the steps that read and write the
state, are `msjax.step`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import optax
from flax import nnx

from msjax.config import ModelConfig, OptimConfig
from msjax.models.transformer import Transformer
from msjax.optim import make_optimizer, stacked_over_layers, weight_decay_mask
from msjax.parallel.context import LogicalAxes
from msjax.parallel.rules import logical_axes_of

Batch = dict[str, jax.Array]  # msjax.batch.BATCH_FIELDS: [batch, seq] int32
Params = dict[str, Any]  # a pure nested dict of float32 arrays


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TrainState:
    """What one training step reads and writes."""

    step: jax.Array  # int32 scalar: the number of updates applied so far
    params: Params
    opt_state: optax.OptState


@dataclass(frozen=True)
class ArrayAxes:
    """The logical axis names of one optimizer-state array, as one pytree leaf.

    A bare tuple would be flattened, and optax's states are themselves tuples (NamedTuples).
    """

    names: LogicalAxes  # () for arrays kept whole on every device (counters)


@dataclass(frozen=True)
class StateLayout:
    """The train state of a config without its values: abstract arrays and their logical axes."""

    graphdef: nnx.GraphDef
    abstract_params: nnx.State  # nnx.Param variables holding jax.ShapeDtypeStruct
    param_axes: Any  # pure dict like the params: a tuple of logical axis names per parameter
    optimizer: optax.GradientTransformation
    opt_state_shapes: optax.OptState  # jax.ShapeDtypeStruct leaves
    opt_state_axes: optax.OptState  # the same tree with an ArrayAxes per array


def state_layout(model: ModelConfig, optim: OptimConfig, total_steps: int) -> StateLayout:
    """Parameter shapes and axes, the optimizer, and its state's shapes and axes; nothing allocated.

    Optimizer moments take the axes of the parameter they follow; everything else (step counters)
    is replicated. total_steps is `train.steps`, which the learning-rate schedule spans.
    """

    def create() -> Transformer:
        return Transformer(model, nnx.Rngs(params=0))  # shapes only: the seed makes no values

    with nnx.use_eager_sharding(False):
        abstract_model = nnx.eval_shape(create)
    graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
    param_axes = logical_axes_of(abstract_params)
    optimizer = make_optimizer(
        optim, total_steps, weight_decay_mask(param_axes), stacked_over_layers(param_axes)
    )
    opt_state_shapes = jax.eval_shape(optimizer.init, nnx.to_pure_dict(abstract_params))
    wrapped = jax.tree.map(ArrayAxes, param_axes, is_leaf=lambda leaf: isinstance(leaf, tuple))
    opt_state_axes = optax.tree_map_params(
        optimizer,
        lambda _, axes: axes,
        opt_state_shapes,
        wrapped,
        transform_non_params=lambda _: ArrayAxes(()),
        is_leaf=lambda leaf: isinstance(leaf, ArrayAxes),
    )
    return StateLayout(
        graphdef, abstract_params, param_axes, optimizer, opt_state_shapes, opt_state_axes
    )
