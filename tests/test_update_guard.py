"""The non-finite guard costs the step no pass over its state: one scalar predicate, fused in."""

from __future__ import annotations

import re

import jax

from msjax.config import load_config
from msjax.planner.aot import compile_step
from msjax.planner.candidates import MeshShape

ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]


def test_the_guard_checks_the_loss_and_the_gradient_norm_not_every_parameter():
    config = load_config(None, ["data.seq_len=64", "train.global_batch=2", *ONE_DEVICE])
    step = compile_step(config, MeshShape(1, 1, 1))
    is_finite_ops = len(re.findall(r"\bis-finite\(", step.compiled.as_text()))
    parameter_arrays = len(jax.tree.leaves(step.program.abstract_state().params))
    assert parameter_arrays > 5
    # the loss, the gradient norm, and at most one more inside the optimizer's clipping;
    # checking each new parameter took one per array
    assert 2 <= is_finite_ops <= 3, is_finite_ops
