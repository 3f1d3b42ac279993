"""Weights gathered in the compute dtype: half the all-gather bytes, gathers inside the layer
scan, float32 gradient reduction by default, and the same losses as gathering float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax import ops
from msjax.config import load_config
from msjax.parallel.rules import activation_placement, logical_axis_rules
from msjax.planner.aot import compile_step
from msjax.planner.candidates import MeshShape
from msjax.planner.communication import estimate_communication, ring_all_gather_bytes
from msjax.planner.sweep import synthetic_batch
from msjax.step import real_token_count, real_token_weights

SMALL = ["model.num_layers=2", "data.seq_len=32", "train.global_batch=8"]
# meshes with an fsdp axis: (data, fsdp, tensor), and fsdp inside two pipeline stages
GATHER_MESHES = [MeshShape(1, 8, 1), MeshShape(2, 2, 2), MeshShape(1, 4, 1, pipe=2)]


def _step(mesh: MeshShape, *overrides: str):
    pipeline = ["pipeline.microbatches=2"] if mesh.pipe > 1 else []
    return compile_step(load_config(None, [*SMALL, *pipeline, *overrides]), mesh)


@pytest.mark.parametrize("mesh", GATHER_MESHES, ids=str)
def test_bfloat16_compute_gathers_at_most_055_of_float32_bytes(mesh: MeshShape) -> None:
    wide = _step(mesh, "model.compute_dtype=float32").collectives
    narrow = _step(mesh, "model.compute_dtype=bfloat16").collectives
    assert wide["all-gather"].result_bytes > 0
    ratio = narrow["all-gather"].result_bytes / wide["all-gather"].result_bytes
    assert ratio <= 0.55, ratio
    if mesh.tensor > 1:
        return  # tensor parallelism's activation all-reduces rightly shrink with the compute
    # gradients still reduced in float32: the reduce-scatters do not shrink with the gathers
    # (a handful of small all-reduces may turn into reduce-scatters between the two programs)
    assert wide["reduce-scatter"].result_bytes > 0
    assert narrow["reduce-scatter"].result_bytes >= 0.8 * wide["reduce-scatter"].result_bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fsdp_gathers_run_inside_the_layer_loop(dtype: str) -> None:
    """Layer weights are gathered one layer at a time inside the scan, not all up front."""
    step = _step(MeshShape(1, 8, 1), f"model.compute_dtype={dtype}")
    gathers = step.collectives["all-gather"]
    layers = step.config.model.num_layers
    # 7 matrices and 2 norm scales per layer, gathered per trip; only the embedding tables and
    # the final norm are gathered outside the loop
    assert gathers.executions_in_loops >= 9 * layers
    assert gathers.executions - gathers.executions_in_loops <= 6
    hlo = step.compiled.as_text()
    stacked = f"[{layers},{step.config.model.embed_dim},"
    assert not any(" all-gather(" in line and stacked in line for line in hlo.splitlines())


def test_bfloat16_gather_matches_the_float32_gather_path() -> None:
    """The forward is the same numbers as gathering float32 then casting; 5 steps stay within
    bfloat16 rounding of training in float32."""
    mesh = MeshShape(2, 2, 2)
    narrow = _step(mesh, "model.compute_dtype=bfloat16")
    wide = _step(mesh, "model.compute_dtype=float32")
    program = narrow.program
    batch = jax.device_put(synthetic_batch(narrow.config), program.batch_sharding)

    def loss_gathering_float32(params, batch):  # XLA places the casts; no weight gather
        with activation_placement(program.mesh, logical_axis_rules(program.config)):
            model = program.model(params)
            features = model.features(batch["inputs"], batch["positions"], batch["segment_ids"])
            losses = ops.token_losses(features, model.unembedding_matrix(), batch["targets"])
        return jnp.sum(losses * real_token_weights(batch)) / real_token_count(batch)

    state = program.init_state()
    reference = float(jax.jit(loss_gathering_float32)(state.params, batch))
    assert float(jax.jit(program.loss)(state.params, batch)) == pytest.approx(reference, rel=1e-6)

    losses = {}
    for name, step in (("bfloat16", narrow), ("float32", wide)):
        state = step.program.init_state()
        losses[name] = []
        for _ in range(5):
            state, metrics = step.compiled(state, batch)
            losses[name].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=2e-2)
    assert losses["bfloat16"][-1] < losses["bfloat16"][0]  # it trains


def test_weights_in_a_plain_run_are_cast_where_used() -> None:
    """With no mesh installed, compute_weight is a plain cast (models stay mesh-free)."""
    from msjax.parallel.context import compute_weight

    weight = jax.numpy.ones((4, 2))
    cast = compute_weight(weight, ("embed", "mlp"), jax.numpy.bfloat16)
    assert cast.dtype == jax.numpy.bfloat16
    with pytest.raises(ValueError, match="2 logical axes"):
        compute_weight(jax.numpy.ones((4,)), ("embed", "mlp"), jax.numpy.bfloat16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mesh", [MeshShape(1, 8, 1), MeshShape(1, 4, 1, pipe=2)], ids=str)
def test_planned_fsdp_gather_bytes_within_10_percent_of_the_compiled_step(
    dtype: str, mesh: MeshShape
) -> None:
    """msjax.plan's weight all-gathers against the compiled program's, as ring bytes sent (on a
    pipe mesh a stage's weights are gathered for every pipeline iteration)."""
    step = _step(mesh, f"model.compute_dtype={dtype}")
    compiled = ring_all_gather_bytes(step.collectives["all-gather"].result_bytes, mesh.fsdp)
    planned = estimate_communication(step.config, mesh).fsdp_gather_bytes
    assert planned == pytest.approx(compiled, rel=0.10)
