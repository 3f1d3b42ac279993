"""The loop's checkpoints: where a run starts (restored or fresh), and its saves with their
record of the data position, reported to the loop's listeners."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msjax import __version__
from msjax.checkpoint.manager import DAMAGED_DIR, Checkpointer, Restored
from msjax.config import Config, config_from_dict
from msjax.data.identity import corpus_changes
from msjax.errors import MsjaxError
from msjax.loop_events import LoopEvents
from msjax.resilience.worker import SavesFailing
from msjax.run_dir import differences


@dataclass(frozen=True)
class StartingPoint:
    """The state a run starts from, and where in the data order it stands."""

    state: Any
    step: int
    first_sample: int  # the global sample position of the first batch this run draws
    restored: Restored | None


ResumeSource = tuple[Path, int | None]  # checkpoint.resume_from parsed: a directory, its STEP


def restore_or_init(
    config: Config,
    checkpointer: Checkpointer,
    program: Any,
    abstract_state: Any,
    message: Callable[[str], None],
    resume: ResumeSource | None = None,
) -> StartingPoint:
    """The newest valid checkpoint (of this run, or of `resume` on its first start), else a new
    state: from model.init_from, or initialized; never a new state where checkpoints exist but
    none restores (refuse_silent_restart).

    resume: checkpoint.resume_from as msjax.training.prepare.resume_source parsed it, or None
    where it does not apply.
    """
    import jax

    restored = restore_start(config, checkpointer, abstract_state, message, resume)
    if restored is None:
        refuse_silent_restart(config, checkpointer, message)  # whatever the new state would be
        if config.model.init_from is not None:
            return StartingPoint(init_from_hf(config, program, message), 0, 0, None)
        return StartingPoint(program.init_state(), 0, 0, None)
    check_same_model(config, restored)
    message(f"resumed from {restored.path} (step {restored.step})")
    step = int(jax.device_get(restored.state.step))
    # The data position is a global sample position, independent of processes and workers.
    samples_seen = restored.meta.get("data", {}).get("samples_seen")
    first_sample = step * config.train.global_batch if samples_seen is None else int(samples_seen)
    # checkpoints hold layers in canonical order; this run's pipeline may keep another
    state = program.from_canonical(restored.state)
    return StartingPoint(state, step, first_sample, restored)


def restore_start(
    config: Config,
    checkpointer: Checkpointer,
    abstract_state: Any,
    message: Callable[[str], None],
    resume: ResumeSource | None,
) -> Restored | None:
    """This run's newest valid checkpoint; while it has none of its own, `resume`'s.

    Every process lists the run's own checkpoints alike (else CheckpointUnreadable), so all
    take the same source. A named STEP of `resume` restores as itself or not at all.
    """
    own = checkpointer.agreed_listing(context=f"resume={resume is not None}")
    if resume is None or own.steps or own.damaged:
        if config.checkpoint.resume_from:
            message(
                f"checkpoint.resume_from={config.checkpoint.resume_from} applies to a run's "
                f"first start only; this run resumes from its own checkpoints in "
                f"{checkpointer.directory}"
            )
        return checkpointer.restore_newest_valid(abstract_state, message)
    directory, step = resume
    source = Checkpointer(directory, config.checkpoint, read_only=True)
    where = f"checkpoint.resume_from={config.checkpoint.resume_from}"
    try:
        if step is None:
            restored = source.restore_newest_valid(abstract_state, message)
            if restored is None:
                raise MsjaxError(f"{where}: no valid checkpoint in {directory}")
            return restored
        try:
            return source.restore_named(step, abstract_state)
        except MsjaxError as error:
            raise MsjaxError(
                f"{where}: {error}; an older step is not taken in its place: name another "
                f"step, or {directory} alone for its newest valid one"
            ) from None
    finally:
        source.close()


def init_from_hf(config: Config, program: Any, message: Callable[[str], None]) -> Any:
    """A fresh state whose parameters are read, shard by shard, from model.init_from."""
    from msjax.checkpoint.hf_weights import load_params
    from msjax.llama_config import hf_directory

    directory = hf_directory(config.model.init_from)
    params = load_params(directory, config.model, program.state_shardings.params)
    message(f"initialized from the Hugging Face weights in {directory}")
    return program.state_from_params(params)


def refuse_silent_restart(
    config: Config, checkpointer: Checkpointer, message: Callable[[str], None]
) -> None:
    """Checkpoints exist but none restored (each skipped one has had its line): stop, unless
    checkpoint.if_none_valid=restart."""
    damaged = checkpointer.damaged_entries()
    damaged_before = [name for name in damaged if name not in checkpointer.moved_aside]
    if not checkpointer.skipped and not damaged_before:
        return  # a new run, or only saves that never finished: step 0 loses nothing
    count = len(checkpointer.skipped) + len(damaged_before)
    what = (
        f"none of the {count} checkpoints in {checkpointer.directory} restores"
        + (" (the reasons are above)" if checkpointer.skipped else "")
        + (
            f"; {len(damaged_before)} found damaged earlier are in "
            f"{checkpointer.directory / DAMAGED_DIR}"
            if damaged_before
            else ""
        )
    )
    if config.checkpoint.if_none_valid == "restart":
        message(f"warning: {what}; starting from step 0 (checkpoint.if_none_valid=restart)")
        return
    raise MsjaxError(
        f"{what}; not starting again from step 0 silently: restore a good checkpoint there, "
        "or pass checkpoint.if_none_valid=restart to start from step 0"
    )


def check_same_model(config: Config, restored: Restored) -> None:
    """A checkpoint restores only into the model it was saved from (kernels may differ)."""
    saved = config_from_dict(restored.meta["config"])
    changed = [line for line in differences(saved, config) if line.startswith("model.")]
    if changed:
        raise MsjaxError(
            f"checkpoint {restored.path} holds another model ({'; '.join(changed)}); "
            "resume with the model config it was saved with"
        )


RETRY_PAUSE_MAX_S = 60.0  # a failed save is retried after 1 s, 2 s, 4 s, ... at most this


def check_same_corpus(
    config: Config, start: StartingPoint, corpus: dict[str, Any], message: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Refuse to resume on another corpus than the checkpoint's, unless data.allow_changed=true.

    Returns the allowed changes to record in later checkpoints (earlier ones carried along).
    """
    if start.restored is None:
        return []
    saved_data = start.restored.meta.get("data", {})
    earlier = list(saved_data.get("allowed_changes", []))
    saved = saved_data.get("corpus")
    if saved is None:
        return earlier  # saved before checkpoints recorded their corpus
    changes = corpus_changes(saved, corpus)
    if not changes:
        return earlier
    what = (
        f"the corpus differs from the one checkpoint {start.restored.path} was trained on: "
        + "; ".join(changes)
    )
    if not config.data.allow_changed:
        raise MsjaxError(
            f"{what}; resume with that data, or pass data.allow_changed=true to go on with this "
            "one (recorded in every later checkpoint)"
        )
    message(f"warning: {what}; going on (data.allow_changed=true, recorded in the checkpoints)")
    return [*earlier, {"at_step": start.step, "changes": changes}]


