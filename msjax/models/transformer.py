"""The Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention, scanned layers.

Parameters carry logical axis names (`embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `vocab`,
`layers`); activations are hinted with `constrain`. Nothing here knows about meshes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from msjax import ops
from msjax.config import ModelConfig
from msjax.models.attention import rotary_embedding
from msjax.models.moe import MoeMLP, MoeStats
from msjax.models.params import param as _param
from msjax.parallel.context import compute_weight, constrain, kernel_mesh

RESIDUAL = ("batch", "residual_seq", "act_embed")  # the stream between blocks
QUERY_AXES = ("batch", "seq", "heads", "head_dim")  # attention's queries
KEY_AXES = ("batch", "seq", "kv_heads", "head_dim")  # attention's keys (and values)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over x's last axis, computed in float32 (msjax.ops: the XLA reference or
    a kernel). `scale_axis` names the scale's logical axis, `axes` those of x."""

    def __init__(
        self,
        dim: int,
        eps: float,
        rngs: nnx.Rngs,
        impl: str = "xla",
        scale_axis: str = "embed",
        axes: tuple[str, ...] = RESIDUAL,
    ):
        self.scale = _param(rngs, nnx.initializers.ones, (dim,), (scale_axis,))
        self.eps = eps
        self.impl = impl
        self.axes = axes

    def __call__(self, x: jax.Array) -> jax.Array:
        return ops.rms_norm(x, self.scale[...], eps=self.eps, impl=self.impl, axes=self.axes)

    def add_and_normalize(self, x: jax.Array, residual: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(x + residual, its norm), fused into one pass by the kernel."""
        return ops.add_rms_norm(x, residual, self.scale[...], eps=self.eps, impl=self.impl)


def _placed_alike(axes: tuple[str, ...], other: tuple[str, ...]) -> bool:
    """Whether two logical axes map to the same mesh axes in the placement being traced."""
    placement = kernel_mesh()
    return placement is not None and placement.spec(axes) == placement.spec(other)


def _is_split(axes: tuple[str, ...]) -> bool:
    """Whether the placement being traced splits a logical axis over some mesh axis."""
    placement = kernel_mesh()
    if placement is None:
        return False
    sizes = placement.mesh.shape
    for part in placement.spec(axes):
        names = () if part is None else (part,) if isinstance(part, str) else part
        if any(sizes[name] > 1 for name in names):
            return True
    return False


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE and an optional sliding window."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        embed, head_dim = config.embed_dim, config.resolved_head_dim
        heads, kv_heads = config.num_heads, config.num_kv_heads
        init = nnx.initializers.normal(config.init_std)
        out_init = nnx.initializers.normal(config.init_std / (2 * config.num_layers) ** 0.5)
        self.query = _param(rngs, init, (embed, heads, head_dim), ("embed", "heads", "head_dim"))
        self.key = _param(
            rngs, init, (embed, kv_heads, head_dim), ("embed", "kv_heads", "head_dim")
        )
        self.value = _param(
            rngs, init, (embed, kv_heads, head_dim), ("embed", "kv_heads", "head_dim")
        )
        self.out = _param(rngs, out_init, (heads, head_dim, embed), ("heads", "head_dim", "embed"))
        if config.qk_norm:  # Qwen3: each head's queries and keys normalised over head_dim
            eps, impl = config.norm_eps, config.norm_impl
            self.query_norm = RMSNorm(head_dim, eps, rngs, impl, "head_dim", QUERY_AXES)
            self.key_norm = RMSNorm(head_dim, eps, rngs, impl, "head_dim", KEY_AXES)
        self.config = config

    def normalize_heads(self, query: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Queries and keys [batch, seq, (kv_)heads, head_dim] through their per-head RMSNorm
        (model.qk_norm, before RoPE), or as they are; the training pass and decoding share it."""
        if not self.config.qk_norm:
            return query, key
        return self.query_norm(query), self.key_norm(key)

    def _project(self, x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries [batch, seq, heads, head_dim], keys and values [batch, seq, kv_heads, head_dim].

        Where tensor parallelism splits the heads and each device holds whole groups of query
        heads with their kv head (tensor splits the kv heads as it splits the query heads), the
        three projections are one matmul over [embed, kv_heads, group + 2, head_dim] weights:
        its input's gradient is then one tensor-parallel all-reduce instead of three (Megatron's
        fused QKV).
        """
        query_weight = compute_weight(self.query[...], ("embed", "heads", "head_dim"), dtype)
        key_weight = compute_weight(self.key[...], ("embed", "kv_heads", "head_dim"), dtype)
        value_weight = compute_weight(self.value[...], ("embed", "kv_heads", "head_dim"), dtype)
        if not (_is_split(("heads",)) and _placed_alike(("heads",), ("kv_heads",))):
            return (
                jnp.einsum("bse,ehd->bshd", x, query_weight),
                jnp.einsum("bse,ehd->bshd", x, key_weight),
                jnp.einsum("bse,ehd->bshd", x, value_weight),
            )
        embed, heads, head_dim = query_weight.shape
        kv_heads = key_weight.shape[1]
        group = heads // kv_heads  # query head h reads kv head h // group

        def grouped(query: jax.Array, key: jax.Array, value: jax.Array) -> jax.Array:
            query = query.reshape(embed, kv_heads, group, head_dim)
            return jnp.concatenate([query, key[:, :, None], value[:, :, None]], axis=2)

        projected = _matmul_with_stacked_weights(
            "bse,ekgd->bskgd", x, grouped, query_weight, key_weight, value_weight
        )
        batch, seq = x.shape[:2]
        query = projected[:, :, :, :group].reshape(batch, seq, heads, head_dim)
        return query, projected[:, :, :, group], projected[:, :, :, group + 1]

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None
    ) -> jax.Array:
        dtype = x.dtype
        x = constrain(x, ("batch", "seq", "act_embed"))
        query, key, value = self._project(x, dtype)
        query = constrain(query, QUERY_AXES)
        key = constrain(key, KEY_AXES)
        value = constrain(value, ("batch", "seq", "kv_heads", "head_dim"))
        query, key = self.normalize_heads(query, key)
        query = rotary_embedding(query, positions, self.config.rope_theta)
        key = rotary_embedding(key, positions, self.config.rope_theta)
        attended = ops.attention(
            query,
            key,
            value,
            window=self.config.attention_window,
            segment_ids=segment_ids,
            impl=self.config.attention_impl,
        )  # [batch, seq, heads, head_dim]
        attended = constrain(attended, ("batch", "seq", "heads", "head_dim"))
        attended = checkpoint_name(attended, ATTENDED)  # what remat "attention" keeps
        return jnp.einsum(
            "bshd,hde->bse",
            attended,
            compute_weight(self.out[...], ("heads", "head_dim", "embed"), dtype),
        )


def _stack_gate_and_up(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jnp.stack([gate, up], axis=1)  # [embed, 2, mlp]


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        embed, hidden = config.embed_dim, config.mlp_dim
        init = nnx.initializers.normal(config.init_std)
        out_init = nnx.initializers.normal(config.init_std / (2 * config.num_layers) ** 0.5)
        self.gate = _param(rngs, init, (embed, hidden), ("embed", "mlp"))
        self.up = _param(rngs, init, (embed, hidden), ("embed", "mlp"))
        self.down = _param(rngs, out_init, (hidden, embed), ("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x = constrain(x, ("batch", "seq", "act_embed"))
        gate_weight = compute_weight(self.gate[...], ("embed", "mlp"), dtype)
        up_weight = compute_weight(self.up[...], ("embed", "mlp"), dtype)
        if _is_split(("mlp",)) or not _is_split(("embed",)):
            # gate and up as one matmul of twice the width: under tensor parallelism its input's
            # gradient is one all-reduce, not two; with whole weights a CPU step runs about 20%
            # faster. It keeps one more [batch, seq, mlp] per layer (remat none). Weights that
            # fsdp gathers stay apart: stacked, their gradient was reduced in a narrower compute
            # dtype, a pipeline's gathers moved other bytes than msjax.plan counts
            # (tests/unit/test_weight_gather.py), and at fsdp 8 on a CPU it gained 2%.
            projected = _matmul_with_stacked_weights(
                "bse,ekm->bskm", x, _stack_gate_and_up, gate_weight, up_weight
            )  # [batch, seq, 2, mlp]
            gate, up = projected[:, :, 0], projected[:, :, 1]
        else:
            gate = jnp.einsum("bse,em->bsm", x, gate_weight)
            up = jnp.einsum("bse,em->bsm", x, up_weight)
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))  # [batch, seq, mlp]
        return jnp.einsum(
            "bsm,me->bse", hidden, compute_weight(self.down[...], ("mlp", "embed"), dtype)
        )


class Block(nnx.Module):
    """One decoder layer, sequential (pre-norm) or parallel (MegaScale §3.1); with `moe` its MLP
    is a mixture of experts (msjax.models.moe)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
        self.attention_norm = RMSNorm(config.embed_dim, config.norm_eps, rngs, config.norm_impl)
        self.attention = Attention(config, rngs)
        if not config.parallel_block:
            self.mlp_norm = RMSNorm(config.embed_dim, config.norm_eps, rngs, config.norm_impl)
        self.mlp = MoeMLP(config, rngs) if moe else MLP(config, rngs)
        self.moe = moe
        self.parallel = config.parallel_block

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None
    ) -> jax.Array:
        return self.with_moe_stats(x, positions, segment_ids)[0]

    def with_moe_stats(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None
    ) -> tuple[jax.Array, MoeStats | None]:
        """The layer's output, and its MoE statistics (None in a dense layer)."""
        if self.parallel:
            # MegaScale §3.1: y = x + Attn(LN(x)) + MLP(LN(x)); one norm feeds both branches.
            normed = self.attention_norm(x)
            mlp_out, stats = self._mlp(normed)
            x = x + self.attention(normed, positions, segment_ids) + mlp_out
        else:
            attended = self.attention(self.attention_norm(x), positions, segment_ids)
            x, normed = self.mlp_norm.add_and_normalize(x, attended)  # x + attn, LN(x + attn)
            x = constrain(x, RESIDUAL)
            mlp_out, stats = self._mlp(normed)
            x = x + mlp_out
        return constrain(x, RESIDUAL), stats

    def _mlp(self, normed: jax.Array) -> tuple[jax.Array, MoeStats | None]:
        return self.mlp(normed) if self.moe else (self.mlp(normed), None)


