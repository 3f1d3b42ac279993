"""The compiled train and eval steps, and the train state created already sharded.

Everything here is pure: a step maps (state, batch) to (state, metrics) as one `jax.jit` program
with explicit input and output shardings and a donated state. The state's layout (its arrays and
their logical axes) is `msjax.state_layout`'s, its shardings on the mesh are made here
(`build_program`); the loop that feeds the step lives in `msjax.train`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from msjax import ops
from msjax.batch import BATCH_FIELDS
from msjax.config import Config
from msjax.models import moe as moe_layers
from msjax.models.transformer import Transformer, apply_layer_stack, enclosing_checkpoint_policy
from msjax.optim import advance_schedule, learning_rate_schedule, stacked_over_layers
from msjax.parallel.context import WeightGather, constrain, use_weight_gather
from msjax.parallel.microbatches import (
    arrange_microbatches,
    cells_to_rows,
    split_microbatches,
    streams_to_rows,
)
from msjax.parallel.one_f_one_b import one_f_one_b_loss
from msjax.parallel.pipeline import (
    PipelineLayout,
    Replicas,
    StageFunction,
    gathers_stage_weights_once,
    rows_to_streams,
    run_streams,
    to_canonical_order,
    to_memory_order,
)
from msjax.parallel.rules import (
    activation_placement,
    gathered_stage_weights,
    logical_axis_rules,
    logical_to_spec,
    placement_within_replica,
    shardings_for,
    split_over_pipe,
    weight_gather,
)
from msjax.state_layout import Batch, Params, TrainState, state_layout


def update_is_finite(loss: jax.Array, grad_norm: jax.Array) -> jax.Array:
    """bool scalar: the loss and every gradient (through their norm; it overflows before any
    square does) are finite, which keeps moments and parameters finite (an AdamW or LAMB update
    is bounded by the learning rate): the update's one predicate, no pass over the state."""
    return jnp.isfinite(loss) & jnp.isfinite(grad_norm)


def skipped_step(state: TrainState) -> TrainState:
    """The state after a skipped step: the same parameters and moments; step + 1, and the
    learning-rate schedule with it, so later steps get the rates they would have had."""
    return dataclasses.replace(
        state, step=state.step + 1, opt_state=advance_schedule(state.opt_state)
    )


@functools.partial(jax.jit, donate_argnums=0)
def skip_update(state: TrainState) -> TrainState:
    """skipped_step on its own, for a step whose batch is dropped (msjax.resilience.skips)."""
    return skipped_step(state)


def real_token_weights(batch: Batch) -> jax.Array:
    """[batch, seq] float32: 1 for a real token, 0 for padding (segment id 0)."""
    return (batch["segment_ids"] != 0).astype(jnp.float32)


def real_token_count(batch: Batch) -> jax.Array:
    """float32 scalar: the real tokens of a batch, at least 1; every loss divides by it."""
    return jnp.maximum(jnp.sum(real_token_weights(batch)), 1.0)


def microbatched(
    value_and_grad: Any,
    steps: int,
    microbatch_sharding: NamedSharding | None = None,
    grad_shardings: Any = None,
    value_zeros: Any = None,  # where the values' sum starts when they are a tree (MoE stats)
) -> Any:
    """`value_and_grad(params, batch, *rest) -> (value, grads)` run on `steps` microbatches of
    the batch one after another (a scan), their values and gradients summed in float32.

    The sum is the whole batch's only when each microbatch's value is its share of it: a loss
    divided by the whole batch's token count, not its own mean (Levanter's `microbatched`
    averages instead, which weights a padded microbatch wrong). Microbatch i takes rows i,
    i + steps, ..., so each data-parallel replica's rows (a contiguous block) feed every
    microbatch and the split moves no data between devices; only one microbatch's activations
    are alive at a time, beside a float32 accumulator of the gradients. `microbatch_sharding`
    places a [batch / steps, seq] microbatch, `grad_shardings` the accumulator.
    """
    if steps == 1:
        return value_and_grad

    def accumulated(params: Params, batch: Batch, *rest: Any) -> tuple[jax.Array, Params]:
        def split(array: jax.Array) -> jax.Array:
            microbatches = split_microbatches(array, steps)  # [steps, batch / steps, seq]
            if microbatch_sharding is None:
                return microbatches
            spec = PartitionSpec(None, *microbatch_sharding.spec)
            return jax.lax.with_sharding_constraint(
                microbatches, NamedSharding(microbatch_sharding.mesh, spec)
            )

        def float32_zeros(like: jax.Array) -> jax.Array:
            return jnp.zeros(like.shape, jnp.float32)

        grads = jax.tree.map(float32_zeros, params)
        if grad_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        total = (jnp.zeros((), jnp.float32) if value_zeros is None else value_zeros, grads)

        def add_microbatch(total: Any, microbatch: Batch) -> tuple[Any, None]:
            value_and_grads = value_and_grad(params, microbatch, *rest)
            added = jax.tree.map(
                lambda sum_, part: sum_ + part.astype(jnp.float32), total, value_and_grads
            )
            return added, None

        total, _ = jax.lax.scan(add_microbatch, total, jax.tree.map(split, batch))
        return total

    return accumulated


