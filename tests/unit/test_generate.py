"""KV-cached generation: greedy equals the full forward recomputed per token; seeded sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from msjax.config import ModelConfig
from msjax.generate import Generator, Sampling, sample_token
from msjax.models.transformer import Transformer


def random_model(**overrides) -> tuple[ModelConfig, dict, Transformer]:
    settings = {
        "vocab_size": 64,
        "num_layers": 2,
        "embed_dim": 32,
        "num_heads": 4,
        "num_kv_heads": 2,
        "mlp_dim": 64,
        "init_std": 0.3,  # peaked logits, so argmax is far from ties
        "attention_impl": "xla",
        "norm_impl": "xla",
        "loss_impl": "xla",
    }
    config = ModelConfig(**{**settings, **overrides})
    model = Transformer(config, nnx.Rngs(params=3))
    return config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), model


def greedy_by_full_forward(model: Transformer, prompt: list[int], count: int) -> list[int]:
    """Each next token as the argmax of a full forward pass over everything so far (padded to
    one length, which a causal model never looks ahead into, so one program serves every step)."""
    forward = nnx.jit(lambda model, tokens, last: model(tokens)[0, last])
    tokens = list(prompt)
    for _ in range(count):
        padded = jnp.asarray([tokens + [0] * (len(prompt) + count - len(tokens))], jnp.int32)
        logits = forward(model, padded, len(tokens) - 1)
        tokens.append(int(jnp.argmax(logits[:60])))
    return tokens[len(prompt) :]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tied_embeddings": True, "num_kv_heads": 1},
        {"parallel_block": True},
        {"attention_window": 5},
    ],
)
def test_greedy_generation_equals_the_full_forward_argmax(overrides: dict) -> None:
    config, params, model = random_model(**overrides)
    prompt = [5, 17, 3, 42, 8]
    generator = Generator(config, params, vocab_limit=60)
    cached = list(generator.tokens(prompt, 12, Sampling(temperature=0), eos_id=None))
    assert len(cached) == 12 and len(set(cached)) > 1
    assert cached == greedy_by_full_forward(model, prompt, 12)


def test_seeded_sampling_is_reproducible() -> None:
    config, params, _ = random_model()
    generator = Generator(config, params, vocab_limit=60)
    sampling = Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=7)
    first = list(generator.tokens([1, 2, 3], 16, sampling, eos_id=None))
    again = list(generator.tokens([1, 2, 3], 16, sampling, eos_id=None))
    other = list(generator.tokens([1, 2, 3], 16, Sampling(1.0, 20, 0.9, seed=8), eos_id=None))
    assert first == again
    assert first != other
    assert max(first) < 60


def test_top_k_and_top_p_keep_only_the_likeliest_tokens() -> None:
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 200)
    draw = jax.vmap(lambda key, sampling: sample_token(logits, key, sampling, 4)[0], (0, None))
    top_k = set(np.asarray(jax.jit(draw, static_argnums=1)(keys, Sampling(1.0, 2, 1.0))))
    top_p = set(np.asarray(jax.jit(draw, static_argnums=1)(keys, Sampling(1.0, 0, 0.7))))
    assert top_k == {0, 1}
    assert top_p == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    padded = sample_token(jnp.asarray([[0.0, 0.0, 9.0]]), keys[0], Sampling(0.0), 2)
    assert int(padded[0]) in (0, 1)