LAYER_INPUT = "layer_input"  # each layer's input, named: all that remat full keeps of a layer
ATTENDED = "attended"  # attention's output, before the output projection
_REMAT_POLICIES = {
    "full": None,  # save nothing, recompute the whole block
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # the projections and MLP matmuls (no batch dims) and attention's output: the backward
    # recomputes only the attention scores and their softmax
    "attention": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(ATTENDED),
    ),
}
# Ops that only move, select or relabel what they read: recomputing them costs no FLOPs
_RELAYOUT_PRIMITIVES = frozenset(
    {
        "broadcast_in_dim",
        "concatenate",
        "convert_element_type",
        "copy",
        "dynamic_slice",
        "gather",
        "reshape",
        "sharding_constraint",
        "slice",
        "squeeze",
        "transpose",
    }
)


def _saves_all_but_relayouts(primitive: Any, *_: Any, **__: Any) -> bool:
    return primitive.name not in _RELAYOUT_PRIMITIVES


def _matmul_with_stacked_weights(
    spec: str, x: jax.Array, stack: Callable[..., jax.Array], *weights: jax.Array
) -> jax.Array:
    """einsum(spec, x, stack(*weights)) with the stacked weights built again in the backward pass.

    Autodiff would keep the stacked copy of every layer's weights for the backward pass; the
    weights themselves are kept anyway (they are the layer scan's inputs), and stacking them
    again only moves bytes.
    """

    def matmul(x: jax.Array, *weights: jax.Array) -> jax.Array:
        return jnp.einsum(spec, x, stack(*weights))

    return jax.checkpoint(matmul, policy=_saves_all_but_relayouts)(x, *weights)


