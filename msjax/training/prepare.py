"""Everything a run needs before its first step: JAX joined and the config resolved, the run
directory, the mesh, the data, the compiled program, the starting state, and the listeners.

Every check that can fail on user input runs before anything is written.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from msjax.allocator import allocator_record
from msjax.checkpoint.commits import resume_source
from msjax.checkpoint.manager import Checkpointer
from msjax.config import Config, ObserveConfig, TrainConfig
from msjax.data.dataset import TrainingData, build_training_data
from msjax.data.identity import allowed_corpus_changes, corpus_facts, corpus_identity
from msjax.data.token_store import write_progress
from msjax.distributed import JobEnv, announce_devices, initialize_distributed
from msjax.llama_config import model_from_init
from msjax.loop_events import EventFanOut, LoopEvents
from msjax.observe.flops import MFU_CONVENTION, device_peak, flops_per_step
from msjax.observe.loop_observer import LoopObserver, ProfileCapture
from msjax.observe.metrics import ProgressLine
from msjax.observe.tensorboard import TensorBoardLog, check_tensorboard_installed
from msjax.parallel.mesh import build_mesh, configure_cpu_devices
from msjax.parallel.xla_flags import XlaFlagsRecord, apply_xla_profile
from msjax.resilience.compile_cache import compile_cached, enable_compile_cache
from msjax.resilience.heartbeat import Heartbeat, mark_startup
from msjax.resilience.job_end import watch_for_peer_exit
from msjax.resilience.worker import WorkerResilience
from msjax.resolve import mesh_device_count, resolve_for_devices, resolve_run_dir
from msjax.run_dir import RunDir, RunDirPlan, create_run_dir, plan_run_dir, save_config
from msjax.run_lock import RunDirLock
from msjax.step import TrainProgram, build_program
from msjax.training.checkpoints import (
    CheckpointSaves,
    ResumeSource,
    StartingPoint,
    restore_or_init,
)
from msjax.training.reporting import MetricsLog, ProgressReport, StepResults
from msjax.training.steps import LoopSteps
from msjax.writable import write_json


@dataclass
class PreparedRun:
    """A run ready for its loop: the resolved config and everything built from it."""

    config: Config  # resolved: what every part of the run reads
    run_dir: RunDir
    program: TrainProgram
    abstract_state: Any  # the state's shapes and shardings, traced once (program.abstract_state)
    steps: LoopSteps  # the compiled train step and the eval step, as the loop runs them
    start: StartingPoint
    data: TrainingData
    events: EventFanOut
    results: StepResults
    saves: CheckpointSaves
    resilience: WorkerResilience
    progress: ProgressLine
    started: float  # time.perf_counter() when preparing began


def plan_run(config: Config) -> tuple[Config, RunDirPlan, ResumeSource | None]:
    """What to do with the run dir, and whether checkpoint.resume_from applies: decided here
    only, once, before JAX starts, so a run dir it cannot use fails before anything is written.

    Returns the config with run.dir chosen (its stamp, when unset, taken once here) and the
    model filled from model.init_from: all of resolution that decides whether a run dir holds
    this run (the mesh and the kernels may change on resume, and need the devices).
    """
    config = resolve_run_dir(config)
    config = model_from_init(config)
    plan = plan_run_dir(config)
    own = plan.run_dir.checkpoints
    return config, plan, resume_source(config.checkpoint.resume_from, own, plan.continues_run)


@dataclass(frozen=True)
class JoinedJob:
    """What is settled before a run's parts are built: the job, XLA's flags, the run dir's plan
    and lock, checkpoint.resume_from where it applies, the compile cache, the mesh, and when
    preparing began."""

    job: JobEnv
    xla_flags: XlaFlagsRecord
    plan: RunDirPlan
    resume: ResumeSource | None
    lock: RunDirLock
    compile_cache: Path | None  # the signed executables' directory (None: off)
    mesh: Any  # jax.sharding.Mesh, from mesh.*
    started: float  # time.perf_counter()

    @property
    def run_dir(self) -> RunDir:
        return self.plan.run_dir


def prepare_run(
    config: Config,
    progress_stream: IO[str] | None = None,
    extra_listeners: Sequence[LoopEvents] = (),
) -> PreparedRun:
    """Plan the run dir, join the job, resolve the config, then build everything the loop needs.

    Joining the job sets XLA's flags, joins the distributed job and sets the simulated CPU
    devices, all before JAX's backend starts (joining starts none, so the device count set after
    it still applies); the device line and the resolution for the devices start it.
    """
    import jax

    mark_startup("jax_imported")
    started = time.perf_counter()
    config, plan, resume = plan_run(config)
    xla_flags = apply_xla_profile(config.train.xla_profile)  # XLA reads them when it starts
    job = JobEnv.read()
    initialize_distributed(job, config.resilience.peer_timeout_s)
    mark_startup("distributed_joined")
    configure_cpu_devices(mesh_device_count(config.mesh))
    announce_devices(job)
    # the run's resolved config (plan_run has filled its model from model.init_from, and run.dir)
    config = resolve_for_devices(config, jax.device_count(), jax.default_backend())
    mark_startup("backend_started")
    watch_for_peer_exit("msjax.train")  # a peer's fatal error ends this process too
    lock = job_lock(plan, job)
    try:
        compile_cache = enable_compile_cache(config.resilience, plan.path, job.launched)
        progress = ProgressLine(config.train.steps, stream=progress_stream)
        mesh = build_mesh(config.mesh)
        joined = JoinedJob(job, xla_flags, plan, resume, lock, compile_cache, mesh, started)
        return build_run(config, joined, progress, extra_listeners)
    except BaseException:
        lock.release()
        raise


def job_lock(plan: RunDirPlan, job: JobEnv) -> RunDirLock:
    """The run dir's lock, taken now if the directory exists (else once it is made). The job holds
    it: msjax.launch for its workers, process 0 for a job that no launcher started."""
    import jax

    lock = RunDirLock(plan.run_dir)
    if not job.launched and jax.process_index() == 0 and plan.path.is_dir():
        lock.acquire()  # a job already there refuses this one before it writes anything
    return lock


def build_run(
    config: Config,
    joined: JoinedJob,
    progress: ProgressLine,
    extra_listeners: Sequence[LoopEvents],
) -> PreparedRun:
    """The run's parts, each from its builder, in the order they are made."""
    mesh, message = joined.mesh, progress.message
    data = build_data(config, joined, message)
    mark_startup("data_built")
    record_run(config, joined, data, mesh, message)
    state = build_state(config, mesh, data, joined, message)
    describe_data(data.training, config.train, state.start, message)
    program, resilience = state.program, state.resilience
    events = build_events(config.observe, joined, mesh, progress, [resilience, *extra_listeners])
    train_step = start_and_compile(events, state, joined.compile_cache, message)
    steps = LoopSteps(
        train_step, program.eval_step, data.training.validation, program.batch_sharding,
        resilience.step_hooks,
    )  # fmt: skip
    # what reports each step's metrics, with what tokens/s and MFU are reckoned from
    results = StepResults(
        events, data.tokens_per_step, data.step_flops, mesh.size, data.peak_tflops,
        resilience.step_hooks.loss,
    )  # fmt: skip
    # the run's saves (disk checkpoints and memory snapshots); the drills wait on them too
    saves = CheckpointSaves(
        config, state.checkpointer, state.start, events, message,
        to_canonical=program.to_canonical, corpus=data.corpus,
        allowed_data_changes=state.allowed_data_changes,
    )  # fmt: skip
    resilience.wait_for_saves = saves.wait_for_writes
    mark_startup("prepared")
    return PreparedRun(
        config=config, run_dir=joined.run_dir, program=program, steps=steps, start=state.start,
        abstract_state=state.abstract_state, data=data.training, events=events, results=results,
        saves=saves, resilience=resilience, progress=progress, started=joined.started,
    )  # fmt: skip


