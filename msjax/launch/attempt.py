"""One attempt of a supervised job: its workers, and what their heartbeats have said so far
(progress per rank, when compilation and the first step began, the furthest step reached), and
whether it committed a checkpoint past the one it resumed from."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from msjax.checkpoint.commits import committed_steps
from msjax.launch.workers import WorkerProcess
from msjax.resilience.heartbeat import STARTUP_PHASES, HeartbeatRecord
from msjax.run_dir import RunDir


@dataclass
class Attempt:
    number: int
    workers: list[WorkerProcess]
    spawned_unix_s: float
    heartbeats: dict[int, HeartbeatRecord] = field(default_factory=dict)
    progress_at: dict[int, float] = field(default_factory=dict)  # monotonic, per rank
    progress_unix_s: dict[int, float] = field(default_factory=dict)
    compile_unix_s: float | None = None  # rank 0 began compiling (state restored)
    first_step_unix_s: float | None = None  # rank 0 finished its first step
    start_step: int | None = None
    start_source: str = ""  # where rank 0's state came from: disk, memory, "" (new)
    max_step: int = 0
    ended_unix_s: float | None = None
    outcome: str = ""
    newest_committed_at_spawn: int | None = None  # the run's newest committed checkpoint then

    @classmethod
    def started(cls, number: int, workers: list[WorkerProcess]) -> Attempt:
        """An attempt whose workers were just spawned: every rank counts as progressing now."""
        attempt = cls(number, workers, time.time())
        for worker in workers:
            attempt.progress_at[worker.rank] = time.monotonic()
            attempt.progress_unix_s[worker.rank] = attempt.spawned_unix_s
        return attempt

    @property
    def made_progress(self) -> bool:
        """Whether any step was completed past the one the attempt resumed at."""
        return self.start_step is not None and self.max_step > self.start_step

    def committed_progress(self, checkpoints: Path) -> bool:
        """Whether a checkpoint newer than the one the attempt resumed from is committed (the
        step its heartbeat says it resumed at; before it said, the newest committed at spawn).
        A step completed but never saved is lost at the restart: it is not progress."""
        steps = committed_steps(checkpoints)
        resumed = self.start_step if self.start_step is not None else self.newest_committed_at_spawn
        return bool(steps) and (resumed is None or steps[-1] > resumed)

    def first_step_run(self, skipped: set[int]) -> int | None:
        """The first step this attempt computed (the step it resumed at, past skipped ones)."""
        if self.start_step is None:
            return None
        step = self.start_step
        while step in skipped:
            step += 1
        return step

    def finished(self, steps: int) -> bool:
        """Whether every worker's last heartbeat says it is done with all `steps` steps."""
        done = [
            record
            for record in self.heartbeats.values()
            if record.phase == "done" and record.step >= steps
        ]
        return len(done) == len(self.workers)

    def read_heartbeats(self, run_dir: RunDir) -> None:
        """Take in every worker's newest heartbeat (a phase or step change counts as progress)."""
        for worker in self.workers:
            record = HeartbeatRecord.read(run_dir.heartbeat(worker.rank))
            if record is None or record.pid != worker.pid:
                continue
            previous = self.heartbeats.get(worker.rank)
            moved = previous is None or (previous.phase, previous.step, previous.progress) != (
                record.phase,
                record.step,
                record.progress,
            )
            self.heartbeats[worker.rank] = record
            if moved:
                self.progress_at[worker.rank] = time.monotonic()
                self.progress_unix_s[worker.rank] = record.unix_s
            if record.phase not in (*STARTUP_PHASES, "nonfinite"):
                self.max_step = max(self.max_step, record.step)
            if worker.rank == self.workers[0].rank:
                self._note_first_rank(record)

    def _note_first_rank(self, record: HeartbeatRecord) -> None:
        """The first rank's heartbeat times the attempt's compilation and first step."""
        if record.phase not in STARTUP_PHASES and self.compile_unix_s is None:
            self.compile_unix_s = (
                record.phase_started_unix_s if record.phase == "compile" else record.unix_s
            )
            self.start_step = record.start_step
            self.start_source = record.start_source
        if record.phase == "step" and self.first_step_unix_s is None:
            self.first_step_unix_s = record.phase_started_unix_s


@dataclass
class AttemptsWithoutProgress:
    """How many attempts in a row committed no newer checkpoint, and how many of the last ones
    ended with the same crash before their first step (fault_detection.start_up_failure)."""

    count: int = 0
    start_up_failure: str | None = None
    same_start_up_failures: int = 0

    def attempt_ended(self, progressed: bool, start_up_failure: str | None) -> None:
        self.count = 0 if progressed else self.count + 1
        if start_up_failure is not None and start_up_failure == self.start_up_failure:
            self.same_start_up_failures += 1
        else:
            self.same_start_up_failures = 0 if start_up_failure is None else 1
        self.start_up_failure = start_up_failure
