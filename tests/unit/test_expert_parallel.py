"""Expert parallelism (`mesh.expert`): the MoE layer's output and gradients, and a short training
run, on expert-parallel meshes equal the single-device run; the exchange's buffers by hand."""

from __future__ import annotations

import functools
import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from mesh_runs import fixed_batches

from msjax.checkpoint.manager import Checkpointer
from msjax.config import Config, load_config
from msjax.models.moe import MoeMLP
from msjax.observe.metrics import read_metrics
from msjax.parallel.experts import buffer_rows
from msjax.parallel.mesh import build_mesh
from msjax.parallel.rules import activation_placement, logical_axis_rules, logical_to_spec
from msjax.resolve import resolve
from msjax.step import build_program
from msjax.train import train

LAYER = [
    "model.embed_dim=16",
    "model.mlp_dim=8",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.moe.num_experts=8",
    "model.moe.shared_experts=1",
    "model.init_std=0.5",  # outputs of order 1, so that 1e-5 means something
    "train.global_batch=8",
]
# (data, fsdp, expert, tensor): expert-parallel meshes of up to 8 simulated devices
EXPERT_MESHES = [(1, 1, 2, 1), (2, 1, 4, 1), (1, 1, 8, 1), (1, 2, 2, 2)]


def layer_config(data: int, fsdp: int, expert: int, tensor: int, *overrides: str) -> Config:
    mesh = [f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.expert={expert}"]
    config = load_config(None, [*LAYER, *mesh, f"mesh.tensor={tensor}", *overrides])
    return resolve(config, data * fsdp * expert * tensor, jax.default_backend())


@functools.cache
def layer_output_and_gradients(mesh_sizes: tuple[int, int, int, int], *overrides: str):
    """The MoE layer's output, dropped share, the gradients of a fixed projection of its output
    averaged over tokens (in its parameters and its input), and whether the compiled program
    exchanges tokens by all-to-all, on a mesh of (data, fsdp, expert, tensor) sizes."""
    config = layer_config(*mesh_sizes, *overrides)
    mesh = build_mesh(config.mesh, jax.devices()[: math.prod(mesh_sizes)])
    rules = logical_axis_rules(config)
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(MoeMLP(config.model, nnx.Rngs(0)))
    place = lambda spec: NamedSharding(mesh, logical_to_spec(tuple(spec), rules))  # noqa: E731
    shardings = jax.tree.map(place, nnx.get_partition_spec(params))
    x = jax.random.normal(jax.random.key(1), (8, 6, 16))  # [batch, seq, embed]
    cotangent = jax.random.normal(jax.random.key(2), x.shape)

    def objective(params, x):
        with activation_placement(mesh, rules):
            out, stats = nnx.merge(graphdef, params)(x)
        # a loss-like scale: summed over embed, averaged over the 48 tokens
        return jnp.sum(out * cotangent) / (x.shape[0] * x.shape[1]), (out, stats.dropped_share)

    batch_sharding = NamedSharding(mesh, logical_to_spec(("batch", "seq", "act_embed"), rules))
    args = (jax.device_put(params, shardings), jax.device_put(x, batch_sharding))
    step = jax.jit(jax.grad(objective, argnums=(0, 1), has_aux=True)).lower(*args).compile()
    (param_grads, x_grad), (out, dropped) = step(*args)
    grads = {"/".join(map(str, path)): np.asarray(leaf) for path, leaf in _leaves(param_grads)}
    exchanged = "all-to-all" in step.as_text()  # tokens went to their experts' devices
    return np.asarray(out), float(dropped), {**grads, "x": np.asarray(x_grad)}, exchanged


def _leaves(state):
    return jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]


def max_differences(mesh_sizes, *overrides: str) -> tuple[float, float, float]:
    """(output, gradients) max abs differences from one device, and the dropped share."""
    out, dropped, grads, exchanged = layer_output_and_gradients(mesh_sizes, *overrides)
    single = layer_output_and_gradients((1, 1, 1, 1), *overrides)
    single_out, single_dropped, single_grads, single_exchanged = single
    assert exchanged and not single_exchanged
    assert dropped == pytest.approx(single_dropped, abs=1e-7)
    assert grads.keys() == single_grads.keys()
    grad_diff = max(float(np.abs(grads[k] - single_grads[k]).max()) for k in grads)
    assert min(float(np.abs(g).max()) for g in single_grads.values()) > 0.0  # all reached
    return float(np.abs(out - single_out).max()), grad_diff, dropped


