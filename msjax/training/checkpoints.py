"""The loop's checkpoints: where a run starts (restored or fresh), and its saves with their
record of the data position, reported to the loop's listeners."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msjax import __version__
from msjax.checkpoint.commits import DAMAGED_DIR
from msjax.checkpoint.manager import Checkpointer, Restored
from msjax.config import Config, config_from_dict, differences
from msjax.distributed import JobEnv
from msjax.errors import MsjaxError
from msjax.loop_events import LoopEvents
from msjax.parallel.agreement import agree_max, process_vote
from msjax.resilience.heartbeat import note_start
from msjax.resilience.worker import SavesFailing
from msjax.training.memory_restore import MemoryRestored, restore_from_memory
from msjax.training.memory_snapshots import build_memory_snapshots
from msjax.training.save_schedule import NOT_FINISHED, SaveProposal, SaveSchedule

if TYPE_CHECKING:
    from msjax.training.decisions import Decision


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
    beat: Callable[[str], None] | None = None,
) -> StartingPoint:
    """The newest valid checkpoint (of this run, or of `resume` on its first start), else a new
    state: from model.init_from, or initialized; never a new state where checkpoints exist but
    none restores (refuse_silent_restart).

    resume: checkpoint.resume_from as msjax.checkpoint.commits.resume_source parsed it, or None
    where it does not apply. beat: the worker's heartbeat (msjax.resilience.worker), told the
    phase `restore` as the restore begins.
    """
    if beat is not None:
        beat("restore")
    memory, not_used = restore_from_memory(config, checkpointer.directory, abstract_state)
    if memory is None and not_used:
        message(
            f"restore: not from the memory snapshots ({not_used}); every process restores from "
            "the checkpoint directory"
        )
    started = time.perf_counter()
    restored = None
    if memory is None:
        restored = restore_start(config, checkpointer, abstract_state, message, resume)
    if memory is not None or restored is not None:
        restore = restore_record(memory, restored, started)
        note_start("disk" if memory is None else "memory", not_used, restore)
        if memory is not None:
            return start_from_memory(config, memory, message)
        message(
            f"restored step {restored.step} from disk: its checkpoint of {restore['bytes']} "
            f"bytes (each process reads its own shards) in {restore['seconds']:.2f} s"
        )
        return start_from_disk(config, restored, program, message)
    refuse_silent_restart(config, checkpointer, message)  # whatever the new state would be
    if config.model.init_from is not None:
        return StartingPoint(init_from_hf(config, program, message), 0, 0, None)
    return StartingPoint(program.init_state(), 0, 0, None)


def restore_record(
    memory: MemoryRestored | None, restored: Restored | None, started: float
) -> dict[str, Any]:
    """Where the run's state came from, as its heartbeat records it: the source, the bytes read
    and the seconds taken (and for snapshots of another layout, how many processes saved them
    and how many of the bytes came from other nodes).
    `restored` is the disk's, read since `started`, where `memory` is None."""
    if memory is not None:
        record: dict[str, Any] = {"source": memory.source, "bytes": memory.snapshot_bytes}
        if memory.source == "resharded":  # the process count of the layout that saved them
            record["from_processes"] = memory.from_processes
            record["remote_bytes"] = memory.remote_bytes
        return {**record, "seconds": round(memory.seconds, 3)}
    assert restored is not None
    seconds = time.perf_counter() - started
    return {"source": "disk", "bytes": directory_bytes(restored.path), "seconds": round(seconds, 3)}


def start_from_memory(
    config: Config, memory: MemoryRestored, message: Callable[[str], None]
) -> StartingPoint:
    """The starting point a memory snapshot gives: its state is the loop's own (not canonical)."""
    restored = Restored(memory.step, memory.state, memory.meta, memory.path)
    whose = "this process's snapshot"
    if memory.source == "buddy":
        whose = f"the copy its buddy held ({memory.path})"
    if memory.source == "resharded":
        whose = (
            f"the snapshots within reach ({memory.remote_bytes} bytes from other nodes), "
            f"resharded from {memory.from_processes} processes"
        )
    check_same_model(config, restored)
    message(
        f"restored step {memory.step} from memory: {memory.snapshot_bytes} bytes of {whose} in "
        f"{memory.seconds:.2f} s; 0 bytes read from the checkpoint directory"
    )
    samples_seen = memory.meta["data"]["samples_seen"]
    return StartingPoint(memory.state, memory.step, int(samples_seen), restored)