@dataclass(frozen=True)
class RunData:
    """The corpus as the run reads it, with what was made beside it and the figures of the work
    a step does on it."""

    training: TrainingData
    facts: dict[str, Any]  # what each source holds, for the run record (data_facts.json)
    corpus: dict[str, Any]  # its identity, recorded in every checkpoint (msjax.data.identity)
    heartbeat: Heartbeat  # this rank's one heartbeat, from the data phase to the end of the loop
    tokens_per_step: int  # global_batch x seq_len: what tokens/s is reckoned from
    step_flops: float  # the model FLOPs of one step on global_batch x seq_len tokens
    peak_tflops: float  # per device: with step_flops, what the MFU is reckoned from
    peak_source: str  # where peak_tflops came from (msjax.observe.flops.device_peak)


def build_data(config: Config, joined: JoinedJob, message: Callable[[str], None]) -> RunData:
    """This rank's heartbeat, the FLOPs of a step and the devices' peak TFLOP/s (measured on
    CPU, where no table holds it), then the corpus read (or tokenized) and identified."""
    import jax

    heartbeat = Heartbeat(
        joined.run_dir.path,
        jax.process_index(),
        config.resilience.heartbeat_every_s,
        joined.job.attempt,
    )
    # under msjax.launch, a heartbeat in phase `data` reports every long step's work (bytes
    # hashed and read, token files scanned, tokens written): a large corpus is progress, not a hang
    watch = contextlib.nullcontext()
    if joined.job.launched:
        heartbeat.beat("data")
        watch = write_progress(lambda tokens: heartbeat.beat("data", progress=tokens))
    tokens_per_step = config.train.global_batch * config.data.seq_len
    step_flops = flops_per_step(config)
    peak_tflops, peak_source = device_peak(jax.devices()[0], config.train.peak_tflops)
    with watch:
        data = build_training_data(config, message)
    facts, corpus = corpus_facts(data), corpus_identity(data.tokenizer.name, data.sources)
    return RunData(
        data, facts, corpus, heartbeat, tokens_per_step, step_flops, peak_tflops, peak_source
    )


