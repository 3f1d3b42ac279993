"""Specifications of msjax.optim: the schedule, the decay mask, clipping, AdamW and LAMB updates."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from msjax.config import OptimConfig
from msjax.optim import (
    advance_schedule,
    learning_rate_schedule,
    make_optimizer,
    stacked_over_layers,
    weight_decay_mask,
)

PEAK = 0.1
FINAL_FRACTION = 0.1


def schedule_values(schedule: str, warmup_steps: int, total_steps: int, steps) -> np.ndarray:
    optim = OptimConfig(
        learning_rate=PEAK,
        warmup_steps=warmup_steps,
        schedule=schedule,
        final_lr_fraction=FINAL_FRACTION,
    )
    lr = learning_rate_schedule(optim, total_steps)
    return np.array([float(lr(jnp.asarray(step, jnp.int32))) for step in steps])


# --- learning-rate schedule -------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decaying_schedule_rises_from_zero_to_peak_then_ends_at_final_fraction(schedule):
    lr = schedule_values(schedule, warmup_steps=10, total_steps=110, steps=[0, 5, 10, 110, 200])
    np.testing.assert_allclose(lr, [0.0, PEAK / 2, PEAK, PEAK * 0.1, PEAK * 0.1], rtol=1e-6)


def test_cosine_and_linear_decay_differ_a_quarter_of_the_way_down():
    final = PEAK * FINAL_FRACTION
    cosine = schedule_values("cosine", warmup_steps=10, total_steps=110, steps=[35, 60])
    linear = schedule_values("linear", warmup_steps=10, total_steps=110, steps=[35, 60])
    quarter_cosine = final + (PEAK - final) * 0.5 * (1 + math.cos(math.pi / 4))
    np.testing.assert_allclose(cosine, [quarter_cosine, (PEAK + final) / 2], rtol=1e-6)
    np.testing.assert_allclose(
        linear, [PEAK - 0.25 * (PEAK - final), (PEAK + final) / 2], rtol=1e-6
    )


def test_cosine_schedule_matches_optax_warmup_cosine_decay_at_every_step():
    steps = range(130)
    ours = schedule_values("cosine", warmup_steps=17, total_steps=120, steps=steps)
    reference = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=PEAK,
        warmup_steps=17,
        decay_steps=120,
        end_value=PEAK * FINAL_FRACTION,
    )
    expected = np.array([float(reference(step)) for step in steps])
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-9)


def test_constant_schedule_is_flat_at_peak_after_warmup():
    lr = schedule_values("constant", warmup_steps=4, total_steps=50, steps=[0, 2, 4, 20, 50, 80])
    np.testing.assert_allclose(lr, [0.0, PEAK / 2, PEAK, PEAK, PEAK, PEAK], rtol=1e-6)


def test_zero_warmup_starts_at_peak():
    lr = schedule_values("cosine", warmup_steps=0, total_steps=100, steps=[0, 50, 100])
    final = PEAK * FINAL_FRACTION
    np.testing.assert_allclose(lr, [PEAK, (PEAK + final) / 2, final], rtol=1e-6)


def test_warmup_longer_than_the_run_stays_in_warmup():
    lr = schedule_values("linear", warmup_steps=200, total_steps=100, steps=[0, 50, 100])
    np.testing.assert_allclose(lr, [0.0, PEAK / 4, PEAK / 2], rtol=1e-6)
    lr = schedule_values("cosine", warmup_steps=100, total_steps=100, steps=[0, 99, 100])
    assert np.all(np.isfinite(lr))
    np.testing.assert_allclose(lr[:2], [0.0, PEAK * 0.99], rtol=1e-6)


# --- weight-decay mask ------------------------------------------------------------------------


def test_weight_decay_mask_decays_matrices_and_embeddings_but_not_norms_or_biases():
    logical_axes = {
        "embed": {"embedding": ("vocab", "embed")},
        "layers": {
            "attn_norm": {"scale": ("layers", "embed")},
            "attn": {
                "q": ("layers", "embed", "heads", "head_dim"),
                "kv": ("layers", "embed", "kv_heads", "head_dim"),
                "o": ("layers", "heads", "head_dim", "embed"),
            },
            "mlp_norm": {"scale": ("layers", "embed")},
            "mlp": {
                "gate": ("layers", "embed", "mlp"),
                "up_bias": ("layers", "mlp"),
                "down": ("layers", "mlp", "embed"),
            },
        },
        "final_norm": {"scale": ("embed",)},
        "lm_head": ("embed", "vocab"),
        "unnamed_matrix": ("layers", None, "embed"),
        "unnamed_vector": ("layers", None),
        "temperature": (),
    }
    assert weight_decay_mask(logical_axes) == {
        "embed": {"embedding": True},
        "layers": {
            "attn_norm": {"scale": False},
            "attn": {"q": True, "kv": True, "o": True},
            "mlp_norm": {"scale": False},
            "mlp": {"gate": True, "up_bias": False, "down": True},
        },
        "final_norm": {"scale": False},
        "lm_head": True,
        "unnamed_matrix": True,
        "unnamed_vector": False,
        "temperature": False,
    }


def test_weight_decay_mask_names_a_parameter_without_logical_axes():
    with pytest.raises(TypeError, match=r"\['mlp'\]\['gate'\]"):
        weight_decay_mask({"mlp": {"gate": None, "norm": ("embed",)}})


# --- AdamW and LAMB against numpy -------------------------------------------------------------

B1, B2 = 0.9, 0.95
# eps comparable to sqrt(v) (gradients ~1e-2), so putting it inside or outside the square root
# changes the result and the comparison checks where it goes.
EPS = 1e-3
WEIGHT_DECAY = 0.1


def small_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.normal(size=(4, 3)).astype(np.float32),  # [embed, mlp]: decayed
        "scale": (1.0 + 0.1 * rng.normal(size=(3,))).astype(np.float32),  # [mlp]: not decayed
    }


def small_grads(num_steps: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [
        {
            "w": (0.01 * rng.normal(size=(4, 3))).astype(np.float32),
            "scale": (0.01 * rng.normal(size=(3,))).astype(np.float32),
        }
        for _ in range(num_steps)
    ]


SMALL_MASK = weight_decay_mask({"w": ("embed", "mlp"), "scale": ("mlp",)})


def optim_config(name: str, **changes) -> OptimConfig:
    base = OptimConfig(
        name=name,
        learning_rate=PEAK,
        warmup_steps=2,
        schedule="cosine",
        final_lr_fraction=FINAL_FRACTION,
        b1=B1,
        b2=B2,
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
        grad_clip_norm=None,
    )
    return dataclasses.replace(base, **changes)


def numpy_lr(step: int, warmup_steps: int, total_steps: int) -> float:
    """Warmup then cosine, written out independently of msjax.optim; step counts from 0."""
    final = PEAK * FINAL_FRACTION
    if step < warmup_steps:
        return PEAK * step / warmup_steps
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    return final + (PEAK - final) * 0.5 * (1 + math.cos(math.pi * progress))


def run_optimizer(
    optim: OptimConfig, total_steps: int, params, grads_per_step, mask=SMALL_MASK, stacked=None
):
    optimizer = make_optimizer(optim, total_steps, mask, stacked)
    params = jax.tree.map(jnp.asarray, params)
    state = optimizer.init(params)
    step = jax.jit(optimizer.update)
    for grads in grads_per_step:
        updates, state = step(jax.tree.map(jnp.asarray, grads), state, params)
        params = optax.apply_updates(params, updates)
    return jax.tree.map(np.asarray, params)


def numpy_adam_direction(grad, m, v, t):
    """Adam's bias-corrected direction at step t (from 1); eps outside the root (Adam, LAMB)."""
    m = B1 * m + (1 - B1) * grad
    v = B2 * v + (1 - B2) * grad**2
    m_hat = m / (1 - B1**t)
    v_hat = v / (1 - B2**t)
    return m_hat / (np.sqrt(v_hat) + EPS), m, v