@pytest.mark.parametrize("mesh_sizes", EXPERT_MESHES, ids=lambda m: "d{}-f{}-e{}-t{}".format(*m))
def test_dropless_moe_layer_on_an_expert_mesh_equals_one_device(mesh_sizes) -> None:
    out_diff, grad_diff, dropped = max_differences(mesh_sizes)
    print(f"expert mesh {mesh_sizes}: output {out_diff:.2e}, gradients {grad_diff:.2e}")
    assert dropped == 0.0
    assert out_diff < 1e-5 and grad_diff < 1e-5


def test_capacity_capped_moe_layer_on_an_expert_mesh_drops_the_same_choices() -> None:
    """A capacity factor drops the same choices (decided over the whole batch), and the
    exchange's capacity-sized buffers still carry every kept one."""
    out_diff, grad_diff, dropped = max_differences((1, 1, 4, 1), "model.moe.capacity_factor=0.5")
    print(f"expert 4, capacity 0.5: output {out_diff:.2e}, gradients {grad_diff:.2e}")
    assert 0.3 < dropped < 0.7  # about half the choices past their expert's capacity
    assert out_diff < 1e-5 and grad_diff < 1e-5


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
@pytest.mark.parametrize("impl", ["blocks", "xla"])
def test_each_grouped_matmul_runs_the_local_experts_of_an_expert_mesh(impl, capacity_factor):
    """Each grouped matmul (blocks, the CPU default, and ragged_dot) on data 1 x expert 2 equals
    ragged_dot on one device."""
    overrides = (f"model.moe.capacity_factor={capacity_factor}",)
    chosen = (f"model.moe.matmul_impl={impl}", *overrides)
    out, dropped, grads, exchanged = layer_output_and_gradients((1, 1, 2, 1), *chosen)
    single_out, single_dropped, single_grads, _ = layer_output_and_gradients(
        (1, 1, 1, 1), "model.moe.matmul_impl=xla", *overrides
    )
    assert exchanged
    assert dropped == pytest.approx(single_dropped, abs=1e-7)
    assert (dropped > 0.0) == (capacity_factor > 0.0)
    np.testing.assert_allclose(out, single_out, atol=1e-5)
    assert grads.keys() == single_grads.keys()
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, single_grads[name], atol=1e-5, err_msg=name)


def test_exchange_buffers_hold_the_worst_case_or_the_destinations_capacity() -> None:
    assert buffer_rows(local_choices=12, experts_here=2, capacity=None) == 12  # all to one
    assert buffer_rows(local_choices=12, experts_here=2, capacity=4) == 8  # 2 experts x 4
    assert buffer_rows(local_choices=6, experts_here=2, capacity=4) == 6  # never past all


def moe_run_config(data: int, fsdp: int, expert: int, tensor: int) -> Config:
    """configs/tiny_moe.yaml (1 dense and 3 MoE layers of 8 experts, top-2, 1 shared), small."""
    overrides = [
        f"mesh.data={data}",
        f"mesh.fsdp={fsdp}",
        f"mesh.expert={expert}",
        f"mesh.tensor={tensor}",
        "model.embed_dim=64",
        "model.mlp_dim=128",
        "model.moe.expert_mlp_dim=32",
        "data.seq_len=16",
        "train.global_batch=8",
        "optim.learning_rate=1e-2",
        "optim.warmup_steps=2",
    ]
    config = load_config("configs/tiny_moe.yaml", overrides)
    return resolve(config, data * fsdp * expert * tensor, jax.default_backend())


