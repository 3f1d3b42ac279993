"""The steps as the loop runs them: the compiled train step with resilience's hooks around it (a
skipped step, a drill's batch or state), and the evaluation over the validation batches."""

from __future__ import annotations

from typing import Any

from msjax.resilience.worker import StepHooks
from msjax.step import skip_update


class LoopSteps:
    """The train and eval steps of one run, built with what they need: the compiled train step,
    the jitted eval step, the validation batches on the devices, and the one handle through
    which resilience reaches a step (`StepHooks`)."""

    def __init__(
        self,
        compiled_train_step: Any,
        eval_step: Any,
        validation: list[dict[str, Any]],
        batch_sharding: Any,
        hooks: StepHooks,
    ):
        """validation: the host's batches, put on the devices here as batch_sharding lays out
        a batch."""
        import jax

        self.compiled_train_step = compiled_train_step  # (state, batch) -> (state, metrics)
        self.eval_step = eval_step  # (params, batch) -> loss
        self.validation = [jax.device_put(batch, batch_sharding) for batch in validation]
        self.hooks = hooks

    def skips(self, step: int) -> bool:
        """Whether step `step` is skipped: its batch is drawn and dropped (a rollback)."""
        return self.hooks.skips(step)

    def skip(self, state: Any) -> Any:
        """The state after a skipped step: the step counter moves, nothing else."""
        return skip_update(state)

    def train(self, step: int, state: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
        """Dispatch step `step` on `batch`: the new state (as this rank holds it, where a drill
        may change it) and the step's metrics, still on the devices."""
        batch = self.hooks.batch(step, batch)
        state, device_metrics = self.compiled_train_step(state, batch)
        return self.hooks.after_update(step, state), device_metrics

    def eval_loss(self, params: Any) -> float:
        """The mean loss of `params` over the validation batches."""
        import jax

        losses = [self.eval_step(params, batch) for batch in self.validation]
        return float(sum(jax.device_get(losses)) / len(losses))
