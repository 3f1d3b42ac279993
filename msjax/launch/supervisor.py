"""The supervisor: starts the workers of one job, watches exits and heartbeats, and on a fault
records an incident, stops every worker and restarts the job from the newest valid checkpoint.

It never imports JAX and never needs a worker to be healthy to act (design principle 5). Its
states and the moves between them are one table (supervisor_states.py); an attempt is started and
watched in attempt_runner.py, what counts as a fault is in fault_detection.py, what is done about
it in after_fault.py and policy.py, which slots run the job and on which mesh in
job_membership.py, what an incident records in incidents.py, the launch's record in
launches.py.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, ClassVar

from msjax.checkpoint.commits import newest_committed_step
from msjax.checkpoint.snapshots import remove_run_snapshots
from msjax.config import Config
from msjax.launch.after_fault import AfterFault
from msjax.launch.attempt import Attempt, AttemptsWithoutProgress
from msjax.launch.attempt_runner import AttemptRunner
from msjax.launch.fault_detection import DetectedFault, start_up_failure, timings_of
from msjax.launch.incidents import IncidentLog
from msjax.launch.job_membership import JobMembership
from msjax.launch.launches import RUNNING, LaunchRecord
from msjax.launch.layout import JobLayout
from msjax.launch.policy import Action, FaultHistory
from msjax.launch.slots import node_name
from msjax.launch.software_faults import repeated_crash
from msjax.launch.supervisor_states import State, StopRequest, check_transition
from msjax.launch.workers import stop_workers
from msjax.resilience import exit_codes
from msjax.run_dir import RunDir


class Supervisor:
    """Runs `python -m msjax.train TRAIN_ARGS` as a job of workers until it reaches train.steps."""

    def __init__(
        self,
        config: Config,
        run_dir: Path,
        train_args: list[str],
        layout: JobLayout,
        faults: str | None = None,
        out: IO[str] | None = None,
        poll_s: float = 0.05,
        spares: int = 0,
    ):
        self.config = config
        self.resilience = config.resilience
        self.run_dir = RunDir(run_dir)
        self.layout = layout
        self.out = out if out is not None else sys.stdout
        self.state = State.BUILT
        self.exit_code: int | None = None  # set on entering a final state
        self.stop = StopRequest()
        self.attempts: list[Attempt] = []
        self.incidents = IncidentLog(self.run_dir, self.say)
        self.record = LaunchRecord(
            self.run_dir,
            layout,
            self.attempts,
            self.incidents,
            self.stop,
            self.resilience.launch_record_every_s,
        )
        # which slot runs which rank (one node); spares wait in their own processes
        self.membership = JobMembership(
            config, layout, self.run_dir, faults, spares, self.incidents, self.say
        )
        self.runner = AttemptRunner(
            config,
            layout,
            self.run_dir,
            train_args,
            faults,
            self.membership,
            self.incidents,
            self.attempts,
            self.out,
            self.say,
            poll_s,
        )
        self.after_fault = AfterFault(
            config,
            layout,
            self.run_dir,
            self.incidents,
            self.membership,
            node_name(),
            self.record.launch_id,
            self.say,
        )
        self.poll_s = poll_s
        self.committed_at_start = newest_committed_step(self.run_dir.checkpoints)

    def say(self, text: str) -> None:
        self.out.write(f"msjax.launch: {text}\n")
        self.out.flush()

    # --- states --------------------------------------------------------------------------------

    def enter(self, state: State, **facts: Any) -> None:
        """Move to `state` if the table allows it (supervisor_states.ALLOWED_TRANSITIONS), then
        write what goes with it: the launch's record and output lines; `facts` are what those
        name (the fault and action of GAVE_UP, the restart of BACKING_OFF)."""
        check_transition(self.state, state)
        self.state = state
        records = self.RECORDS.get(state)
        if records is not None:
            records(self, **facts)

    def _records_starting(self) -> None:
        """On record before any worker: a requeue's incident, then the launch itself."""
        self.record.open_requeue_incident(self.say)
        self.record.append(time.time(), RUNNING, goodput=False)

    def _records_backing_off(self, restarts: int, restarts_spent: int, backoff_s: float) -> None:
        self.say(
            f"restart {restarts} ({restarts_spent} of resilience.max_restarts="
            f"{self.resilience.max_restarts} spent) in {backoff_s:.1f} s, from the "
            "newest valid checkpoint"
        )

    def _records_stopping(self) -> None:
        self.say(f"{self.stop.signal_name}: asking the workers to save and stop")
        # on record before waiting: a scheduler may kill this process before the workers stop
        self.record.append(time.time(), f"stopping on {self.stop.signal_name}")

    def _records_done(self) -> None:
        self._finish("done")
        self.say(f"done: train.steps={self.config.train.steps} reached")
        self.exit_code = exit_codes.OK

    def _records_gave_up(self, fault: DetectedFault, action: Action) -> None:
        reason, code = action.reason, action.stop_code
        assert code is not None
        self.incidents.write()
        self._finish(f"stopped: {reason}")
        self._say_checkpoints()  # before the last line, which names what stopped the job
        self.say(
            f"stopped after incident {self.incidents.count} ({fault.label}): "
            f"{reason}; exit code {code}; checkpoints in {self.run_dir.checkpoints} are kept"
        )
        self.exit_code = code

    def _records_stopped(self) -> None:
        self._finish(f"stopped by {self.stop.signal_name}")
        interrupted = self.stop.signal_name == "SIGINT"
        self.exit_code = exit_codes.INTERRUPTED if interrupted else exit_codes.TERMINATED

    def _finish(self, outcome: str) -> None:
        summary = self.record.append(time.time(), outcome)
        if summary is not None:
            self.say(summary)

    def _say_checkpoints(self) -> None:
        """The newest committed checkpoint now and at this launch's start, as the launch's last
        line but one: launch/slurm/train.sbatch spends its requeue budget only on a run of the
        job that committed no newer one."""
        now = newest_committed_step(self.run_dir.checkpoints)
        self.say(
            f"checkpoints: newest committed step {'none' if now is None else now} (step "
            f"{'none' if self.committed_at_start is None else self.committed_at_start} at this "
            "launch's start)"
        )

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        """Supervise until done; returns the launcher's exit code (msjax.resilience.exit_codes)."""
        previous = {
            signum: signal.signal(signum, self._on_signal)
            for signum in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            return self._run()
        finally:
            if self.state is not State.GAVE_UP:  # a stop's own last line says it first
                self._say_checkpoints()
            self.membership.close(self.resilience.stop_grace_s)
            # the workers are gone and no restart follows: their memory snapshots go too
            remove_run_snapshots(self.run_dir.path)
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop.take(signum)

    def _run(self) -> int:
        self.enter(State.STARTING)
        restarts = restarts_spent = 0
        stalled = AttemptsWithoutProgress()
        while True:
            attempt, fault = self._attempt(len(self.attempts))
            # what this attempt timed shortens the next one's deadlines from its first step on
            self.runner.timed_before = timings_of(
                attempt.heartbeats.values(), self.runner.timed_before
            )
            if self.stop.requested:
                return self._stop_on_request(attempt)
            if fault is None and self.membership.regrow_ready:
                self.enter(State.REGROWING)
                self.membership.stop_for_regrow(attempt)
                continue
            if fault is None:
                stop_workers(attempt.workers, self.resilience.stop_grace_s)  # all exited: reaps
                attempt.outcome = "done"
                self.incidents.close(attempt)
                return self._end(State.DONE)
            self.enter(State.FAULTED)
            number = self.after_fault.record_fault(attempt, fault)
            progress = self.after_fault.made_progress(attempt)
            stalled.attempt_ended(progress, start_up_failure(fault, attempt))
            history = FaultHistory(restarts, stalled, restarts_spent=restarts_spent)
            action = self.after_fault.decide(attempt, fault, number, history)
            if self.membership.take_change():  # other slots, another mesh: a fresh count
                stalled = AttemptsWithoutProgress()
            if action.stop_code is not None:
                return self._end(State.GAVE_UP, fault=fault, action=action)
            restarts, restarts_spent = action.restart, restarts_spent + action.spends_budget
            self.enter(
                State.BACKING_OFF,
                restarts=restarts,
                restarts_spent=restarts_spent,
                backoff_s=action.backoff_s,
            )
            self._sleep(action.backoff_s)
            if self.stop.requested:
                return self._end(State.STOPPED)

    def _end(self, state: State, **facts: Any) -> int:
        """Enter a final state; the launcher's exit code it set."""
        self.enter(state, **facts)
        assert state.final and self.exit_code is not None
        return self.exit_code

    def _attempt(self, number: int) -> tuple[Attempt, DetectedFault | None]:
        """Attempt `number` after its self-checks: one that failed them and its fault, or one
        whose workers ran, watched until it ended, and the fault that ended it (or None)."""
        if self.resilience.check_budget_s > 0:
            self.enter(State.CHECKING)
            attempt, fault = self.runner.self_check(number)
            if attempt is not None:
                return attempt, fault
        self.enter(State.RUNNING)
        attempt = self.runner.spawn(number)
        fault = self.runner.watch(attempt, lambda: self.stop.requested, self.record.keep_current)
        if fault is not None:  # the same exception at the same step again: no slot's
            fault = repeated_crash(fault, self.attempts, self.run_dir.path) or fault
        return attempt, fault

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.stop.requested:
            self.record.keep_current(time.time())  # a back-off may last minutes
            time.sleep(min(self.poll_s, max(deadline - time.monotonic(), 0)))

    def _stop_on_request(self, attempt: Attempt) -> int:
        """SIGTERM / SIGINT to the supervisor (preemption): let workers save, then leave."""
        self.enter(State.STOPPING)
        for worker in attempt.workers:
            worker.signal(signal.SIGTERM)
            worker.signal(signal.SIGCONT)
        deadline = time.monotonic() + self.resilience.checkpoint_deadline_s
        for worker in attempt.workers:
            if not worker.wait(deadline - time.monotonic()):
                self.say(
                    f"rank {worker.rank} (pid {worker.pid}) did not save and stop within "
                    f"resilience.checkpoint_deadline_s={self.resilience.checkpoint_deadline_s:g} "
                    "s; SIGKILLed"
                )
                worker.signal(signal.SIGKILL)
                worker.wait(10.0)
            worker.close()
        attempt.read_heartbeats(self.run_dir)  # the step the workers saved and stopped after
        attempt.ended_unix_s = time.time()
        attempt.outcome = f"stopped by {self.stop.signal_name}"
        self.incidents.close(attempt)
        return self._end(State.STOPPED)

    # what entering a state writes; the states left out write nothing of their own
    RECORDS: ClassVar[Mapping[State, Callable[..., None]]] = {
        State.STARTING: _records_starting,
        State.BACKING_OFF: _records_backing_off,
        State.STOPPING: _records_stopping,
        State.DONE: _records_done,
        State.GAVE_UP: _records_gave_up,
        State.STOPPED: _records_stopped,
    }
