"""Per-token cross-entropy of the unembedding: XLA logits + optax, or the fused Pallas kernel
that never holds the logits (vocab-parallel per shard when `tensor` splits the vocabulary).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from msjax.ops.dispatch import resolved_impl
from msjax.ops.matmul import einsum
from msjax.ops.sharding import per_shard
from msjax.parallel.context import constrain, interpret_kernels, kernel_mesh
from pallas_kernels.cross_entropy import cross_entropy

HIDDEN = ("batch", "seq", None)  # the final norm's output: embed gathered whole in a kernel
UNEMBEDDING = (None, "vocab")  # FSDP gathers embed, as for any weight; vocab stays split
TOKENS = ("batch", "seq")


def logits(hidden: jax.Array, unembedding: jax.Array) -> jax.Array:
    """[batch, seq, embed] @ [embed, vocab] -> float32 logits, split along vocab."""
    out = einsum(
        "bse,ev->bsv", hidden, unembedding.astype(hidden.dtype), preferred_element_type=jnp.float32
    )
    return constrain(out, ("batch", "seq", "vocab"))


def token_losses(
    hidden: jax.Array,
    unembedding: jax.Array,
    targets: jax.Array,
    *,
    impl: str = "xla",
    pick_by_mask: bool = False,
) -> jax.Array:
    """-log softmax(hidden @ unembedding)[target] per token: [batch, seq] float32.

    `xla` materialises [batch, seq, vocab] float32 logits (split over `tensor` along vocab) and
    takes optax's cross-entropy of them. `pallas` streams the vocabulary through the fused kernel
    per shard; with the vocabulary split over `tensor`, the shards merge their partial
    log-sum-exps (vocab-parallel cross-entropy).

    pick_by_mask (`xla`): each target's logit is picked by a one-hot mask, not a gather: the same
    numbers, and what XLA's partitioner can split along a vocab split over `tensor` inside a
    branch of a shard_map manual over other axes (1F1B's loop), where the gather fails.
    """
    if resolved_impl(impl, "loss_impl") == "xla":
        token_logits = logits(hidden, unembedding)
        if not pick_by_mask:
            return optax.softmax_cross_entropy_with_integer_labels(token_logits, targets)
        mask = jax.nn.one_hot(targets, token_logits.shape[-1], dtype=token_logits.dtype)
        picked = jnp.sum(token_logits * mask, axis=-1)
        return jax.nn.logsumexp(token_logits, axis=-1) - picked
    mesh = kernel_mesh()
    vocab_axes = None if mesh is None else mesh.spec(("vocab",))[0]

    def local(hidden, unembedding, targets):
        batch, seq, embed = hidden.shape
        losses = cross_entropy(
            hidden.reshape(batch * seq, embed),
            unembedding,
            targets.reshape(batch * seq),
            vocab_axis=vocab_axes,
            interpret=interpret_kernels(),
        )
        return losses.reshape(batch, seq)

    unembedding = unembedding.astype(hidden.dtype)
    return per_shard(local, (HIDDEN, UNEMBEDDING, TOKENS), TOKENS)(hidden, unembedding, targets)
