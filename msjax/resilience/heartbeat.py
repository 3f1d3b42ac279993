"""Worker heartbeats: RUN_DIR/heartbeats/rank<r>.json, rewritten atomically from the train loop.

A heartbeat says what a rank is doing (phase), how far it got (step: updates completed), when it
last moved, and how long its steps and saves have taken (timings). The supervisor judges progress
and derives its deadlines from them; nothing here runs in jitted code.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from msjax.run_dir import RunDir
from msjax.writable import open_no_follow, read_no_follow, rewrite_best_effort, warn_write_dropped

Phase = Literal[
    "init", "data", "restore", "compile", "step", "checkpoint", "drain", "eval", "nonfinite", "done"
]
# checkpoint: a save being started (its blocking part); drain: waiting for saves in flight at the
# end. The phases a heartbeat times: how many of each it has seen and the slowest one, in seconds
# (a step: the time per update between two beats of phase step; a save: a checkpoint phase)
TIMED_PHASES = ("step", "checkpoint")
# before the state is ready: the step a heartbeat of these phases carries means nothing yet
STARTUP_PHASES = ("init", "data", "restore")


@dataclass(frozen=True)
class HeartbeatRecord:
    """One heartbeat as read back by the supervisor."""

    rank: int
    pid: int
    attempt: int
    step: int  # updates completed
    start_step: int  # the step this attempt resumed at
    phase: str
    phase_started_unix_s: float
    unix_s: float  # when it was written
    progress: int = 0  # work done within the phase (tokens written while tokenizing)
    start_source: str = ""  # where the state came from: disk, memory, or "" (new)
    start_note: str = ""  # why in-memory snapshots were not restored, where they were there
    # this process's restore: source (own, buddy: a memory snapshot; disk), bytes, seconds
    start_restore: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, list[float]] = field(default_factory=dict)  # phase: [count, slowest_s]
    startup: dict[str, float] = field(default_factory=dict)  # STARTUP_MARKS reached: unix s

    @classmethod
    def read(cls, path: Path) -> HeartbeatRecord | None:
        """The heartbeat in path, or None if there is none (or it is being replaced)."""
        try:
            values = json.loads(read_no_follow(path))
            return cls(**{key: values[key] for key in cls.__dataclass_fields__ if key in values})
        except (OSError, ValueError, KeyError, TypeError):
            return None


_latest: Heartbeat | None = None  # this process's newest Heartbeat (latest_beat)
# when this process first reached each point on its way to its first step (unix s): every
# heartbeat carries them, so the supervisor splits a restart's seconds (STARTUP_MARKS)
_startup_marks: dict[str, float] = {}
# in the order a worker reaches them (msjax.train, msjax.training.prepare, WorkerResilience)
STARTUP_MARKS = (
    "main",  # msjax.train's main called (a warm standby: its rank handed over)
    "jax_imported",
    "distributed_joined",  # jax.distributed.initialize returned
    "backend_started",  # the devices known, the config resolved for them
    "data_built",
    "state_abstract",  # the model and optimizer built, the state's shapes traced
    "restored",
    "train_step_lowered",
    "train_step_compiled",  # compiled, or loaded from the compile cache
    "prepared",  # every listener told the run started
    "replica_checks_ready",  # the corruption guard set up (its programs compile after a step)
    "batches_started",  # the data pipeline built, its prefetch started
    "first_batch",
    "first_step_dispatched",
    "first_step_done",
)


def mark_startup(name: str) -> None:
    """Note when this process first reached `name` (one of STARTUP_MARKS); later calls keep the
    first time."""
    _startup_marks.setdefault(name, time.time())


def latest_beat() -> tuple[int, str] | None:
    """The step and phase this process's heartbeat holds now (also what a throttled write has
    not put on disk yet); None before its first heartbeat."""
    if _latest is None or not _latest.phase:
        return None
    return _latest.step, _latest.phase


def note_start(source: str, note: str = "", restore: dict[str, Any] | None = None) -> None:
    """Where this process's state came from (disk or memory), where snapshots were passed over
    why, and its restore (source: own, buddy or disk; bytes; seconds): its heartbeat carries
    them for the incident record."""
    if _latest is not None:
        _latest.start_source, _latest.start_note = source, note
        _latest.start_restore = dict(restore or {})


class Heartbeat:
    """Writes rank's heartbeat on every phase change and at most every `every_s` within a phase."""

    def __init__(self, run_dir: Path, rank: int, every_s: float, attempt: int = 0):
        self.path = RunDir(run_dir).heartbeat(rank)  # its folder is made at the first write:
        # a run refused while its data is read leaves no run dir behind
        self.rank = rank
        self.every_s = every_s
        self.attempt = attempt
        self.pid = os.getpid()
        self.step = 0
        self.start_step = 0
        self.start_source = ""
        self.start_note = ""
        self.start_restore: dict[str, Any] = {}
        self.phase: str = ""
        self.progress = 0
        self._phase_started = time.time()
        self._written_at = -float("inf")
        self.timings: dict[str, list[float]] = {}  # TIMED_PHASES: [count, slowest_s]
        self._stacks_file: IO[str] | None = None
        global _latest
        _latest = self

    def beat(self, phase: Phase, step: int | None = None, progress: int = 0) -> None:
        """Record phase, step and progress within the phase; writes now if the phase changed
        or every_s has passed."""
        now = time.time()
        if phase == "step" == self.phase and step is not None and step > self.step:
            self._time("step", (now - self._step_moved_at) / (step - self.step))
            self._step_moved_at = now
        if step is not None:
            self.step = step
        self.progress = progress
        if phase != self.phase:
            if self.phase == "checkpoint":
                self._time("checkpoint", now - self._phase_started)
            if phase == "step":
                self._step_moved_at = now
            self.phase = phase
            self._phase_started = now
        elif now - self._written_at < self.every_s:
            return
        self._write(now)

    def _make_folder(self) -> None:
        with contextlib.suppress(OSError):  # a full disk: the beats warn once, the loop goes on
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def _time(self, phase: str, seconds: float) -> None:
        count, slowest = self.timings.get(phase, (0, 0.0))
        self.timings[phase] = [count + 1, max(slowest, seconds)]

    def _write(self, now: float) -> None:
        record: dict[str, Any] = {
            "rank": self.rank,
            "pid": self.pid,
            "attempt": self.attempt,
            "step": self.step,
            "start_step": self.start_step,
            "start_source": self.start_source,
            "start_note": self.start_note,
            "start_restore": self.start_restore,
            "phase": self.phase,
            "phase_started_unix_s": self._phase_started,
            "unix_s": now,
            "progress": self.progress,
            "timings": self.timings,
            "startup": dict(_startup_marks),
        }
        # readers see the old or the new heartbeat (on a full disk, one rewritten in place, which
        # a reader may catch torn and skip); a write that cannot land is dropped with one warning
        self._make_folder()
        rewrite_best_effort(self.path, json.dumps(record))
        self._written_at = now

    def dump_stacks_on_sigusr1(self, run_dir: Path) -> Path:
        """Let the supervisor ask for every thread's Python stack (faulthandler, C-level handler:
        works while the main thread is blocked in a collective). The file is opened without
        following a link; one that cannot be opened leaves SIGUSR1 as it was, with one warning."""
        path = RunDir(run_dir).stacks(self.rank)
        self._make_folder()
        try:
            # appended: the supervisor empties it before each request, and the dump lands at its
            # start rather than at this descriptor's old offset
            self._stacks_file = open_no_follow(path, "a")
        except OSError as error:
            warn_write_dropped(path, error)
            return path
        faulthandler.register(signal.SIGUSR1, file=self._stacks_file, all_threads=True)
        return path

    def close(self) -> None:
        if self._stacks_file is not None:
            faulthandler.unregister(signal.SIGUSR1)
            self._stacks_file.close()
            self._stacks_file = None