def start_from_disk(
    config: Config, restored: Restored, program: Any, message: Callable[[str], None]
) -> StartingPoint:
    """The starting point a checkpoint gives: its state in this run's layer order."""
    import jax

    check_same_model(config, restored)
    message(f"resumed from {restored.path} (step {restored.step})")
    step = int(jax.device_get(restored.state.step))
    # The data position is a global sample position, independent of processes and workers.
    samples_seen = restored.meta.get("data", {}).get("samples_seen")
    first_sample = step * config.train.global_batch if samples_seen is None else int(samples_seen)
    # checkpoints hold layers in canonical order; this run's pipeline may keep another
    state = program.from_canonical(restored.state)
    return StartingPoint(state, step, first_sample, restored)


def directory_bytes(path: Path) -> int:
    """The bytes of the files under path (what restoring a checkpoint step reads at most, over
    all processes)."""
    return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())


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
    from msjax.checkpoint.hf_weights import SafetensorsReader, load_params
    from msjax.llama_config import hf_directory, open_weight_files

    directory = hf_directory(config.model.init_from)
    files = open_weight_files(directory)  # refused here if not readable, as at resolve time
    reader = SafetensorsReader(directory, files)
    params = load_params(reader, config.model, program.state_shardings.params)
    message(f"initialized from the Hugging Face weights in {reader.directory}")
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


