"""A run's parameters from one of its checkpoints, without its optimizer state, on any mesh.

What the tools around training read (export, generation): the checkpoint's own config says the
model; the arrays land on one device or on the shardings of a mesh the caller built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msjax.checkpoint.commits import committed_steps, parse_resume_source
from msjax.checkpoint.manager import Checkpointer
from msjax.config import CheckpointConfig, Config, config_from_dict
from msjax.errors import MsjaxError


@dataclass(frozen=True)
class RunParams:
    config: Config  # the config the checkpoint was saved with
    params: dict[str, Any]
    step: int
    path: Path


def checkpoint_source(source: str, step: int | None = None) -> tuple[Checkpointer, int]:
    """The checkpoints of `RUN_DIR`, `RUN_DIR/checkpoints` or `.../STEP`, and the step to read
    (the given one, else the newest finalized)."""
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes on read-only managers
    directory, named_step = parse_resume_source(source)
    steps = committed_steps(directory)
    chosen = step if step is not None else named_step
    if chosen is None:
        if not steps:
            raise MsjaxError(f"{source}: no finalized checkpoint in {directory}")
        chosen = steps[-1]
    elif chosen not in steps:
        raise MsjaxError(
            f"{source}: no finalized checkpoint of step {chosen} in {directory} "
            f"(steps: {', '.join(map(str, steps)) or 'none'})"
        )
    return Checkpointer(directory, CheckpointConfig(), read_only=True), chosen


def saved_config(checkpointer: Checkpointer, step: int) -> Config:
    return config_from_dict(checkpointer.metadata(step)["config"])


def load_run_params(
    checkpointer: Checkpointer, step: int, config: Config, mesh: Any | None = None
) -> RunParams:
    """The parameters of `step`: on the first local device, or sharded over `mesh` by the
    config's rules."""
    import jax
    from flax import nnx

    from msjax.parallel.rules import logical_axis_rules, shardings_for
    from msjax.state_layout import state_layout

    layout = state_layout(config.model, config.optim, config.train.steps)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(
            lambda _: device, layout.param_axes, is_leaf=lambda leaf: isinstance(leaf, tuple)
        )
    else:
        shardings = shardings_for(layout.param_axes, mesh, logical_axis_rules(config))
    shapes = nnx.to_pure_dict(layout.abstract_params)
    abstract = jax.tree.map(
        lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding),
        shapes,
        shardings,
    )
    params = checkpointer.restore_params(step, abstract)
    return RunParams(config, params, step, checkpointer.directory / str(step))