class CheckpointSaves:
    """Saves of the train state with the run's config and data position. A failed save is
    retried (the loop saves again once `retry_due`); checkpoint.on_save_error=stop ends the
    attempt at the first failure, and checkpoint.max_unsaved_minutes bounds how long training
    goes on while saves keep failing."""

    def __init__(
        self,
        config: Config,
        checkpointer: Checkpointer,
        start: StartingPoint,
        events: LoopEvents,
        warn: Callable[[str], None],
        to_canonical: Callable[[Any], Any] | None = None,
        corpus: dict[str, Any] | None = None,
        allowed_data_changes: list[dict[str, Any]] = (),
    ):
        # what is saved: the state with its layers in canonical order (TrainProgram.to_canonical)
        self.to_canonical = to_canonical or (lambda state: state)
        self.config = config
        self.corpus = corpus  # msjax.data.identity: what the saved state was trained on
        self.allowed_data_changes = list(allowed_data_changes)
        self.checkpointer = checkpointer
        self.start = start
        self.events = events
        self.warn = warn
        self.last_good_s = time.monotonic()  # the last save that did not fail (or the start)
        self.failures = 0  # saves failed in a row
        self._failed_at_s = 0.0

    @property
    def directory(self) -> Path:
        return self.checkpointer.directory

    def save(self, step: int, state: Any) -> None:
        """Start an asynchronous checkpoint of `state`, which has `step` updates."""
        samples_seen = self.start.first_sample + (step - self.start.step) * (
            self.config.train.global_batch
        )
        meta = {
            "config": self.config.to_dict(),
            "data": {
                "next_step": step,
                "samples_seen": samples_seen,
                "corpus": self.corpus,
                "allowed_changes": self.allowed_data_changes,
            },
            "seed": self.config.run.seed,
            "msjax_version": __version__,
        }
        try:
            self.events.save_begin(step)  # an injected save_error fault strikes here
            self.checkpointer.save(step, self.to_canonical(state), meta)
        except Exception as error:
            self._report_error(step, error)
            self.events.save_end(step, None)
        else:
            self.failures = 0
            self.last_good_s = time.monotonic()
            self.events.save_end(step, self.checkpointer.save_blocked_s[-1])

    def retry_due(self) -> bool:
        """Whether a failed save is waiting to be retried and its pause is over."""
        pause_s = min(2.0 ** (self.failures - 1), RETRY_PAUSE_MAX_S)
        return self.failures > 0 and time.monotonic() - self._failed_at_s >= pause_s

    def overdue(self) -> bool:
        """Whether saves are failing and the last good one is older than max_unsaved_minutes."""
        minutes = self.config.checkpoint.max_unsaved_minutes
        unsaved_s = time.monotonic() - self.last_good_s
        return self.failures > 0 and minutes is not None and unsaved_s > 60 * minutes

    def finish(self, state: Any, final_step: int) -> None:
        """The last save (unless the state is saved already), then wait for every save."""
        saved_already = self.checkpointer.last_saved_step == final_step
        if self.config.checkpoint.enabled and final_step > self.start.step and not saved_already:
            self.save(final_step, state)
        self.events.saves_draining()
        try:
            self.checkpointer.wait()
        except Exception as error:
            self._report_error(final_step, error)
        self.checkpointer.close()
        if self.failures:
            raise SavesFailing(
                f"the last checkpoint (step {final_step}) could not be saved; the good ones in "
                f"{self.directory} are kept"
            )

    def _report_error(self, step: int, error: Exception) -> None:
        self.failures += 1
        self._failed_at_s = time.monotonic()
        message = (
            f"checkpoint save at step {step} failed ({type(error).__name__}: {error}); "
            "earlier checkpoints are untouched"
        )
        if self.config.checkpoint.on_save_error == "stop":
            raise SavesFailing(message + "; stopping (checkpoint.on_save_error=stop)") from None
        self.warn("warning: " + message + "; training continues and the save is retried")
