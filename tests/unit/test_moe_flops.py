"""FLOPs of a mixture of experts count the parameters a token runs (its top-k and shared experts
and the router), and the planner's figure holds against the compiled step."""

from __future__ import annotations

import jax
import pytest

from msjax.config import load_config
from msjax.flops import main as flops_main
from msjax.observe.flops import count_params, flops_per_step, flops_per_token
from msjax.planner.aot import compile_step
from msjax.planner.candidates import MeshShape, parse_mesh
from msjax.planner.compute import estimate_compute

TINY_MOE = "configs/tiny_moe.yaml"  # 4 layers, 1 dense; 8 experts of 96 (top-2), 1 shared


def test_active_params_are_the_top_k_and_shared_experts_and_the_router():
    model = load_config(TINY_MOE).model
    counts = count_params(model)
    embed, expert, dense_mlp = 128, 3 * 128 * 96, 3 * 128 * 384
    attention = 2 * 128 * 128 + 2 * 128 * 4 * 16  # q and o, k and v (4 kv heads of 16)
    router = embed * 8
    shared_part = 4 * attention + dense_mlp + 264 * 128  # + the unembedding
    assert counts.matmul == shared_part + 3 * (router + 9 * expert)  # 8 routed + 1 shared
    assert counts.active_matmul == shared_part + 3 * (router + 3 * expert)  # top-2 + 1 shared
    assert flops_per_token(model, 1) == pytest.approx(6 * counts.active_matmul + 12 * 4 * 8 * 16)


def test_a_dense_model_counts_every_matmul_param_as_active():
    counts = count_params(load_config().model)
    assert counts.active_matmul == counts.matmul


def test_the_flops_command_prints_the_active_params(capsys):
    assert flops_main(["--config", TINY_MOE]) == 0
    out = capsys.readouterr().out
    active = count_params(load_config(TINY_MOE).model).active_matmul
    assert f"{active / 1e3:.4g}K active matmul (per token)" in out
    assert "(6 x active matmul params + causal attention" in out


def test_planned_flops_match_the_compiled_moe_step_at_remat_none():
    """XLA's CPU ragged_dot runs each routed row against all experts (masked): the planner
    counts that beside the model's active FLOPs, and off CPU it does not."""
    config = load_config(
        TINY_MOE, ["train.global_batch=8", "model.remat=none", "model.moe.matmul_impl=xla"]
    )
    mesh = parse_mesh("2,2,1")
    planned = estimate_compute(config, mesh, jax.default_backend())
    step = compile_step(config, mesh)
    assert step.flops.total == pytest.approx(planned.device_flops, rel=0.10)
    assert planned.model_flops == pytest.approx(flops_per_step(step.config))
    grouped = estimate_compute(config, mesh, "gpu")  # a grouped matmul: active experts only
    expansion = 2 * 2 * 7 * 3 * 128 * 96 * 3 * 3  # k x (E - 1) x expert x MoE layers x (f + b)
    tokens_per_device = 8 * 128 / 4
    assert planned.layers_flops - grouped.layers_flops == pytest.approx(
        tokens_per_device * expansion, rel=0.02
    )


@pytest.mark.parametrize(
    ("mesh", "extra"),
    [(MeshShape(1, 1, 1), ()), (MeshShape(1, 1, 1, expert=2), ("model.moe.capacity_factor=0.5",))],
    ids=["one-device", "expert2-capacity"],
)
def test_planned_flops_match_the_compiled_step_with_the_blocked_grouped_matmul(mesh, extra):
    """The padded row blocks run the routed rows and their padding alone, on CPU as elsewhere:
    the planner counts the padding (and an expert mesh's exchange buffers) and nothing more."""
    overrides = ["train.global_batch=8", "model.remat=none", "model.moe.matmul_impl=blocks"]
    config = load_config(TINY_MOE, [*overrides, *extra])
    planned = estimate_compute(config, mesh, jax.default_backend())
    step = compile_step(config, mesh)
    assert step.flops.total == pytest.approx(planned.device_flops, rel=0.01)
    assert estimate_compute(config, mesh, "gpu").device_flops == planned.device_flops
    ragged = load_config(TINY_MOE, [*overrides[:2], "model.moe.matmul_impl=xla", *extra])
    assert planned.ratio < estimate_compute(ragged, mesh, "cpu").ratio
