"""Fused unembedding + cross-entropy in Pallas (Triton backend), never holding [tokens, vocab],
vocab-parallel under `shard_map`. `reference` is the plain-JAX loss.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# The forward streams vocab tiles through an online log-sum-exp (as flash attention streams
# keys), so only [tokens] float32 leave the kernel. The backward walks the vocabulary in chunks:
# a kernel recomputes one chunk's logits and writes (softmax - onehot) * dloss in the compute
# dtype, and XLA's matmuls fold it into dhidden and dunembedding.
#
# Under `shard_map` with the vocabulary split over a mesh axis (Megatron's vocab-parallel
# cross-entropy), each shard reduces its own columns and the shards merge their log-sum-exps
# and label logits with two small collectives over [tokens]; the backward needs only the merged
# log-sum-exp, so no shard ever sees another shard's logits.

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def reference(hidden: jax.Array, unembedding: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-token cross-entropy of softmax(hidden @ unembedding) against labels, in float32.

    hidden: [tokens, embed]; unembedding: [embed, vocab]; labels: [tokens] ints -> [tokens].
    """
    logits = jnp.einsum("te,ev->tv", hidden, unembedding, preferred_element_type=jnp.float32)
    label_logits = jnp.take_along_axis(logits, labels[:, None].astype(jnp.int32), axis=1)[:, 0]
    return jax.nn.logsumexp(logits, axis=1) - label_logits


@dataclass(frozen=True)
class BlockSizes:
    """Tiles (powers of two, at least 16 on GPU) and the backward's vocab chunk."""

    block_tokens: int = 64
    block_vocab: int = 128
    block_embed: int = 64
    backward_chunk: int = 8192  # vocab columns per backward step: [tokens, chunk] in HBM
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class _Static:
    vocab: int
    block_tokens: int
    block_vocab: int
    block_embed: int
    chunk: int
    tiles_per_split: int  # forward: vocab tiles one program reduces (the rest run in parallel)
    num_warps: int
    num_stages: int
    interpret: bool
    vocab_axis: Hashable | None  # the mesh axis the vocabulary is split over, inside shard_map