class CheckpointSaves:
    """Saves of the train state with the run's config and data position, entered by every
    process together, and counted good only once committed.

    The one owner of saving: after each step it proposes what to save (`proposal`), counts what
    every process agreed on (`agreed`), and follows the agreed decision (`after_step`). A failed
    save is retried on the schedule's back-off (`schedule`); checkpoint.on_save_error=
    stop ends the attempt at the first failure, and checkpoint.max_unsaved_minutes bounds how
    long training goes on while saves keep failing.
    """

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
        self.schedule = SaveSchedule(config.checkpoint)
        self.vote = process_vote("save")  # every process casts the same rounds, in order
        self.last_saved_step: int | None = None  # started and not failed (maybe in flight)
        # step -> what the save records of its replicas (msjax.training.replica_checks)
        self.replica_record: Callable[[int], dict[str, Any]] | None = None
        self._started_s = 0.0  # when the save in flight was started
        # checkpoint.memory_every_steps: snapshots in /dev/shm beside the saves (None: off)
        self.memory = build_memory_snapshots(
            config, Path(config.run.dir or "."), start.state, self.meta, events, warn
        )
        if config.checkpoint.enabled:
            # no save of this job has started yet, and the job holds the run lock
            removed = checkpointer.remove_unfinished(self.vote)
            if removed:
                warn(
                    f"removed {len(removed)} unfinished saves in {self.directory} (a killed or "
                    f"failed save left them): {', '.join(removed)}"
                )

    def wait_for_writes(self) -> None:
        """Block until the save and the memory snapshot being written are written (an injected
        crash waits for them, so where its restart resumes does not depend on timing)."""
        if self.memory is not None:
            self.memory.close()
        self.checkpointer.wait()

    @property
    def directory(self) -> Path:
        return self.checkpointer.directory

    def proposal(self, step: int, before_end: bool) -> SaveProposal:
        """What this process proposes to save after `step` updates, from the schedule and the
        save in flight; before_end: `step` is not the run's last (the end of the run saves)."""
        finished, failed = self.view_of_save_in_flight()
        schedule = self.schedule
        return SaveProposal(
            by_steps=schedule.due_by_steps(step) and before_end,
            overdue=schedule.overdue(),
            by_clock=schedule.due_by_clock() and before_end,
            retry=schedule.retry_due() and before_end,
            finished=finished,
            failed=failed,
        )

    def agreed(self, decision: Decision) -> None:
        """The processes agreed on `decision`: a save in flight that every process saw finish is
        counted now, by all at the same step."""
        if self.schedule.in_flight and decision.save_finished == self.last_saved_step:
            self.settle(decision.save_failed)

    def after_step(self, decision: Decision, state: Any) -> bool:
        """Follow the agreed decision after its step: SavesFailing where saves kept failing past
        checkpoint.max_unsaved_minutes, else save `state` when the decision asks for it and the
        run goes on (a stopping run saves at its end). Whether a save was made."""
        if decision.saves_failing:
            raise SavesFailing(
                f"checkpoint saves kept failing for checkpoint.max_unsaved_minutes="
                f"{self.config.checkpoint.max_unsaved_minutes:g} (last failure: step "
                f"{decision.step}); ending the attempt to restart from the last good one"
            )
        if self.memory is not None:
            self.memory.after_step(decision.step, state)
        if decision.stop_by or not decision.save:
            return False
        self.save(decision.step, state)
        return True

    def view_of_save_in_flight(self) -> tuple[int, bool]:
        """This process's view of the save started last and not counted yet: (its step once
        finished here, else NOT_FINISHED; failed here). Never blocks; `settle` counts what every
        process saw."""
        if not self.schedule.in_flight or self.checkpointer.save_in_flight():
            return NOT_FINISHED, False
        outcome = self.checkpointer.save_outcome()  # finished here: no wait
        if outcome is None or self.last_saved_step is None:
            return NOT_FINISHED, False
        return self.last_saved_step, outcome.problem is not None

    def settle(self, failed_anywhere: bool) -> None:
        """Count the save in flight, finished on every process, as committed or failed (every
        process calls it at the same step, with the same verdict)."""
        outcome = self.checkpointer.save_outcome()
        if outcome is None or not self.schedule.in_flight:
            return
        if not failed_anywhere:
            self.schedule.committed(self._started_s)
            return
        self._failed(
            outcome.step,
            outcome.problem or "it did not commit on another process",
            "not committed",
        )
        self.checkpointer.remove_unfinished(self.vote, outcome.step)  # no process writes it now

    def save(self, step: int, state: Any) -> None:
        """Save `state`, which has `step` updates, asynchronously; every process calls it for
        the same step.

        Each process first does what can fail on its own (the save hooks, waiting for the save
        before, retention), then all vote: every process enters Orbax's save, or all skip it
        (no process waits in Orbax's barriers for one that failed) and retry together.
        """
        blocked_from = time.perf_counter()
        started_s = self.schedule.tried()
        previous_failed = False
        if self.schedule.in_flight:
            previous = self.checkpointer.save_outcome()  # waits for the save before
            previous_failed = previous is not None and previous.problem is not None
        local_error: Exception | None = None
        try:
            self.events.save_begin(step)  # an injected save_error fault strikes here
            self.checkpointer.prepare_save()
        except Exception as error:
            local_error = error
        skip, previous_failed = agree_max(self.vote, [local_error is not None, previous_failed])
        self.settle(bool(previous_failed))
        if not skip:
            local_error = None
            try:
                # transformed and fingerprinted on every process together: after the vote
                self.checkpointer.save(step, self.to_canonical(state), self.meta(step))
            except Exception as error:
                local_error = error
            if not agree_max(self.vote, [local_error is not None])[0]:
                self.schedule.in_flight = True
                self._started_s = started_s
                self.last_saved_step = step
                self.events.save_end(step, time.perf_counter() - blocked_from)
                return
        what = "skipped by every process" if skip else "not started by every process"
        self._failed(step, _reason(local_error), what)
        self.events.save_end(step, None)

    def meta(self, step: int) -> dict[str, Any]:
        """What a checkpoint of `step` records beside the arrays: the config, the data position,
        the seed (a memory snapshot records the same)."""
        samples_seen = self.start.first_sample + (step - self.start.step) * (
            self.config.train.global_batch
        )
        return {
            "config": self.config.to_dict(),
            "data": {
                "next_step": step,
                "samples_seen": samples_seen,
                "corpus": self.corpus,
                "allowed_changes": self.allowed_data_changes,
            },
            "seed": self.config.run.seed,
            "msjax_version": __version__,
            **({"replicas": self.replica_record(step)} if self.replica_record else {}),
        }

    def finish(self, state: Any, final_step: int) -> None:
        """The last save (unless the state is saved already), then wait for it to commit."""
        saved_already = self.last_saved_step == final_step
        if self.config.checkpoint.enabled and final_step > self.start.step and not saved_already:
            self.save(final_step, state)
        self.events.saves_draining()
        if self.memory is not None and JobEnv.read().launched:
            self.memory.close()  # kept for a restart: msjax.launch removes them at the job's end
        elif self.memory is not None:
            self.memory.remove()
        self.checkpointer.wait()  # then retention counts the last save too
        if self.schedule.in_flight:
            outcome = self.checkpointer.save_outcome()  # finished on every process: one vote
            failed_here = outcome is not None and outcome.problem is not None
            self.settle(bool(agree_max(self.vote, [failed_here])[0]))
        self.checkpointer.close()
        if self.schedule.failures:
            raise SavesFailing(
                f"the last checkpoint (step {final_step}) could not be saved; the good ones in "
                f"{self.directory} are kept"
            )

    def _failed(self, step: int | None, problem: str, what: str) -> None:
        self.schedule.failed()
        if self.last_saved_step == step:
            self.last_saved_step = None
        message = (
            f"checkpoint save at step {step} failed ({what}: {problem}); earlier checkpoints "
            "are untouched"
        )
        if self.config.checkpoint.on_save_error == "stop":
            raise SavesFailing(message + "; stopping (checkpoint.on_save_error=stop)") from None
        self.warn(
            f"warning: {message}; training continues and the save is retried in "
            f"{self.schedule.retry_pause_s:g} s"
        )


def _reason(error: Exception | None) -> str:
    """Why a save did not start, as this process saw it."""
    if error is None:
        return "another process could not start it"
    return f"{type(error).__name__}: {error}"