@dataclass(frozen=True)
class UpdateStep:
    """One optimizer step, built with what it needs: the loss and its gradients summed over the
    microbatches, the optimizer and the learning-rate schedule (TrainProgram.train_step jits it)."""

    loss_and_grads: Any  # (params, batch, real tokens) -> (loss, grads)
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    moe: moe_layers.MoeConfig | None = None  # with experts: values (objective, (loss, stats))

    def train_step(
        self, state: TrainState, batch: Batch
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """The state after one update on a global batch, and the step's metrics. Where the update
        is not finite the state is a skipped step's: a conditional on the one predicate, so a
        non-finite update is never applied nor saved, and no select or check passes over the
        parameters and moments (the state of a rollback's skip of that step)."""
        # every microbatch's loss is divided by the whole batch's real tokens, so the sum over
        # microbatches is the whole batch's mean, however the padding falls among them
        value, grads = self.loss_and_grads(state.params, batch, real_token_count(batch))
        objective, (loss, moe_stats) = value if self.moe else (value, (value, None))
        grad_norm = optax.tree.norm(grads)
        update_finite = update_is_finite(objective, grad_norm)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": self.schedule(state.step),
            "update_finite": update_finite,
        }
        if self.moe is not None:  # the objective's gradient, the cross-entropy's value reported
            metrics |= moe_layers.moe_metrics(moe_stats) | {"moe_aux_loss": objective - loss}

        def update(state: TrainState) -> TrainState:
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            if self.moe is not None:
                params = moe_layers.balance_routing_bias(params, moe_stats, self.moe)
            return dataclasses.replace(
                state, step=state.step + 1, params=params, opt_state=opt_state
            )

        return jax.lax.cond(update_finite, update, skipped_step, state), metrics