def enclosing_checkpoint_policy(remat: str) -> Callable[..., bool]:
    """The policy for a `jax.checkpoint` around code that runs the layer stack (a pipeline stage
    with its weights selected inside it) under which the stack keeps what `remat` keeps.

    An enclosing checkpoint's policy decides for everything inside it, the layers' own remat
    included: under "full", "dots" and "attention" it keeps the layer inputs (inside a pipeline
    stage's vmap every matmul has a batch dimension, so "dots" keeps no more, nor does
    "attention" keep more than them); under "none" everything but
    re-layouts of other values, which are recomputed from what they read (weights selected by
    an index are then recomputed from the index instead of being kept).
    """
    if remat == "none":
        return _saves_all_but_relayouts
    return jax.checkpoint_policies.save_only_these_names(LAYER_INPUT)


class Transformer(nnx.Module):
    """Decoder-only language model; `layers` are stacked and run by `nnx.scan`."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        # Parameters carry logical names only; where they live is decided outside the model
        # (msjax.parallel creates them inside a jit with explicit output shardings).
        with nnx.use_eager_sharding(False):
            self._build(config, rngs)

    def _build(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        self.config = config
        embed_init = nnx.initializers.normal(config.init_std)
        self.embedding = _param(
            rngs, embed_init, (config.vocab_size, config.embed_dim), ("vocab", "embed")
        )

        # dense layers first, then MoE layers: one stack to scan, or two
        for name, count, moe in config.moe.layer_stacks(config.num_layers):
            setattr(self, name, _stacked_blocks(config, count, moe, rngs))
        self.final_norm = RMSNorm(config.embed_dim, config.norm_eps, rngs, config.norm_impl)
        if not config.tied_embeddings:
            self.unembedding = _param(
                rngs, embed_init, (config.embed_dim, config.vocab_size), ("embed", "vocab")
            )

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """tokens: [batch, seq] int -> logits [batch, seq, vocab] in float32."""
        return ops.logits(self.features(tokens, positions, segment_ids), self.unembedding_matrix())

    def unembedding_matrix(self) -> jax.Array:
        """[embed, vocab] in the compute dtype: the embedding table's transpose when tied."""
        dtype = jnp.dtype(self.config.compute_dtype)
        if self.config.tied_embeddings:
            return compute_weight(self.embedding[...], ("vocab", "embed"), dtype).T
        return compute_weight(self.unembedding[...], ("embed", "vocab"), dtype)

    def features(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """tokens: [batch, seq] int -> the final norm's output [batch, seq, embed], compute dtype.

        The logits are features @ unembedding_matrix(); a fused loss takes the two apart.
        """
        return self.features_with_moe_stats(tokens, positions, segment_ids)[0]

    def features_with_moe_stats(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, MoeStats | None]:
        """`features`, and the MoE layers' statistics stacked over them (None when dense)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x, remat, loop = self.embed(tokens), self.config.remat, self.config.layer_loop
        if not self.config.moe.enabled:
            x = apply_layer_stack(self.layers, x, positions, segment_ids, remat, layer_loop=loop)
            return self.finish(x), None
        if self.config.moe.first_dense_layers:
            x = apply_layer_stack(
                self.dense_layers, x, positions, segment_ids, remat, layer_loop=loop
            )
        x, stats = apply_layer_stack(
            self.moe_layers, x, positions, segment_ids, remat, True, layer_loop=loop
        )
        return self.finish(x), stats

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens: [batch, seq] int -> the residual stream [batch, seq, embed], compute dtype."""
        dtype = jnp.dtype(self.config.compute_dtype)
        # The table is gathered whole along embed (as FSDP does for every weight) and stays
        # split along vocab, so the lookup is a local gather plus a sum over `tensor`.
        table = compute_weight(self.embedding[...], ("vocab", "embed"), dtype)
        table = constrain(table, ("vocab", "act_embed"))
        x = jnp.take(table, tokens, axis=0)  # [batch, seq, embed]
        return constrain(x, RESIDUAL)

    def finish(self, x: jax.Array) -> jax.Array:
        """The layer stack's output [batch, seq, embed] -> the final norm's output."""
        return constrain(self.final_norm(x), ("batch", "seq", "act_embed"))


def _stacked_blocks(config: ModelConfig, count: int, moe: bool, rngs: nnx.Rngs) -> Block:
    """`count` blocks with their parameters stacked along "layers" (MoE blocks with `moe`)."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_layers(rngs: nnx.Rngs) -> Block:
        return Block(config, rngs, moe)

    return make_layers(rngs)


def apply_layer_stack(
    layers: Block,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    remat: str = "none",
    with_moe_stats: bool = False,
    layer_loop: str = "scan",
) -> Any:
    """Run a stack of blocks (parameters stacked along "layers") over x [batch, seq, embed].

    This is the model's layer stack as a function of (layer parameters, activations): the
    whole model runs it over all layers, a pipeline stage over its own slice of them. With
    `with_moe_stats` (a stack of MoE blocks) it returns (x, MoeStats stacked over the layers).
    layer_loop: scan (one loop body) or unroll (each layer its own code; the same values);
    `auto`, unresolved, scans.
    """

    def layer(block: Block, x: jax.Array) -> Any:
        if with_moe_stats:
            return block.with_moe_stats(x, positions, segment_ids)
        return block(x, positions, segment_ids)

    if remat != "none":  # unrolled, XLA would merge the recomputation with the forward (CSE)
        unrolled = layer_loop == "unroll"
        layer = nnx.remat(layer, policy=_REMAT_POLICIES[remat], prevent_cse=unrolled)

    @nnx.scan(
        in_axes=(nnx.Carry, 0),
        out_axes=(nnx.Carry, 0) if with_moe_stats else nnx.Carry,
        transform_metadata={nnx.PARTITION_NAME: "layers"},
        unroll=layer_loop == "unroll",
    )
    def run_layers(x: jax.Array, block: Block) -> Any:
        return layer(block, checkpoint_name(x, LAYER_INPUT))

    return run_layers(x, layers)
