"""Shared helpers of the Pallas kernel tests, and every kernel together: the interpreter's NaN
poison, lowering to Triton, dispatch and config, sharded kernels and the GPU benchmark's smoke form.

Every comparison covers the forward and all gradients. Tolerances, as a fraction of the largest
expected magnitude: float32 1e-5 (only summation order differs); bfloat16 2e-2 (inputs are
rounded to bfloat16 once, and kernel and reference are both held against a float32 reference
on those rounded inputs). The interpreter fills every output with NaN before a kernel runs
(checked below), so an element a kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding, PartitionSpec

from msjax import ops
from msjax.config import MeshConfig, ModelConfig, config_from_dict
from msjax.errors import ConfigError
from msjax.parallel.mesh import build_mesh
from msjax.parallel.rules import activation_placement
from msjax.resolve import resolve_impl, resolve_model
from pallas_kernels import cross_entropy as ce
from pallas_kernels import flash_attention as fa
from pallas_kernels import rms_norm as rn

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
FEW = settings(max_examples=5, deadline=None, derandomize=True)
# On one GPU these tests would fail for reasons that are not kernel bugs: they check the CPU
# backend's choices, run the Pallas interpreter, or build meshes of 8 devices.
cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU backend")
eight_devices = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def normal(shape: tuple[int, ...], seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def assert_close(actual: jax.Array, expected: jax.Array, dtype, what: str) -> None:
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    assert actual.shape == expected.shape, what
    assert np.isfinite(actual).all(), f"{what}: non-finite (unwritten?) elements"
    bound = TOLERANCE[dtype] * max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    error = float(np.max(np.abs(actual - expected), initial=0.0))
    assert error <= bound, f"{what}: max error {error:.3g} > {bound:.3g}"


def value_and_vjp(fn, args, cotangent):
    """fn(*args) and the gradient of <fn(*args), cotangent> wrt every arg, in one jit."""

    def run(args, cotangent):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(cotangent)

    return jax.jit(run)(args, cotangent)


def rounded(x: jax.Array, dtype) -> jax.Array:
    return x.astype(dtype).astype(jnp.float32)


def pallas_calls(jaxpr) -> list:
    """Every pallas_call equation in a jaxpr, nested jaxprs (custom_vjp, jit) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found.extend(pallas_calls(inner))
    return found