@functools.cache
def moe_loss_trace(data: int, fsdp: int, expert: int, tensor: int, steps: int = 6):
    """Losses of `steps` training steps on fixed batches, and the final parameters (canonical)."""
    config = moe_run_config(data, fsdp, expert, tensor)
    devices = jax.devices()[: data * fsdp * expert * tensor]
    program = build_program(config, build_mesh(config.mesh, devices))
    state = program.init_state()
    losses = []
    for batch in fixed_batches(config)[:steps]:
        state, metrics = program.train_step(state, jax.device_put(batch, program.batch_sharding))
        losses.append(float(metrics["loss"]))
    return losses, jax.tree.map(np.asarray, program.to_canonical(state).params)


def assert_trains_as_one_device(mesh_sizes) -> None:
    losses, params = moe_loss_trace(*mesh_sizes)
    single_losses, single_params = moe_loss_trace(1, 1, 1, 1)
    assert single_losses[-1] < single_losses[0]
    loss_diff = float(np.abs(np.array(losses) - np.array(single_losses)).max())
    param_diff = max(
        float(np.abs(got - want).max())
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(single_params), strict=True)
    )
    print(f"expert mesh {mesh_sizes}: losses {loss_diff:.2e}, parameters {param_diff:.2e}")
    assert loss_diff < 1e-5 and param_diff < 1e-5


@pytest.mark.slow  # five compiles of a four-layer model (a minute or two on two cores)
@pytest.mark.parametrize("mesh_sizes", EXPERT_MESHES, ids=lambda m: "d{}-f{}-e{}-t{}".format(*m))
def test_tiny_moe_on_an_expert_mesh_trains_as_on_one_device(mesh_sizes) -> None:
    assert_trains_as_one_device(mesh_sizes)


CHECKPOINTED_RUN = [
    "train.steps=4",
    "train.global_batch=8",
    "train.eval_every=0",
    "train.peak_tflops=0.5",
    "data.max_corpus_mib=1",
    "data.seq_len=16",
    "model.embed_dim=64",
    "model.mlp_dim=128",
    "model.moe.expert_mlp_dim=32",
    "optim.warmup_steps=2",
    "checkpoint.every_steps=2",
    "mesh.tensor=1",
]


def checkpointed_moe_run(run_dir, *overrides: str) -> str:
    """configs/tiny_moe.yaml trained in-process on all 8 devices; what it printed."""
    printed = io.StringIO()
    config = load_config(
        "configs/tiny_moe.yaml", [*CHECKPOINTED_RUN, f"run.dir={run_dir}", *overrides]
    )
    train(config, progress_stream=printed)
    return printed.getvalue()


def step_losses(run_dir) -> dict[int, float]:
    records = read_metrics(run_dir / "metrics.jsonl")
    return {record["step"]: record["loss"] for record in records if "loss" in record}


@pytest.mark.slow  # two in-process runs, each compiling its step
def test_a_run_saved_at_expert_4_resumes_at_expert_2_on_the_same_loss_curve(tmp_path) -> None:
    """The experts are saved in their global order whatever mesh.expert split them: the
    checkpoint holds every expert whole, and a run resumed on another split goes on the same."""
    saved = tmp_path / "expert4"
    checkpointed_moe_run(saved, "mesh.data=2", "mesh.fsdp=1", "mesh.expert=4")
    resumed = tmp_path / "expert2"
    printed = checkpointed_moe_run(
        resumed,
        f"checkpoint.resume_from={saved}/checkpoints/2",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.expert=2",
    )
    assert f"resumed from {saved}/checkpoints/2 (step 2)" in printed
    straight, continued = step_losses(saved), step_losses(resumed)
    assert sorted(continued) == [2, 3]
    for step in continued:
        assert continued[step] == pytest.approx(straight[step], rel=1e-5)
    # the saved arrays are the experts whole: [moe layers, experts, embed, hidden]
    options = load_config("configs/tiny_moe.yaml").checkpoint
    checkpointer = Checkpointer(saved / "checkpoints", options, read_only=True)
    try:
        saved_arrays = checkpointer.array_metadata(4)
    finally:
        checkpointer.close()
    assert tuple(saved_arrays["params"]["moe_layers"]["mlp"]["gate"].shape) == (3, 8, 64, 32)