def cross_entropy(
    hidden: jax.Array,
    unembedding: jax.Array,
    labels: jax.Array,
    *,
    vocab_axis: Hashable | None = None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool | None = None,
) -> jax.Array:
    """The kernel form of `reference`; gradients flow to hidden and unembedding.

    vocab_axis: inside `shard_map`, the mesh axis name (or tuple of names) the vocabulary is
    split over; unembedding then holds shard i's columns [i * vocab, (i + 1) * vocab), labels
    are global ids, and every shard returns the loss over the whole vocabulary. The hidden
    gradient each shard returns is its columns' share: shard_map's transpose sums the shares
    of an input that is not split over vocab_axis.
    """
    tokens, embed = hidden.shape
    if unembedding.shape[0] != embed or labels.shape != (tokens,):
        raise ValueError(
            f"hidden {hidden.shape}, unembedding {unembedding.shape} and labels {labels.shape} "
            "must be [tokens, embed], [embed, vocab] and [tokens]"
        )
    vocab = unembedding.shape[1]
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    block_tokens = min(block_sizes.block_tokens, max(16, pl.next_power_of_2(tokens)))
    block_embed = min(block_sizes.block_embed, max(16, pl.next_power_of_2(embed)))
    block_vocab = min(block_sizes.block_vocab, max(16, pl.next_power_of_2(vocab)))
    chunk = _round_up(min(block_sizes.backward_chunk, vocab), block_vocab)
    # Whole tiles everywhere; padded vocab columns are masked out of the softmax, padded
    # tokens carry zero gradient and are cut off.
    padded_tokens = _round_up(tokens, block_tokens)
    padded_embed = _round_up(embed, block_embed)
    padded_vocab = _round_up(vocab, math.lcm(block_vocab, chunk))
    # Few token blocks would leave SMs idle: split the vocabulary between programs too
    # (about 512 programs) and merge their partial log-sum-exps afterwards.
    tiles = padded_vocab // block_vocab
    splits = min(tiles, max(1, -(-512 // (padded_tokens // block_tokens))))
    static = _Static(
        vocab=vocab,
        block_tokens=block_tokens,
        block_vocab=block_vocab,
        block_embed=block_embed,
        chunk=chunk,
        tiles_per_split=-(-tiles // splits),
        num_warps=block_sizes.num_warps,
        num_stages=block_sizes.num_stages,
        interpret=bool(interpret),
        vocab_axis=vocab_axis,
    )
    labels = labels.astype(jnp.int32)
    if vocab_axis is not None:  # this shard's columns start at its index times its width
        labels = labels - lax.axis_index(vocab_axis) * vocab
        labels = jnp.where((labels >= 0) & (labels < vocab), labels, -1)  # -1: not here
    if (padded_tokens, padded_embed) != (tokens, embed):
        hidden = jnp.pad(hidden, ((0, padded_tokens - tokens), (0, padded_embed - embed)))
    if (padded_embed, padded_vocab) != (embed, vocab):
        unembedding = jnp.pad(unembedding, ((0, padded_embed - embed), (0, padded_vocab - vocab)))
    labels = jnp.pad(labels, (0, padded_tokens - tokens))
    return _loss(hidden, unembedding, labels, static)[:tokens]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _params(static: _Static) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=static.num_warps, num_stages=static.num_stages)


def _logits_tile(hidden_ref, unembedding_ref, vocab_start, static: _Static, mask: bool):
    """[block_tokens, block_vocab] float32 logits: hidden tile @ unembedding tile over embed.

    mask: padded vocab columns get MASK_VALUE (the forward's softmax must not see them).
    """
    block_embed, block_vocab = static.block_embed, static.block_vocab
    columns = pl.ds(vocab_start, block_vocab)

    def step(e, acc):
        rows = pl.ds(e * block_embed, block_embed)
        return acc + jnp.dot(
            hidden_ref[:, rows],
            unembedding_ref[rows, columns],
            preferred_element_type=jnp.float32,
        )

    zeros = jnp.zeros((static.block_tokens, block_vocab), jnp.float32)
    logits = lax.fori_loop(0, hidden_ref.shape[1] // block_embed, step, zeros)
    vocab_ids = vocab_start + jnp.arange(block_vocab)
    if mask:
        logits = jnp.where(vocab_ids[None, :] < static.vocab, logits, MASK_VALUE)
    return logits, vocab_ids


# ---- forward: online log-sum-exp over vocab tiles ------------------------------------------------


def _forward_kernel(hidden_ref, unembedding_ref, labels_ref, lse_ref, label_ref, *, static):
    """Log-sum-exp and label logit of one token block over one split of the vocab tiles."""
    labels = labels_ref[...]  # [block_tokens]

    def vocab_step(v, carry):
        row_max, row_sum, label_logit = carry
        logits, vocab_ids = _logits_tile(
            hidden_ref, unembedding_ref, v * static.block_vocab, static, mask=True
        )
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
        row_sum = row_sum * jnp.exp(row_max - new_max) + jnp.sum(
            jnp.exp(logits - new_max[:, None]), axis=1
        )
        is_label = vocab_ids[None, :] == labels[:, None]
        label_logit = label_logit + jnp.sum(jnp.where(is_label, logits, 0.0), axis=1)
        return new_max, row_sum, label_logit

    block_tokens = static.block_tokens
    carry = (
        jnp.full((block_tokens,), -jnp.inf, jnp.float32),
        jnp.zeros((block_tokens,), jnp.float32),
        jnp.zeros((block_tokens,), jnp.float32),
    )
    num_tiles = unembedding_ref.shape[1] // static.block_vocab
    first = pl.program_id(1) * static.tiles_per_split
    end = jnp.minimum(first + static.tiles_per_split, num_tiles)
    row_max, row_sum, label_logit = lax.fori_loop(first, end, vocab_step, carry)
    lse_ref[...] = row_max + jnp.log(row_sum)
    label_ref[...] = label_logit


def _forward(hidden, unembedding, labels, static: _Static):
    """(lse, label logit), both [tokens] float32: partial results per vocab split, merged."""
    tokens, embed = hidden.shape
    vocab = unembedding.shape[1]
    block_tokens = static.block_tokens
    splits = -(-vocab // (static.block_vocab * static.tiles_per_split))
    partial = pl.BlockSpec((None, block_tokens), lambda i, s: (s, i))
    lse, label_logit = pl.pallas_call(
        functools.partial(_forward_kernel, static=static),
        grid=(tokens // block_tokens, splits),
        in_specs=[
            pl.BlockSpec((block_tokens, embed), lambda i, s: (i, 0)),
            pl.BlockSpec((embed, vocab), lambda i, s: (0, 0)),
            pl.BlockSpec((block_tokens,), lambda i, s: (i,)),
        ],
        out_specs=[partial, partial],
        out_shape=[jax.ShapeDtypeStruct((splits, tokens), jnp.float32)] * 2,
        compiler_params=_params(static),
        interpret=static.interpret,
        name="cross_entropy_forward",
    )(hidden, unembedding, labels)
    return jax.nn.logsumexp(lse, axis=0), jnp.sum(label_logit, axis=0)


# ---- backward: one vocab chunk of d_logits at a time ---------------------------------------------


def _d_logits_kernel(
    hidden_ref, unembedding_ref, labels_ref, lse_ref, dloss_ref, out_ref, *, static
):
    """(softmax - onehot) * dloss for one [block_tokens, block_vocab] tile of this chunk.

    Vocab ids are chunk-local (labels come shifted). Padded vocab columns are zero in the
    unembedding, so whatever lands in their d_logits is multiplied away or cut off.
    """
    vocab_start = pl.program_id(1) * static.block_vocab
    logits, vocab_ids = _logits_tile(hidden_ref, unembedding_ref, vocab_start, static, mask=False)
    probs = jnp.exp(logits - lse_ref[...][:, None])
    is_label = vocab_ids[None, :] == labels_ref[...][:, None]
    d_logits = (probs - is_label.astype(jnp.float32)) * dloss_ref[...][:, None]
    out_ref[...] = d_logits.astype(out_ref.dtype)


def _backward(static: _Static, residuals, dloss):
    hidden, unembedding, labels, lse = residuals
    if static.vocab_axis is not None:
        # The forward's merge over vocab_axis is a psum, which transposes to a psum: shard_map
        # hands each shard a share of the (replicated) loss's cotangent, and every shard's
        # columns need the whole of it.
        dloss = lax.psum(dloss, static.vocab_axis)
    tokens, embed = hidden.shape
    vocab = unembedding.shape[1]  # padded: a whole number of chunks
    chunk, block_tokens, block_vocab = static.chunk, static.block_tokens, static.block_vocab

    def d_logits_of(chunk_index):
        columns = lax.dynamic_slice_in_dim(unembedding, chunk_index * chunk, chunk, axis=1)
        # Vocab ids of this chunk start at chunk_index * chunk: shift the labels instead.
        shifted = labels - chunk_index * chunk
        return pl.pallas_call(
            functools.partial(_d_logits_kernel, static=static),
            grid=(tokens // block_tokens, chunk // block_vocab),
            in_specs=[
                pl.BlockSpec((block_tokens, embed), lambda i, j: (i, 0)),
                pl.BlockSpec((embed, chunk), lambda i, j: (0, 0)),
                pl.BlockSpec((block_tokens,), lambda i, j: (i,)),
                pl.BlockSpec((block_tokens,), lambda i, j: (i,)),
                pl.BlockSpec((block_tokens,), lambda i, j: (i,)),
            ],
            out_specs=pl.BlockSpec((block_tokens, block_vocab), lambda i, j: (i, j)),
            out_shape=jax.ShapeDtypeStruct((tokens, chunk), hidden.dtype),
            compiler_params=_params(static),
            interpret=static.interpret,
            name="cross_entropy_d_logits",
        )(hidden, columns, shifted, lse, dloss), columns

    def step(chunk_index, carry):
        d_hidden, d_unembedding = carry
        d_logits, columns = d_logits_of(chunk_index)  # [tokens, chunk]
        d_hidden = d_hidden + jnp.einsum(
            "tv,ev->te", d_logits, columns, preferred_element_type=jnp.float32
        )
        d_columns = jnp.einsum("te,tv->ev", hidden, d_logits, preferred_element_type=jnp.float32)
        d_unembedding = lax.dynamic_update_slice_in_dim(
            d_unembedding, d_columns.astype(d_unembedding.dtype), chunk_index * chunk, axis=1
        )
        return d_hidden, d_unembedding

    carry = (jnp.zeros((tokens, embed), jnp.float32), jnp.zeros_like(unembedding))
    d_hidden, d_unembedding = lax.fori_loop(0, vocab // chunk, step, carry)
    return d_hidden.astype(hidden.dtype), d_unembedding, None


def _merged_forward(hidden, unembedding, labels, static: _Static):
    """(lse, label logit) over the whole vocabulary: this shard's, merged across vocab_axis."""
    lse, label_logit = _forward(hidden, unembedding, labels, static)
    if static.vocab_axis is None:
        return lse, label_logit
    top = lax.pmax(lse, static.vocab_axis)
    lse = top + jnp.log(lax.psum(jnp.exp(lse - top), static.vocab_axis))
    return lse, lax.psum(label_logit, static.vocab_axis)  # only the label's shard adds to it


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _loss(hidden, unembedding, labels, static: _Static):
    lse, label_logit = _merged_forward(hidden, unembedding, labels, static)
    return lse - label_logit


def _loss_forward(hidden, unembedding, labels, static: _Static):
    lse, label_logit = _merged_forward(hidden, unembedding, labels, static)
    return lse - label_logit, (hidden, unembedding, labels, lse)


_loss.defvjp(_loss_forward, _backward)