@dataclass
class TrainProgram:
    """The model's structure, the shardings of every array, and the compiled steps of one run."""

    config: Config
    mesh: Mesh
    graphdef: nnx.GraphDef
    abstract_params: nnx.State
    logical_axes: Any
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    state_shardings: TrainState
    batch_sharding: NamedSharding

    @functools.cached_property
    def train_step(self) -> Any:
        """`UpdateStep.train_step` jitted: (state, batch) -> (state, metrics), state donated."""
        moe = self.config.model.moe if self.config.model.moe.enabled else None
        objective = self.loss_share if moe is None else self.moe_objective_share
        loss_and_grads = microbatched(
            jax.value_and_grad(objective, has_aux=moe is not None),
            self.config.train.grad_accum_steps,
            microbatch_sharding=self.batch_sharding,
            grad_shardings=self.state_shardings.params,
            value_zeros=None if moe is None else moe_layers.zero_objective(self.config.model),
        )
        update = UpdateStep(loss_and_grads, self.optimizer, self.schedule, moe)
        batch_shardings = dict.fromkeys(BATCH_FIELDS, self.batch_sharding)
        return jax.jit(
            update.train_step,
            in_shardings=(self.state_shardings, batch_shardings),
            out_shardings=(self.state_shardings, NamedSharding(self.mesh, PartitionSpec())),
            donate_argnums=(0,),
        )

    @functools.cached_property
    def eval_step(self) -> Any:
        """`loss` jitted: (params, batch) -> the batch's mean loss."""
        batch_shardings = dict.fromkeys(BATCH_FIELDS, self.batch_sharding)
        return jax.jit(
            self.loss,
            in_shardings=(self.state_shardings.params, batch_shardings),
            out_shardings=NamedSharding(self.mesh, PartitionSpec()),
        )

    def model(self, params: Params) -> Transformer:
        """A model object bound to params (usable inside jitted code)."""
        state = jax.tree.map(lambda leaf: leaf, self.abstract_params)  # fresh containers
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    @property
    def pipeline(self) -> PipelineLayout:
        return PipelineLayout.of(self.config)

    def _pipelined_summed_loss(
        self, model: Transformer, batch: Batch, weights: WeightGather
    ) -> jax.Array:
        """The summed loss with the layer stack as a GPipe or circular pipeline: the embedding,
        the loss head and the loss each run on 1 / P of the tokens per pipe rank, the tokens a
        stage holds in its streams (msjax.parallel.pipeline.run_streams)."""
        layout = self.pipeline
        stages, count = layout.stages, layout.microbatches
        split_rules = split_over_pipe(logical_axis_rules(self.config))

        def rows(array: jax.Array, cells: Any) -> jax.Array:
            """[batch, seq] -> [stages * microbatch * slots, seq] as the stages hold them."""
            arranged = cells_to_rows(arrange_microbatches(array, cells, count), stages)
            return constrain(arranged, ("batch", "seq"))

        with activation_placement(self.mesh, split_rules, weights):
            x = model.embed(rows(batch["inputs"], layout.input_cells()))  # [rows, seq, embed]
        stage, layer_params = self._stage_function(model)
        outputs = run_streams(
            stage,
            layer_params,
            rows_to_streams(x, layout),  # [stages, slots, microbatch, seq, embed]
            batch["positions"],
            batch["segment_ids"],
            layout,
            checkpoint_policy=enclosing_checkpoint_policy(self.config.model.remat),
            replicas=self._replicas,
        )
        with activation_placement(self.mesh, split_rules, weights):
            finished = layout.output_cells()
            losses = ops.token_losses(
                model.finish(streams_to_rows(outputs)),
                model.unembedding_matrix(),
                rows(batch["targets"], finished),
                impl=self.config.model.loss_impl,
            )  # [rows, seq]
            return jnp.sum(losses * rows(real_token_weights(batch), finished))

    @property
    def _replicas(self) -> Replicas:
        """The copies of its stage's weights a pipeline loop works on: one per data-parallel
        replica, and per fsdp rank too where the weights are whole before the loop."""
        mesh = self.config.mesh
        if gathers_stage_weights_once(self.config):
            return Replicas(mesh.data * mesh.fsdp, ("data", "fsdp"))
        return Replicas(mesh.data, ("data",))

    def _stage_function(self, model: Transformer) -> tuple[StageFunction, nnx.State]:
        """(a pipeline stage's function of its layers' parameters, the stacked layer params:
        under `pipeline.fsdp_gather=once` gathered over fsdp here, before the loop, and cast to
        the compute dtype where the stage uses them, without a gather)."""
        layers_graphdef, layer_params = nnx.split(model.layers)
        remat, loop = self.config.model.remat, self.config.model.layer_loop
        rules = logical_axis_rules(self.config)
        replica_axes, gathered = self._replicas.axes, gathers_stage_weights_once(self.config)
        if gathered:
            reduce_dtype = self.config.optim.grad_reduce_dtype
            layer_params = gathered_stage_weights(layer_params, self.mesh, rules, reduce_dtype)

        def stage(chunk: Any, x: jax.Array, positions: jax.Array, segment_ids: Any) -> jax.Array:
            """One replica's share of a stage's work (vmapped over replicas)."""
            layers = nnx.merge(layers_graphdef, chunk)
            with (
                placement_within_replica(self.mesh, rules, replica_axes),
                use_weight_gather(None) if gathered else contextlib.nullcontext(),
            ):
                return apply_layer_stack(layers, x, positions, segment_ids, remat, layer_loop=loop)

        return stage, layer_params

    def _one_f_one_b_summed_loss(
        self, model: Transformer, params: Params, batch: Batch
    ) -> jax.Array:
        """The sum of real tokens' losses, its gradient computed by the 1F1B loop."""
        stage, layer_params = self._stage_function(model)
        rules = logical_axis_rules(self.config)
        unembedding = "embedding" if self.config.model.tied_embeddings else "unembedding"
        head_params = {name: params[name] for name in ("final_norm", unembedding)}
        loss_impl = self.config.model.loss_impl
        replicas = self._replicas

        def head(
            head_params: Params, x: jax.Array, targets: jax.Array, weights: jax.Array
        ) -> jax.Array:
            # one data-parallel replica's rows (vmapped over replicas, as the stages); the head
            # reads only these parameters, the model's others stay abstract
            with placement_within_replica(self.mesh, rules, replicas.axes):
                head_model = self.model(head_params)
                features = head_model.finish(x)
                losses = ops.token_losses(
                    features,
                    head_model.unembedding_matrix(),
                    targets,
                    impl=loss_impl,
                    pick_by_mask=True,  # it runs in a branch of the loop's shard_map
                )
            return jnp.sum(losses * weights)

        summed_loss = one_f_one_b_loss(stage, head, self.pipeline, self.mesh, replicas)
        labels = (
            batch["targets"],
            real_token_weights(batch),
            batch["positions"],
            batch["segment_ids"],
        )
        return summed_loss(layer_params, head_params, model.embed(batch["inputs"]), labels)

    def summed_loss(self, params: Params, batch: Batch, with_moe_stats: bool = False) -> Any:
        """float32 scalar: the sum of the batch's real tokens' losses (and with_moe_stats, no
        pipeline: the MoE layers' statistics, moe_layers.MoeStats, None when dense)."""
        rules = logical_axis_rules(self.config)
        weights = weight_gather(self.mesh, rules, self.config.optim.grad_reduce_dtype)
        with activation_placement(self.mesh, rules, weights):
            model = self.model(params)
            layout = self.pipeline
            if layout.stages > 1 and layout.interleaves_backward:
                return self._one_f_one_b_summed_loss(model, params, batch)
            if layout.stages > 1:
                return self._pipelined_summed_loss(model, batch, weights)
            inputs, positions = batch["inputs"], batch["positions"]
            features, stats = model.features_with_moe_stats(inputs, positions, batch["segment_ids"])
            losses = ops.token_losses(
                features,
                model.unembedding_matrix(),
                batch["targets"],
                impl=self.config.model.loss_impl,
            )  # [batch, seq]
        summed = jnp.sum(losses * real_token_weights(batch))
        return (summed, stats) if with_moe_stats else summed

    def moe_objective_share(self, params: Params, batch: Batch, token_count: jax.Array) -> Any:
        """(the batch's share of the loss plus the weighted MoE auxiliary losses, (its share of
        the loss, its MoE statistics with the scalars weighted by its share of the tokens))."""
        summed, stats = self.summed_loss(params, batch, with_moe_stats=True)
        share = real_token_count(batch) / token_count
        loss = summed / token_count
        aux = share * moe_layers.moe_aux_loss(stats, self.config.model.moe)
        return loss + aux, (loss, moe_layers.stats_share(stats, share))

    def loss_share(self, params: Params, batch: Batch, token_count: jax.Array) -> jax.Array:
        """The batch's share of a mean loss over `token_count` real tokens (its own, or those of
        the whole batch it is a microbatch of): the one place a loss is averaged."""
        return self.summed_loss(params, batch) / token_count

    def loss(self, params: Params, batch: Batch) -> jax.Array:
        """The mean loss over the batch's real tokens."""
        return self.loss_share(params, batch, real_token_count(batch))

    def init_state(self) -> TrainState:
        """Parameters and optimizer state created directly in their shards."""
        seed = self.config.run.seed

        def init() -> TrainState:
            model = Transformer(self.config.model, nnx.Rngs(params=seed))
            params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            # the same values whatever the layout: created in canonical order, then placed
            params = self._reorder_layers(params, to_memory_order)
            return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params))

        with nnx.use_eager_sharding(False):
            return jax.jit(init, out_shardings=self.state_shardings)()

    def _reorder_layers(self, tree: Any, reorder: Any) -> Any:
        """params (or the optimizer state holding trees like them) with reorder(array, layout)
        applied to each array stacked over layers."""
        layout, stacked = self.pipeline, stacked_over_layers(self.logical_axes)

        def one(array: jax.Array, is_stacked: bool) -> jax.Array:
            return reorder(array, layout) if is_stacked else array

        if isinstance(tree, dict):
            return jax.tree.map(one, tree, stacked)
        # optimizer moments follow the parameters' layout, layer by layer
        return optax.tree_map_params(self.optimizer, one, tree, stacked)

    def to_canonical(self, state: TrainState) -> TrainState:
        """The state with every layer-stacked array in canonical layer order (what checkpoints
        hold, whatever the pipeline layout); the state itself when the layouts agree."""
        if not self.pipeline.reorders_layers:
            return state
        return self._layer_order_converters[0](state)

    def from_canonical(self, state: TrainState) -> TrainState:
        """The inverse of to_canonical: a restored state in this run's pipeline layer order."""
        if not self.pipeline.reorders_layers:
            return state
        return self._layer_order_converters[1](state)

    @functools.cached_property
    def _layer_order_converters(self) -> tuple[Any, Any]:
        """(to canonical, to memory) order, each jitted once: every save converts."""

        def converter(reorder: Any) -> Any:
            def convert(state: TrainState) -> TrainState:
                return TrainState(
                    state.step,
                    self._reorder_layers(state.params, reorder),
                    self._reorder_layers(state.opt_state, reorder),
                )

            return jax.jit(convert, out_shardings=self.state_shardings)

        return converter(to_canonical_order), converter(to_memory_order)

    def state_from_params(self, params: Params) -> TrainState:
        """A step-0 state around given (already sharded) parameters in canonical layer order:
        fresh optimizer state."""

        def init(params: Params) -> TrainState:
            params = self._reorder_layers(params, to_memory_order)
            return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params))

        return jax.jit(init, out_shardings=self.state_shardings)(params)

    def abstract_batch(self) -> Batch:
        """Shapes and shardings of one global batch: [global_batch, seq_len] int32 arrays (no
        process ever holds a whole one)."""
        shape = (self.config.train.global_batch, self.config.data.seq_len)
        return {
            key: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)
            for key in BATCH_FIELDS
        }

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state, without allocating it."""
        shapes = jax.eval_shape(self.init_state)
        return jax.tree.map(
            lambda shape, sharding: jax.ShapeDtypeStruct(
                shape.shape, shape.dtype, sharding=sharding
            ),
            shapes,
            self.state_shardings,
        )


def build_program(config: Config, mesh: Mesh) -> TrainProgram:
    """Shardings for state and batches, the optimizer, and the jitted train and eval steps."""
    layout = state_layout(config.model, config.optim, config.train.steps)
    schedule = learning_rate_schedule(config.optim, config.train.steps)
    rules = logical_axis_rules(config)
    # the step counter replicated; parameters and optimizer state as their logical axes say
    state_shardings = TrainState(
        NamedSharding(mesh, PartitionSpec()),
        shardings_for(layout.param_axes, mesh, rules),
        jax.tree.map(
            lambda axes: NamedSharding(mesh, logical_to_spec(axes.names, rules)),
            layout.opt_state_axes,
        ),
    )
    batch_sharding = NamedSharding(mesh, PartitionSpec(rules["batch"], None))
    return TrainProgram(
        config=config, mesh=mesh, graphdef=layout.graphdef, abstract_params=layout.abstract_params,
        logical_axes=layout.param_axes, optimizer=layout.optimizer, schedule=schedule,
        state_shardings=state_shardings, batch_sharding=batch_sharding,
    )  # fmt: skip