def numpy_adamw(params, grads_per_step, decays, warmup_steps, total_steps):
    """AdamW (Loshchilov & Hutter) with decay times lr, as PyTorch and optax scale it."""
    params = {k: p.astype(np.float64) for k, p in params.items()}
    m = {k: np.zeros_like(p) for k, p in params.items()}
    v = {k: np.zeros_like(p) for k, p in params.items()}
    for t, grads in enumerate(grads_per_step, start=1):
        lr = numpy_lr(t - 1, warmup_steps, total_steps)
        for k in params:
            direction, m[k], v[k] = numpy_adam_direction(grads[k].astype(np.float64), m[k], v[k], t)
            decay = WEIGHT_DECAY * params[k] if decays[k] else 0.0
            params[k] = params[k] - lr * (direction + decay)
    return params


def numpy_lamb(params, grads_per_step, decays, warmup_steps, total_steps, stacked=()):
    """LAMB as in You et al. 2020, Algorithm 2, with phi the identity; a layer is an array, or
    one leading-axis slice of an array named in `stacked`.

    r = m_hat / (sqrt(v_hat) + eps) + wd * x;  x -= lr * ||x|| / ||r|| * r (ratio 1 if a norm
    is 0). The weight decay is inside the trust ratio, and every array (decayed or not) gets one.
    """
    params = {k: p.astype(np.float64) for k, p in params.items()}
    m = {k: np.zeros_like(p) for k, p in params.items()}
    v = {k: np.zeros_like(p) for k, p in params.items()}
    for t, grads in enumerate(grads_per_step, start=1):
        lr = numpy_lr(t - 1, warmup_steps, total_steps)
        for k in params:
            direction, m[k], v[k] = numpy_adam_direction(grads[k].astype(np.float64), m[k], v[k], t)
            r = direction + (WEIGHT_DECAY * params[k] if decays[k] else 0.0)
            layers = list(range(len(r))) if k in stacked else [...]
            for layer in layers:
                param_norm, r_norm = np.linalg.norm(params[k][layer]), np.linalg.norm(r[layer])
                trust = 1.0 if param_norm == 0 or r_norm == 0 else param_norm / r_norm
                params[k][layer] = params[k][layer] - lr * trust * r[layer]
    return params


