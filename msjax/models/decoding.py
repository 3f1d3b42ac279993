"""Autoregressive decoding with a key/value cache, on the Transformer's own weights and modules.

Each call runs new tokens through the layers, writes their keys and values into the cache, and
attends over everything cached so far; the training path (`Transformer.features`) is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from msjax import ops
from msjax.config import ModelConfig
from msjax.models.attention import rotary_embedding
from msjax.models.transformer import Block, Transformer


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer for the positions decoded so far."""

    key: jax.Array  # [layers, batch, max_len, kv_heads, head_dim], rotated
    value: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]
    length: jax.Array  # int32 scalar: positions [0, length) are filled


def empty_cache(config: ModelConfig, batch: int, max_len: int) -> KVCache:
    """A cache for up to max_len positions, in the compute dtype."""
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.resolved_head_dim)
    dtype = jnp.dtype(config.compute_dtype)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))


def cached_attention(
    query: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    positions: jax.Array,
    window: int | None,
) -> jax.Array:
    """Grouped-query attention of new queries over the cache, as the reference computes it.

    query: [batch, new, heads, dim] at positions [batch, new]; keys, values: [batch, max_len,
    kv_heads, dim]. Cache slots after a query's position (unfilled ones included) are masked.
    """
    batch, new, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[2]
    query = query.reshape(batch, new, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", query, keys, preferred_element_type=jnp.float32)
    scores = scores * (head_dim**-0.5)  # [batch, kv_heads, group, new, max_len]
    slots = jnp.arange(keys.shape[1])[None, None, :]  # [1, 1, max_len]
    allowed = slots <= positions[:, :, None]  # [batch, new, max_len]
    if window is not None:
        allowed = allowed & (positions[:, :, None] - slots < window)
    scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", weights, values)
    return out.reshape(batch, new, num_heads, head_dim)


def _decode_block(
    block: Block,
    x: jax.Array,
    positions: jax.Array,
    start: jax.Array,
    keys: jax.Array,
    values: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer on new tokens x [batch, new, embed]; its cache slots updated from `start`."""
    attention, config, dtype = block.attention, block.attention.config, x.dtype
    normed = block.attention_norm(x)
    query = jnp.einsum("bse,ehd->bshd", normed, attention.query[...].astype(dtype))
    key = jnp.einsum("bse,ehd->bshd", normed, attention.key[...].astype(dtype))
    value = jnp.einsum("bse,ehd->bshd", normed, attention.value[...].astype(dtype))
    query, key = attention.normalize_heads(query, key)
    query = rotary_embedding(query, positions, config.rope_theta)
    key = rotary_embedding(key, positions, config.rope_theta)
    keys = jax.lax.dynamic_update_slice(keys, key.astype(keys.dtype), (0, start, 0, 0))
    values = jax.lax.dynamic_update_slice(values, value.astype(values.dtype), (0, start, 0, 0))
    attended = cached_attention(query, keys, values, positions, config.attention_window)
    attended = jnp.einsum("bshd,hde->bse", attended, attention.out[...].astype(dtype))
    if block.parallel:
        x = x + attended + _mlp(block, normed)
    else:
        x = x + attended
        x = x + _mlp(block, block.mlp_norm(x))
    return x, keys, values


def _mlp(block: Block, normed: jax.Array) -> jax.Array:
    """The block's MLP, dense or a mixture of experts (its statistics dropped)."""
    return block.mlp(normed)[0] if block.moe else block.mlp(normed)


def decode(model: Transformer, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """tokens [batch, new] at positions cache.length... -> logits [batch, new, vocab] float32
    and the cache holding them too. A mixture of experts' layers route as configured (a capacity
    factor counts the tokens of this call: msjax.generate decodes dropless)."""
    config = model.config
    dtype = jnp.dtype(config.compute_dtype)
    start = cache.length
    positions = jnp.broadcast_to(start + jnp.arange(tokens.shape[1]), tokens.shape)
    x = jnp.take(model.embedding[...].astype(dtype), tokens, axis=0)  # [batch, new, embed]

    @nnx.scan(
        in_axes=(nnx.Carry, 0, 0, 0),
        out_axes=(nnx.Carry, 0, 0),
        transform_metadata={nnx.PARTITION_NAME: "layers"},
    )
    def run_layers(
        x: jax.Array, block: Block, keys: jax.Array, values: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        return _decode_block(block, x, positions, start, keys, values)

    keys, values, first = [], [], 0
    for name, count, _ in config.moe.layer_stacks(config.num_layers):
        stack = slice(first, first + count)
        layers = getattr(model, name)
        x, stack_keys, stack_values = run_layers(x, layers, cache.key[stack], cache.value[stack])
        keys.append(stack_keys)
        values.append(stack_values)
        first += count
    keys, values = jnp.concatenate(keys), jnp.concatenate(values)
    logits = ops.logits(model.final_norm(x), model.unembedding_matrix())
    return logits, KVCache(keys, values, start + tokens.shape[1])