def outside_kernel_shapes(jaxpr):
    """Shapes of every value the XLA program (not a kernel's tiles) holds, nested jaxprs too."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield tuple(var.aval.shape)
        if eqn.primitive.name == "pallas_call":
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from outside_kernel_shapes(inner)


# ---- 0. the poison every kernel test relies on --------------------------------------------------


@cpu_only
def test_interpreter_fills_outputs_with_nan_so_unwritten_elements_show():
    def write_first_half(x_ref, out_ref):
        out_ref[:4] = x_ref[:4]

    out = pl.pallas_call(
        write_first_half, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=True
    )(jnp.ones(8))
    np.testing.assert_array_equal(out[:4], 1.0)
    assert np.isnan(np.asarray(out[4:])).all()


# ---- 1. the kernels lower to Triton for a Hopper GPU (no GPU needed) ----------------------------


def lower_for_gpu(fn, *args) -> str:
    """StableHLO for CUDA, the Pallas kernels lowered through Triton for an H200 (sm_90)."""

    def lower() -> str:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=h200)
    ):
        return lower()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_attention_forward_and_backward_lower_to_triton(head_dim):
    q = jax.ShapeDtypeStruct((2, 1024, 8, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 1024, 2, head_dim), jnp.bfloat16)
    segments = jax.ShapeDtypeStruct((2, 1024), jnp.int32)

    def loss(q, k, v, segment_ids):
        out = fa.flash_attention(q, k, v, window=256, segment_ids=segment_ids, interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    text = lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, segments)
    assert text.count("__gpu$xla.gpu.triton") == 3  # forward, dK/dV, dQ


def test_rms_norm_forward_and_backward_lower_to_triton():
    x = jax.ShapeDtypeStruct((4, 1000, 5120), jnp.bfloat16)
    scale = jax.ShapeDtypeStruct((5120,), jnp.float32)

    def loss(x, residual, scale):
        total, normed = rn.add_rms_norm(x, residual, scale, interpret=False)
        alone = rn.rms_norm(x, scale, interpret=False)
        return jnp.sum(total.astype(jnp.float32) + normed + alone)

    text = lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2)), x, x, scale)
    assert text.count("__gpu$xla.gpu.triton") == 4  # two forwards, two backwards


def test_cross_entropy_forward_and_backward_lower_to_triton():
    hidden = jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16)
    unembedding = jax.ShapeDtypeStruct((2048, 32768), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((8192,), jnp.int32)

    def loss(hidden, unembedding, labels):
        return jnp.sum(ce.cross_entropy(hidden, unembedding, labels, interpret=False))

    text = lower_for_gpu(jax.grad(loss, argnums=(0, 1)), hidden, unembedding, labels)
    assert text.count("__gpu$xla.gpu.triton") == 2  # forward, d_logits (inside the chunk loop)


def test_vocab_parallel_cross_entropy_lowers_to_triton_with_its_merges_as_all_reduces():
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((2, 2), ("data", "tensor"), abstract_device=h200)
    specs = (PartitionSpec("data"), PartitionSpec(None, "tensor"), PartitionSpec("data"))
    hidden, unembedding, labels = (
        jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
        for shape, dtype, spec in zip(
            [(4096, 1024), (1024, 32768), (4096,)],
            [jnp.bfloat16, jnp.bfloat16, jnp.int32],
            specs,
            strict=True,
        )
    )

    def local(hidden, unembedding, labels):
        return ce.cross_entropy(hidden, unembedding, labels, vocab_axis="tensor", interpret=False)

    def loss(hidden, unembedding, labels):
        per_device = jax.shard_map(
            local, mesh=mesh, in_specs=specs, out_specs=PartitionSpec("data"), check_vma=False
        )
        return jnp.sum(per_device(hidden, unembedding, labels))

    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(hidden, unembedding, labels)
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2  # forward, d_logits
    # forward: pmax and psum of the log-sum-exps, psum of the label logits; backward: the
    # cotangent's psum over tensor, then shard_map's sums of dhidden over tensor and of
    # dunembedding over data
    assert text.count("all_reduce") == 6


# ---- 2. dispatch and config ---------------------------------------------------------------------


@cpu_only
def test_auto_picks_the_xla_reference_off_gpu_and_cudnn_there_is_a_one_line_error():
    backend = jax.default_backend()
    assert backend == "cpu"
    assert resolve_impl("auto", "attention_impl", backend) == "xla"
    with pytest.raises(ConfigError, match=r"model.attention_impl=cudnn needs a GPU") as error:
        resolve_impl("cudnn", "attention_impl", backend)
    assert "\n" not in str(error.value)


def test_auto_on_gpu_is_cudnn_attention_with_xla_norm_and_loss_and_pallas_stays_selectable():
    bf16 = ModelConfig(compute_dtype="bfloat16", embed_dim=2048, num_heads=32)  # head_dim 64
    chosen = resolve_model(bf16, "gpu")
    assert (chosen.attention_impl, chosen.norm_impl, chosen.loss_impl) == ("cudnn", "xla", "xla")
    pallas = dataclasses.replace(
        bf16, attention_impl="pallas", norm_impl="pallas", loss_impl="pallas"
    )
    chosen = resolve_model(pallas, "gpu")
    assert (chosen.attention_impl, chosen.norm_impl, chosen.loss_impl) == ("pallas",) * 3
    assert resolve_model(bf16, "cpu").attention_impl == "xla"


@pytest.mark.parametrize(
    "model",
    [
        ModelConfig(compute_dtype="float32", embed_dim=2048, num_heads=32),  # 16-bit only
        ModelConfig(compute_dtype="bfloat16", embed_dim=2048, num_heads=32, head_dim=60),
        ModelConfig(compute_dtype="bfloat16", embed_dim=4096, num_heads=8, head_dim=512),
    ],
    ids=["float32", "head-dim-not-multiple-of-8", "head-dim-over-256"],
)
def test_auto_attention_on_gpu_is_xla_where_cudnn_does_not_take_the_model(model):
    assert resolve_model(model, "gpu").attention_impl == "xla"


@pytest.mark.parametrize("impl", ["auto", "flash"])
@pytest.mark.parametrize("op", ["attention", "rms_norm", "add_rms_norm", "token_losses"])
def test_an_op_given_an_unresolved_impl_refuses_and_names_msjax_resolve(op, impl):
    # `auto` depends on the backend: msjax.resolve chooses once per run, ops never guess.
    qkv, hidden, scale = normal((1, 4, 2, 8), 0), normal((1, 4, 8), 1), jnp.ones(8)
    unembedding, targets = normal((8, 16), 2), jnp.zeros((1, 4), jnp.int32)
    calls = {
        "attention": lambda: ops.attention(qkv, qkv, qkv, impl=impl),
        "rms_norm": lambda: ops.rms_norm(hidden, scale, eps=1e-5, impl=impl),
        "add_rms_norm": lambda: ops.add_rms_norm(hidden, hidden, scale, eps=1e-5, impl=impl),
        "token_losses": lambda: ops.token_losses(hidden, unembedding, targets, impl=impl),
    }
    with pytest.raises(ValueError, match=rf"model\.\w+_impl='{impl}'.*msjax\.resolve"):
        calls[op]()


def test_model_config_accepts_the_impl_keys_and_names_the_choices_for_a_bad_one():
    config = config_from_dict({"model": {"attention_impl": "pallas", "norm_impl": "xla"}})
    assert (config.model.attention_impl, config.model.norm_impl) == ("pallas", "xla")
    with pytest.raises(ConfigError, match="auto, xla, pallas, cudnn"):
        config_from_dict({"model": {"attention_impl": "flash"}})
    with pytest.raises(ConfigError, match="auto, xla, pallas"):
        config_from_dict({"model": {"norm_impl": "cudnn"}})
    assert config_from_dict({"model": {"loss_impl": "pallas"}}).model.loss_impl == "pallas"
    with pytest.raises(ConfigError, match="auto, xla, pallas") as error:
        config_from_dict({"model": {"loss_impl": "triton"}})
    assert "model.loss_impl" in str(error.value) and "\n" not in str(error.value)


@cpu_only
def test_pallas_dispatch_off_gpu_runs_the_interpreted_kernel_not_the_reference():
    query, key, value = normal((1, 8, 2, 8), 0), normal((1, 8, 1, 8), 1), normal((1, 8, 1, 8), 2)
    jaxpr = jax.make_jaxpr(lambda q, k, v: ops.attention(q, k, v, impl="pallas"))(query, key, value)
    assert len(pallas_calls(jaxpr.jaxpr)) == 1
    assert not pallas_calls(jax.make_jaxpr(ops.attention)(query, key, value).jaxpr)


@eight_devices
@pytest.mark.parametrize(
    ("heads", "kv_heads", "tensor"),
    [(8, 2, 4), (6, 3, 2)],
    ids=["kv-head-shared-by-shards", "groups-straddle-shards"],
)
def test_sharded_kernel_with_kv_heads_unsplit_matches_reference(heads, kv_heads, tensor):
    # kv heads not divisible by `tensor` stay whole while query heads are split: each shard
    # must pick the kv heads of its own query heads.
    mesh = build_mesh(MeshConfig(data=8 // tensor, fsdp=1, tensor=tensor), jax.devices()[:8])
    rules = {"batch": ("data", "fsdp"), "heads": "tensor", "kv_heads": None}
    batch = 8 // tensor
    query, key, value = (
        normal((batch, 16, heads, 8), 0),
        normal((batch, 16, kv_heads, 8), 1),
        normal((batch, 16, kv_heads, 8), 2),
    )
    segment_ids = jnp.asarray(np.repeat([[1] * 5 + [2] * 11], batch, axis=0))
    cotangent = normal(query.shape, 3)

    def sharded(q, k, v):
        with activation_placement(mesh, rules):
            return ops.attention(q, k, v, window=6, segment_ids=segment_ids, impl="pallas")

    heads_split = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, "tensor", None))
    kv_whole = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, None, None))
    args = (
        jax.device_put(query, heads_split),
        jax.device_put(key, kv_whole),
        jax.device_put(value, kv_whole),
    )
    out, grads = value_and_vjp(sharded, args, cotangent)
    expected_out, expected_grads = value_and_vjp(
        lambda q, k, v: fa.reference(q, k, v, window=6, segment_ids=segment_ids),
        (query, key, value),
        cotangent,
    )
    assert_close(out, expected_out, jnp.float32, "output")
    for name, grad, expected in zip("qkv", grads, expected_grads, strict=True):
        assert_close(grad, expected, jnp.float32, f"d{name}")


@eight_devices
@pytest.mark.parametrize(("data", "fsdp", "tensor"), [(1, 1, 4), (2, 2, 2)], ids=str)
def test_vocab_parallel_loss_matches_the_xla_loss_forward_and_gradients(data, fsdp, tensor):
    # The vocabulary split over `tensor`: each shard reduces its own columns and the shards
    # merge log-sum-exps; labels in every shard's range, and padded tiles in each shard.
    batch, seq, embed, vocab = 4, 6, 16, 4 * 44
    mesh = build_mesh(
        MeshConfig(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[: data * fsdp * tensor]
    )
    rules = {"batch": ("data", "fsdp"), "seq": None, "vocab": "tensor"}
    hidden = normal((batch, seq, embed), 0)
    unembedding = 0.3 * normal((embed, vocab), 1)
    targets = jnp.asarray(np.random.default_rng(2).integers(0, vocab, (batch, seq)), jnp.int32)
    targets = targets.at[0, :4].set(jnp.asarray([0, 43, 44, vocab - 1]))  # shard edges
    cotangent = normal((batch, seq), 3)

    def loss(impl):
        def run(h, w):
            with activation_placement(mesh, rules):
                return ops.token_losses(h, w, targets, impl=impl)

        return run

    args = (
        jax.device_put(hidden, NamedSharding(mesh, PartitionSpec(("data", "fsdp")))),
        jax.device_put(unembedding, NamedSharding(mesh, PartitionSpec(None, "tensor"))),
    )
    out, grads = value_and_vjp(loss("pallas"), args, cotangent)
    expected_out, expected_grads = value_and_vjp(loss("xla"), args, cotangent)
    flat = ce.reference(hidden.reshape(-1, embed), unembedding, targets.reshape(-1))
    assert_close(expected_out, flat.reshape(batch, seq), jnp.float32, "xla loss")
    assert_close(out, expected_out, jnp.float32, "losses")
    for name, grad, expected in zip(("hidden", "unembedding"), grads, expected_grads, strict=True):
        assert_close(grad, expected, jnp.float32, f"d{name}")


def test_pallas_loss_never_holds_logits_for_all_tokens_and_the_whole_vocab():
    batch, seq, embed, vocab = 2, 8, 16, 2 * 8192  # two backward chunks
    hidden, unembedding = normal((batch, seq, embed), 0), normal((embed, vocab), 1)
    targets = jnp.zeros((batch, seq), jnp.int32)

    def loss(impl):
        return lambda h, w: jnp.sum(ops.token_losses(h, w, targets, impl=impl))

    def shapes(impl):
        grad = jax.grad(loss(impl), argnums=(0, 1))
        return set(outside_kernel_shapes(jax.make_jaxpr(grad)(hidden, unembedding).jaxpr))

    assert (batch, seq, vocab) in shapes("xla")  # the reference does hold them
    assert not any(vocab in shape and embed not in shape for shape in shapes("pallas"))


# ---- 3. the sharded train step ------------------------------------------------------------------


@eight_devices
def test_tiny_model_trains_five_steps_with_pallas_kernels_like_xla_on_a_2x2x2_mesh():
    # every kernel: attention, norms and the vocab-parallel loss (vocab split over tensor=2)
    from test_parallel import small_config, train_losses

    def losses(impl: str) -> list[float]:
        config = small_config(2, 2, 2)
        model = dataclasses.replace(
            config.model, attention_impl=impl, norm_impl=impl, loss_impl=impl, attention_window=12
        )
        return train_losses(dataclasses.replace(config, model=model))

    xla, pallas = losses("xla"), losses("pallas")
    np.testing.assert_allclose(pallas, xla, rtol=1e-5)
    assert all(b != a for a, b in itertools.pairwise(xla))  # the model really trains


# ---- 4. the GPU benchmark's CPU smoke form ------------------------------------------------------


@cpu_only
def test_gpu_benchmark_smoke_form_checks_every_kernel_and_prints_its_table(capsys):
    path = Path(__file__).parents[2] / "benchmarks" / "kernels_gpu.py"
    spec = importlib.util.spec_from_file_location("kernels_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(["--smoke"])
    printed = capsys.readouterr().out
    kernels = {"flash_attention", "rms_norm", "add_rms_norm", "cross_entropy"}
    assert {row["kernel"] for row in rows} == kernels
    assert "jax pallas mha" in {row["impl"] for row in rows}
    assert all(row["max_error"] <= row["tolerance"] for row in rows)
    for row in rows:
        assert row["kernel"] in printed