def test_adamw_matches_numpy_reference_with_masked_decoupled_weight_decay():
    optim = optim_config("adamw", warmup_steps=0)
    grads = small_grads(3)
    got = run_optimizer(optim, 10, small_params(), grads)
    want = numpy_adamw(small_params(), grads, SMALL_MASK, warmup_steps=0, total_steps=10)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)
    # The reference is sensitive to the mask: decaying the scale would move it this much.
    decayed_everywhere = numpy_adamw(small_params(), grads, {"w": True, "scale": True}, 0, 10)
    assert np.max(np.abs(decayed_everywhere["scale"] - want["scale"])) > 1e-3


def test_adamw_first_step_with_zero_gradients_only_shrinks_decayed_params():
    optim = optim_config("adamw", warmup_steps=0)
    params = small_params()
    zeros = {k: np.zeros_like(p) for k, p in params.items()}
    got = run_optimizer(optim, 10, params, [zeros])
    np.testing.assert_allclose(got["w"], params["w"] * (1 - PEAK * WEIGHT_DECAY), rtol=1e-6)
    np.testing.assert_array_equal(got["scale"], params["scale"])


def test_lamb_matches_numpy_reference_for_four_steps():
    """LAMB follows the paper: eps outside the root (eps_root=0), the weight decay added before
    the trust ratio, ratio ||x|| / ||r|| per array, 1 when either norm is 0. A choice the paper
    leaves open: the undecayed 1-D scale gets a trust ratio too (as in optax).
    """
    optim = optim_config("lamb", warmup_steps=2)
    grads = small_grads(4)  # lr per step: 0, peak / 2, peak, then cosine towards total_steps=6
    got = run_optimizer(optim, 6, small_params(), grads)
    want = numpy_lamb(small_params(), grads, SMALL_MASK, warmup_steps=2, total_steps=6)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)
    # The steps are large enough for a wrong rule to show: LAMB moves w by about lr * ||w||.
    moved = np.linalg.norm(want["w"] - small_params()["w"]) / np.linalg.norm(small_params()["w"])
    assert moved > 0.1
    adamw = run_optimizer(optim_config("adamw"), 6, small_params(), grads)
    assert np.max(np.abs(got["w"] - adamw["w"])) > 1e-3


def test_lamb_takes_one_trust_ratio_per_layer_of_a_stacked_parameter():
    # Three layers whose weights differ in scale by 100x: one ratio for the stack would move
    # the small layers by far more than their own norm allows.
    rng = np.random.default_rng(3)
    params = {
        "w": (rng.normal(size=(3, 4, 3)) * np.array([1.0, 0.1, 0.01])[:, None, None]),
        "scale": rng.normal(size=(3,)),
    }
    params = {k: v.astype(np.float32) for k, v in params.items()}
    grads = [{k: (0.01 * rng.normal(size=v.shape)).astype(np.float32) for k, v in params.items()}]
    grads *= 3
    optim = optim_config("lamb", warmup_steps=0)  # cosine from the peak, as numpy_lr
    mask, stacked = {"w": True, "scale": False}, {"w": True, "scale": False}
    got = run_optimizer(optim, 10, params, grads, mask, stacked)
    want = numpy_lamb(params, grads, mask, 0, 10, stacked={"w"})
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)
    whole_stack = numpy_lamb(params, grads, mask, 0, 10)
    assert np.max(np.abs(whole_stack["w"][2] - want["w"][2])) > 10 * np.abs(want["w"][2]).max()
    unstacked = run_optimizer(optim, 10, params, grads, mask)  # no stacking named: per array
    np.testing.assert_allclose(unstacked["w"], whole_stack["w"], rtol=1e-5, atol=1e-7)