def record_run(
    config: Config,
    joined: JoinedJob,
    data: RunData,
    mesh: Any,
    message: Callable[[str], None],
) -> None:
    """The run dir with its record (process 0), then the run's first line."""
    import jax

    if config.observe.tensorboard:
        check_tensorboard_installed()
    if jax.process_index() == 0:
        lock = joined.lock if not joined.job.launched else None
        write_run_record(joined.plan, config, data.facts, message, lock)
        write_json(
            joined.run_dir.xla_flags,
            {**joined.xla_flags.record(), "allocator": allocator_record()},
        )
        write_json(
            joined.run_dir.mfu_basis,
            {
                "model_flops_per_step": data.step_flops,
                "tokens_per_step": data.tokens_per_step,
                "devices": mesh.size,
                "peak_tflops_per_device": data.peak_tflops,
                "peak_source": data.peak_source,
                "convention": MFU_CONVENTION,
            },
        )
    shape = " x ".join(f"{axis} {size}" for axis, size in mesh.shape.items())
    message(
        f"msjax: {config.run.name} on {jax.device_count()} {jax.devices()[0].platform} devices "
        f"({shape}); run dir {joined.run_dir.path}"
    )


@dataclass(frozen=True)
class RunState:
    """The state and what keeps it: the checkpointer, this rank's resilience listener, the
    program with its state's shapes (traced once: restore, saves and compile share them), the
    state the run starts from, and the corpus changes its checkpoint allows."""

    checkpointer: Checkpointer
    resilience: WorkerResilience
    program: TrainProgram
    abstract_state: Any
    start: StartingPoint
    allowed_data_changes: list[dict[str, Any]]  # recorded in every later checkpoint


def build_state(
    config: Config, mesh: Any, data: RunData, joined: JoinedJob, message: Callable[[str], None]
) -> RunState:
    """The checkpointer, this rank's heartbeat, drills and skip list as one listener, the program
    for the mesh, and the starting state: restored (of this model, on this corpus unless
    data.allow_changed), or new."""
    run_dir = joined.run_dir
    checkpointer = Checkpointer(run_dir.checkpoints, config.checkpoint)
    resilience = WorkerResilience(
        run_dir.path, data.heartbeat, joined.job.attempt, checkpointer.wait,
        checkpointer.hold_write, config.model.vocab_size,
    )  # fmt: skip
    program = build_program(config, mesh)
    abstract_state = program.abstract_state()
    mark_startup("state_abstract")
    start = restore_or_init(
        config, checkpointer, program, abstract_state, message, joined.resume, resilience.beat
    )
    mark_startup("restored")
    allowed_data_changes: list[dict[str, Any]] = []
    if start.restored is not None:  # on the checkpoint's corpus, unless data.allow_changed
        restored = start.restored
        allowed_data_changes = allowed_corpus_changes(
            restored.meta.get("data", {}), data.corpus, config.data.allow_changed, start.step,
            restored.path, message,
        )  # fmt: skip
    return RunState(checkpointer, resilience, program, abstract_state, start, allowed_data_changes)


