"""What the compiled train step does beyond the model's own work: the layer loop (scanned or
unrolled, the same values) and the non-finite guard (one scalar predicate, no pass over the
parameters)."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from msjax.config import load_config
from msjax.data.dataset import build_training_data
from msjax.parallel.mesh import build_mesh
from msjax.planner.aot import compile_step
from msjax.planner.candidates import parse_mesh
from msjax.resolve import resolve, resolve_layer_loop
from msjax.step import build_program
from tests.small_runs import QUICK_RUN

ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]


def _trained(layer_loop: str, steps: int = 2):
    """The losses and parameters after `steps` steps of a quick run on one device."""
    config = load_config(None, [*QUICK_RUN, *ONE_DEVICE, f"model.layer_loop={layer_loop}"])
    config = resolve(config, 1, jax.default_backend())
    program = build_program(config, build_mesh(config.mesh, jax.devices()[:1]))
    data = build_training_data(config, lambda line: None).train
    state, losses = program.init_state(), []
    for step in range(steps):
        batch = jax.device_put(data.global_batch_at(step), program.batch_sharding)
        state, metrics = program.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return config, losses, jax.device_get(state.params)


def test_auto_unrolls_the_layers_on_cpu_without_a_pipeline_or_remat_and_scans_elsewhere():
    assert resolve_layer_loop("auto", "cpu", pipe=1, remat="none") == "unroll"
    assert resolve_layer_loop("auto", "cpu", pipe=2, remat="none") == "scan"
    assert resolve_layer_loop("auto", "cpu", pipe=1, remat="attention") == "scan"
    assert resolve_layer_loop("auto", "gpu", pipe=1, remat="none") == "scan"
    assert resolve_layer_loop("auto", "tpu", pipe=1, remat="none") == "scan"
    assert resolve_layer_loop("scan", "cpu", pipe=1, remat="none") == "scan"  # a choice is kept
    assert resolve_layer_loop("unroll", "gpu", pipe=4, remat="full") == "unroll"
    config = load_config(None, [*QUICK_RUN, "mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1"])
    assert resolve(config, 2, "cpu").model.layer_loop == "unroll"  # the saved config says so
    assert resolve(config, 2, "gpu").model.layer_loop == "scan"


def test_unrolled_layers_train_as_the_scanned_loop_does():
    scanned_config, scanned_losses, scanned = _trained("scan")
    unrolled_config, unrolled_losses, unrolled = _trained("unroll")
    assert (scanned_config.model.layer_loop, unrolled_config.model.layer_loop) == (
        "scan",
        "unroll",
    )
    np.testing.assert_allclose(unrolled_losses, scanned_losses, rtol=1e-6)
    for old, new in zip(jax.tree.leaves(scanned), jax.tree.leaves(unrolled), strict=True):
        np.testing.assert_allclose(new, old, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
def test_the_layer_loop_compiles_as_chosen(layer_loop):
    """Scanned layers are a while loop in the compiled step; unrolled ones leave none."""
    config = load_config(None, [*QUICK_RUN, f"model.layer_loop={layer_loop}"])
    text = compile_step(config, parse_mesh("1,1,1")).compiled.as_text()
    loops = len(re.findall(r"\bwhile\(", text))
    assert (loops > 0) == (layer_loop == "scan"), loops


def test_the_non_finite_guard_makes_no_pass_over_the_parameters():
    """The guard's predicate is the loss's and the gradient norm's finiteness: no `is-finite` in
    the compiled step runs over an array shaped as a parameter (one per parameter before)."""
    config = load_config(None, [*QUICK_RUN, "model.vocab_size=200"])
    step = compile_step(config, parse_mesh("1,1,1"))
    param_shapes = {
        tuple(leaf.shape)
        for leaf in jax.tree.leaves(step.program.abstract_params)
        if len(leaf.shape) > 0
    }
    checked = [
        tuple(int(size) for size in match.split(",") if size)
        for match in re.findall(r"= pred\[([\d,]*)\]\S* is-finite\(", step.compiled.as_text())
    ]
    assert checked, "the loss's own check is there"
    assert not param_shapes & set(checked), sorted(param_shapes & set(checked))


@pytest.mark.parametrize("remat", ["full", "attention"])
def test_unrolled_layers_recompute_what_remat_asks_for(remat):
    """Unrolled, a remat policy's recomputation is kept apart from the forward (XLA would merge
    the two, and the step would execute the FLOPs of remat=none): the unrolled step runs the
    scanned step's dot FLOPs."""
    flops = {}
    for loop in ("scan", "unroll"):
        config = load_config(None, [*QUICK_RUN, f"model.remat={remat}", f"model.layer_loop={loop}"])
        flops[loop] = compile_step(config, parse_mesh("1,1,1")).flops.total
    none = load_config(None, [*QUICK_RUN, "model.remat=none", "model.layer_loop=unroll"])
    assert flops["unroll"] == pytest.approx(flops["scan"], rel=1e-3)
    assert flops["unroll"] > 1.005 * compile_step(none, parse_mesh("1,1,1")).flops.total