def test_stacked_over_layers_reads_the_leading_logical_axis():
    axes = {"w": ("layers", "embed", "mlp"), "scale": ("layers", "embed"), "emb": ("vocab", "e")}
    assert stacked_over_layers(axes) == {"w": True, "scale": True, "emb": False}


def test_lamb_trust_ratio_is_one_for_an_all_zero_parameter():
    optim = optim_config("lamb", warmup_steps=0, schedule="constant")
    params = {"w": np.zeros((4, 3), np.float32), "scale": np.ones((3,), np.float32)}
    grads = small_grads(1)
    got = run_optimizer(optim, 10, params, grads)
    want = numpy_lamb(params, grads, SMALL_MASK, warmup_steps=0, total_steps=10)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)
    # Trust ratio 1: the plain first Adam step, -lr * g / (|g| + eps), is taken from zero.
    g = grads[0]["w"].astype(np.float64)
    np.testing.assert_allclose(got["w"], -PEAK * g / (np.abs(g) + EPS), rtol=1e-6)


# --- clipping and state -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_clipping_to_norm_one_equals_feeding_gradients_scaled_to_norm_one(name):
    """Two steps, because a single Adam step is almost blind to the gradient's scale."""
    first, second = small_grads(2)
    first_norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in first.values()))
    big_first = {k: g * np.float32(10.0 / first_norm) for k, g in first.items()}  # norm 10
    unit_first = {k: g * np.float32(1.0 / first_norm) for k, g in first.items()}  # norm 1
    assert float(optax.tree.norm(big_first)) == pytest.approx(10.0, rel=1e-6)
    # `second` has norm ~0.05, below the threshold, so clipping leaves it alone.
    clipped = run_optimizer(
        optim_config(name, grad_clip_norm=1.0), 6, small_params(), [big_first, second]
    )
    prescaled = run_optimizer(optim_config(name), 6, small_params(), [unit_first, second])
    unclipped = run_optimizer(optim_config(name), 6, small_params(), [big_first, second])
    for k in clipped:
        np.testing.assert_allclose(clipped[k], prescaled[k], rtol=1e-6, atol=1e-7)
    assert np.max(np.abs(unclipped["w"] - clipped["w"])) > 1e-4


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_optimizer_state_is_float32_for_float32_params(name):
    optim = optim_config(name, grad_clip_norm=1.0)
    optimizer = make_optimizer(optim, 10, SMALL_MASK)
    params = jax.tree.map(jnp.asarray, small_params())
    state = optimizer.init(params)
    _, state = optimizer.update(jax.tree.map(jnp.asarray, small_grads(1)[0]), state, params)
    float_dtypes = {
        leaf.dtype for leaf in jax.tree.leaves(state) if jnp.issubdtype(leaf.dtype, jnp.floating)
    }
    assert float_dtypes == {jnp.dtype(jnp.float32)}


def test_optimizer_refuses_bfloat16_params():
    optimizer = make_optimizer(optim_config("adamw"), 10, SMALL_MASK)
    params = {k: jnp.asarray(p, jnp.bfloat16) for k, p in small_params().items()}
    with pytest.raises(TypeError, match="float32"):
        optimizer.init(params)


def test_a_skipped_step_advances_the_schedule_but_not_the_moments():
    optim = optim_config("adamw", warmup_steps=4)  # lr 0, peak/4, peak/2, ...: steps differ
    optimizer = make_optimizer(optim, 10, SMALL_MASK)
    params = jax.tree.map(jnp.asarray, small_params())
    first, second = (jax.tree.map(jnp.asarray, grads) for grads in small_grads(2))
    state = optimizer.init(params)
    _, state = optimizer.update(first, state, params)  # step 0 (lr 0) updates the moments
    _, state = optimizer.update(first, state, params)  # step 1 at lr peak / 4
    kept, _ = optimizer.update(second, state, params)  # step 2, nothing skipped
    skipped, _ = optimizer.update(second, advance_schedule(state), params)  # after a skip
    schedule = learning_rate_schedule(optim, 10)
    ratio = float(schedule(3) / schedule(2))
    assert ratio == pytest.approx(1.5)
    # the same direction (moments and bias correction unchanged), taken at the next step's lr
    for key in kept:
        np.testing.assert_allclose(skipped[key], ratio * kept[key], rtol=1e-6)