def build_events(
    observe: ObserveConfig,
    joined: JoinedJob,
    mesh: Any,
    progress: ProgressLine,
    last_listeners: Sequence[LoopEvents],
) -> EventFanOut:
    """Every listener of the loop's events, in the order they hear them: the observer, the
    optional ones, the metrics record (process 0), the progress line, then `last_listeners`
    (resilience and the caller's), and the run lock last."""
    import jax

    is_writer = jax.process_index() == 0
    run_dir = joined.run_dir
    optional = optional_listeners(observe, run_dir, is_writer)
    observer = LoopObserver(observe, run_dir.path, mesh, joined.job.attempt, progress.message)
    listeners: list[LoopEvents] = [observer, *optional]
    if is_writer:
        listeners.append(MetricsLog(run_dir.metrics))
    listeners += [ProgressReport(progress), *last_listeners, joined.lock]
    return EventFanOut(listeners)


def start_and_compile(
    events: EventFanOut, state: RunState, compile_cache: Any, message: Callable[[str], None]
) -> Any:
    """The run's start told to every listener, then the train step compiled. The events own
    run_failed: from run_start on, a failure (compiling here, the loop in msjax.train) reaches
    every listener."""
    with events:
        restored = state.start.restored
        events.run_start(state.start.step, None if restored is None else restored.path)
        if state.checkpointer.options.enabled:
            state.checkpointer.prepare(state.abstract_state)
        # compiled for the batch's known shape (no process reads a whole batch)
        compile_started = time.perf_counter()
        program = state.program
        lowered = program.train_step.lower(state.abstract_state, program.abstract_batch())
        mark_startup("train_step_lowered")
        train_step = compile_cached(lowered, compile_cache, "train_step")
        mark_startup("train_step_compiled")
        message(f"compiled the train step in {time.perf_counter() - compile_started:.1f} s")
        events.compiled(train_step)
    return train_step


def optional_listeners(
    observe: ObserveConfig, run_dir: RunDir, is_writer: bool
) -> list[LoopEvents]:
    """TensorBoard events (process 0) and profiler traces (every rank), as configured."""
    import jax

    listeners: list[LoopEvents] = []
    if observe.tensorboard and is_writer:
        listeners.append(TensorBoardLog(run_dir.tensorboard))
    if observe.profile_steps:
        first, last = observe.profile_steps
        listeners.append(ProfileCapture(run_dir.profile(jax.process_index()), first, last))
    return listeners


def write_run_record(
    plan: RunDirPlan,
    config: Config,
    data_facts: dict[str, Any],
    message: Callable[[str], None],
    lock: RunDirLock | None,
) -> None:
    """Process 0: the run directory (locked, unless a launcher holds it) with the resolved config
    and the corpus it reads."""
    plan.path.mkdir(parents=True, exist_ok=True)
    if lock is not None:
        lock.acquire()
    aside = create_run_dir(plan)
    if aside is not None:
        message(f"run.overwrite=true: the earlier run in {plan.path} moved to {aside}")
    save_config(config, plan.run_dir)
    write_json(plan.run_dir.data_facts, data_facts)


def describe_data(
    data: TrainingData, train: TrainConfig, start: StartingPoint, message: Callable[[str], None]
) -> None:
    """One line per source: what it holds and how much of it the run will have seen."""
    remaining_steps = max(train.steps - start.step, 0)
    samples_at_end = start.first_sample + remaining_steps * train.global_batch
    epochs = data.train.epochs_at(samples_at_end)
    for streams, packed, seen in zip(data.sources, data.train.sources, epochs, strict=True):
        message(
            f"data: {streams.label}: {packed.num_tokens:,} train tokens in "
            f"{packed.num_sequences:,} sequences; {seen:.2f} epochs by step {train.steps}"
        )
