"""The supervisor: starts the workers of one job, watches exits and heartbeats, and on a fault
records an incident, stops every worker and restarts the job from the newest valid checkpoint.

It never imports JAX and never needs a worker to be healthy to act (design principle 5). Faults:
crash (a non-zero exit or a signal; rank 0's is also the coordinator's loss), hang (a heartbeat
without progress past its phase's deadline; a SIGSTOPped worker is named as such), non-finite
loss (rollback: resume and skip that step's batch; or stop), early exit.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from msjax.config import Config
from msjax.launch.distributed import worker_env
from msjax.observe.flight_recorder import diagnose, flight_dir
from msjax.resilience import exit_codes
from msjax.resilience.faults import ENV_VAR as FAULT_ENV_VAR
from msjax.resilience.faults import read_firings
from msjax.resilience.goodput import write_goodput
from msjax.resilience.heartbeat import HeartbeatRecord, heartbeat_path, stacks_path
from msjax.resilience.skips import record_skipped_step
from msjax.resilience.workers import WorkerProcess, describe_exit, stop_workers

MAX_BACKOFF_S = 300.0
STACK_DUMP_WAIT_S = 1.0


@dataclass(frozen=True)
class JobLayout:
    """Where this supervisor's workers sit in the job."""

    nprocs: int  # workers started by this supervisor
    devices_per_proc: int | None  # CPU devices each (JAX_NUM_CPU_DEVICES); None: leave as is
    nnodes: int = 1
    node_rank: int = 0
    coordinator: str | None = None  # host:port; None on one node: 127.0.0.1 and a free port

    @property
    def num_processes(self) -> int:
        return self.nprocs * self.nnodes

    def process_id(self, local_rank: int) -> int:
        return self.node_rank * self.nprocs + local_rank


@dataclass
class Fault:
    cause: str  # crash, hang, nonfinite_loss, early_exit, user_error
    rank: int
    detail: str
    detected_unix_s: float
    fault_unix_s: float  # when it happened, as well as known
    fault_time_from: str  # injection record, exit seen by polling, last heartbeat progress
    step: int  # updates completed by the furthest rank before the fault
    phase: str
    nonfinite_step: int | None = None


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
    max_step: int = 0
    ended_unix_s: float | None = None
    outcome: str = ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    ):
        self.config = config
        self.resilience = config.resilience
        self.run_dir = run_dir
        self.train_args = train_args
        self.layout = layout
        self.faults = faults
        self.out = out if out is not None else sys.stdout
        self.poll_s = poll_s
        self.started_unix_s = time.time()
        self.attempts: list[Attempt] = []
        self.incidents: list[dict[str, Any]] = []
        self._open_incident: dict[str, Any] | None = None
        self._stop_requested: str | None = None
        self._incident_count = self._incidents_so_far()

    # --- bookkeeping -----------------------------------------------------------------------

    def say(self, text: str) -> None:
        self.out.write(f"msjax.launch: {text}\n")
        self.out.flush()

    def _incidents_so_far(self) -> int:
        path = self.run_dir / "incidents.jsonl"
        if not path.exists():
            return 0
        return sum(1 for line in path.read_text().splitlines() if line.strip())

    def _deadline_s(self, phase: str) -> float:
        if phase == "step":
            return self.resilience.step_deadline_s
        if phase in ("checkpoint", "done", "nonfinite"):
            return self.resilience.checkpoint_deadline_s
        return self.resilience.compile_deadline_s  # init, compile, eval (which compiles)

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
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop_requested = signal.Signals(signum).name

    def _run(self) -> int:
        restarts = 0
        no_progress_restarts = 0
        while True:
            attempt = self._spawn(len(self.attempts))
            fault = self._watch(attempt)
            if fault is None and self._stop_requested is None:
                attempt.outcome = "done"
                self._close_incident(attempt)
                self._finish("done")
                self.say(f"done: train.steps={self.config.train.steps} reached")
                return exit_codes.OK
            if self._stop_requested is not None:
                return self._stop_on_request(attempt)
            assert fault is not None
            number = self._record_fault(attempt, fault)
            if fault.cause == "user_error":
                return self._give_up(fault, "a worker reported a user error", exit_codes.USER_ERROR)
            if fault.cause == "nonfinite_loss":
                if self.resilience.on_nonfinite_loss == "stop":
                    return self._give_up(
                        fault,
                        f"non-finite loss at step {fault.nonfinite_step} "
                        "(resilience.on_nonfinite_loss=stop)",
                        exit_codes.NONFINITE_LOSS,
                    )
                assert fault.nonfinite_step is not None
                record_skipped_step(
                    self.run_dir, fault.nonfinite_step, f"non-finite loss (incident {number})"
                )
                self._open_incident["skipped_step"] = fault.nonfinite_step
            if self.layout.nnodes > 1:
                return self._give_up(
                    fault,
                    "a multi-node job restarts as a whole; the scheduler resumes it",
                    exit_codes.JOB_RESTART_NEEDED,
                )
            if restarts >= self.resilience.max_restarts:
                return self._give_up(
                    fault,
                    "restart budget spent "
                    f"(resilience.max_restarts={self.resilience.max_restarts})",
                    exit_codes.RESTARTS_EXHAUSTED,
                )
            made_progress = attempt.start_step is not None and attempt.max_step > attempt.start_step
            no_progress_restarts = 0 if made_progress else no_progress_restarts + 1
            backoff_s = min(
                self.resilience.restart_backoff_s * 2 ** max(no_progress_restarts - 1, 0),
                MAX_BACKOFF_S,
            )
            restarts += 1
            self._open_incident["backoff_s"] = backoff_s
            self._open_incident["restart"] = restarts
            self.say(
                f"restart {restarts} of at most {self.resilience.max_restarts} in "
                f"{backoff_s:.1f} s, from the newest valid checkpoint"
            )
            self._sleep(backoff_s)
            if self._stop_requested is not None:
                self._finish(f"stopped by {self._stop_requested}")
                return self._signal_exit_code()

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self._stop_requested is None:
            time.sleep(min(self.poll_s, max(deadline - time.monotonic(), 0)))

    def _spawn(self, number: int) -> Attempt:
        layout = self.layout
        coordinator = layout.coordinator or f"127.0.0.1:{free_port()}"
        command = [sys.executable, "-m", "msjax.train", *self.train_args]
        workers = []
        for local_rank in range(layout.nprocs):
            rank = layout.process_id(local_rank)
            heartbeat_path(self.run_dir, rank).unlink(missing_ok=True)
            env = {
                **_environ(),
                **worker_env(coordinator, layout.num_processes, rank, number),
                "PYTHONUNBUFFERED": "1",
            }
            if layout.devices_per_proc is not None:
                env["JAX_NUM_CPU_DEVICES"] = str(layout.devices_per_proc)
            if self.faults:
                env[FAULT_ENV_VAR] = self.faults
            workers.append(
                WorkerProcess(
                    rank,
                    command,
                    env,
                    self.run_dir / "logs" / f"rank{rank}.log",
                    number,
                    echo=self.out if rank == 0 else None,
                )
            )
        attempt = Attempt(number, workers, time.time())
        for worker in workers:
            attempt.progress_at[worker.rank] = time.monotonic()
            attempt.progress_unix_s[worker.rank] = attempt.spawned_unix_s
        self.attempts.append(attempt)
        ranks = f"ranks {workers[0].rank}-{workers[-1].rank}" if len(workers) > 1 else "rank 0"
        self.say(
            f"attempt {number}: {len(workers)} workers ({ranks} of {layout.num_processes}), "
            f"coordinator {coordinator}, pids {' '.join(str(w.pid) for w in workers)}"
        )
        return attempt

    def _watch(self, attempt: Attempt) -> Fault | None:
        """Poll exits and heartbeats until the attempt finishes (None) or faults."""
        last_poll_unix_s = time.time()
        while True:
            if self._stop_requested is not None:
                return None
            now_unix_s = time.time()
            exited = [w for w in attempt.workers if w.poll() is not None]
            failed = [w for w in exited if w.exit_code != 0]
            self._read_heartbeats(attempt)
            if failed:
                return self._exit_fault(attempt, failed, last_poll_unix_s)
            if len(exited) == len(attempt.workers):
                attempt.ended_unix_s = now_unix_s
                finished = [
                    record
                    for record in attempt.heartbeats.values()
                    if record.phase == "done" and record.step >= self.config.train.steps
                ]
                if len(finished) == len(attempt.workers):
                    return None
                return Fault(
                    "early_exit",
                    attempt.workers[0].rank,
                    "every worker exited 0 before train.steps",
                    now_unix_s,
                    now_unix_s,
                    "exit seen by polling",
                    attempt.max_step,
                    "done",
                )
            reported = self._nonfinite_reported(attempt)
            if reported is not None:
                return reported
            hung = self._hang(attempt)
            if hung is not None:
                return hung
            last_poll_unix_s = now_unix_s
            time.sleep(self.poll_s)

    def _read_heartbeats(self, attempt: Attempt) -> None:
        for worker in attempt.workers:
            record = HeartbeatRecord.read(heartbeat_path(self.run_dir, worker.rank))
            if record is None or record.pid != worker.pid:
                continue
            previous = attempt.heartbeats.get(worker.rank)
            moved = previous is None or (previous.phase, previous.step) != (
                record.phase,
                record.step,
            )
            attempt.heartbeats[worker.rank] = record
            if moved:
                attempt.progress_at[worker.rank] = time.monotonic()
                attempt.progress_unix_s[worker.rank] = record.unix_s
            if record.phase not in ("init", "nonfinite"):
                attempt.max_step = max(attempt.max_step, record.step)
            if worker.rank == attempt.workers[0].rank:
                if record.phase != "init" and attempt.compile_unix_s is None:
                    attempt.compile_unix_s = (
                        record.phase_started_unix_s if record.phase == "compile" else record.unix_s
                    )
                    attempt.start_step = record.start_step
                if record.phase == "step" and attempt.first_step_unix_s is None:
                    attempt.first_step_unix_s = record.phase_started_unix_s
        self._update_open_incident(attempt)

    def _exit_fault(
        self, attempt: Attempt, failed: list[WorkerProcess], last_poll_unix_s: float
    ) -> Fault:
        first = min(failed, key=lambda w: (w.exited_unix_s or 0.0, w.rank))
        code = first.exit_code
        assert code is not None
        record = attempt.heartbeats.get(first.rank)
        phase = record.phase if record is not None else "init"
        detected = time.time()
        fault = Fault(
            "crash",
            first.rank,
            describe_exit(code),
            detected,
            last_poll_unix_s,
            "exit seen by polling",
            attempt.max_step,
            phase,
        )
        if code == exit_codes.USER_ERROR:
            fault.cause = "user_error"
        elif code == exit_codes.NONFINITE_LOSS:
            fault.cause = "nonfinite_loss"
            fault.nonfinite_step = record.step if record is not None else attempt.max_step
            fault.step = fault.nonfinite_step
            fault.detail = f"the loss of step {fault.nonfinite_step} is not finite"
        elif first.rank == 0:
            fault.detail += "; rank 0 hosted the coordinator"
        self._use_injection_time(fault, attempt)
        return fault

    def _nonfinite_reported(self, attempt: Attempt) -> Fault | None:
        """A rank's heartbeat says its loss was not finite (it is leaving, or about to)."""
        for worker in attempt.workers:
            record = attempt.heartbeats.get(worker.rank)
            if record is not None and record.phase == "nonfinite":
                now = time.time()
                fault = Fault(
                    "nonfinite_loss",
                    worker.rank,
                    f"the loss of step {record.step} is not finite",
                    now,
                    record.unix_s,
                    "heartbeat",
                    record.step,
                    "step",
                    nonfinite_step=record.step,
                )
                self._use_injection_time(fault, attempt)
                return fault
        return None

    def _hang(self, attempt: Attempt) -> Fault | None:
        now = time.monotonic()
        overdue = []
        for worker in attempt.workers:
            if not worker.alive:
                continue
            record = attempt.heartbeats.get(worker.rank)
            phase = record.phase if record is not None else "init"
            waited_s = now - attempt.progress_at[worker.rank]
            if waited_s > self._deadline_s(phase):
                overdue.append((worker, phase, waited_s))
        if not overdue:
            return None
        # name the rank that stopped first: a SIGSTOPped one, else the longest without progress
        live = [w for w in attempt.workers if w.alive]
        stopped = [w for w in live if w.stopped]
        culprit = stopped[0] if stopped else min(live, key=lambda w: attempt.progress_at[w.rank])
        record = attempt.heartbeats.get(culprit.rank)
        phase = record.phase if record is not None else "init"
        waited_s = now - attempt.progress_at[culprit.rank]
        detail = f"no progress in phase {phase} for {waited_s:.1f} s"
        detail += f" (deadline {self._deadline_s(phase):g} s)"
        if stopped:
            detail += f"; the process is stopped (state {culprit.state()}, e.g. SIGSTOP)"
        fault = Fault(
            "hang",
            culprit.rank,
            detail,
            time.time(),
            attempt.progress_unix_s[culprit.rank],
            "last heartbeat progress",
            attempt.max_step,
            phase,
        )
        self._use_injection_time(fault, attempt)
        return fault

    def _use_injection_time(self, fault: Fault, attempt: Attempt) -> None:
        """An injected fault's own record says exactly when it fired."""
        pids = {worker.pid for worker in attempt.workers}
        for firing in read_firings(self.run_dir):
            if firing["pid"] in pids and firing["rank"] == fault.rank and firing["kind"] != "slow":
                fault.fault_unix_s = firing["unix_s"]
                fault.fault_time_from = f"injection record ({firing['fault']})"

    # --- incidents -----------------------------------------------------------------------------

    def _record_fault(self, attempt: Attempt, fault: Fault) -> int:
        """Diagnostics into RUN_DIR/incidents/<n>/, then stop every worker. Returns n."""
        self._close_incident(attempt)
        self._incident_count += 1
        number = self._incident_count
        self.say(
            f"incident {number}: {fault.cause} of rank {fault.rank} ({fault.detail}) "
            f"at step {fault.step}, phase {fault.phase}"
        )
        directory = self.run_dir / "incidents" / str(number)
        directory.mkdir(parents=True, exist_ok=True)
        # the flight records first: collecting stacks wakes a stopped worker, stopping adds events
        verdict = flight_verdict(self.run_dir, directory)
        self._collect_diagnostics(attempt, fault, directory)
        # the faulty rank is not trusted to finish anything: SIGKILL; the others get SIGTERM
        culprit = [worker for worker in attempt.workers if worker.rank == fault.rank]
        for worker in culprit:
            worker.signal(signal.SIGKILL)
        stop_s = stop_workers(attempt.workers, self.resilience.stop_grace_s)
        attempt.ended_unix_s = time.time()
        attempt.outcome = fault.cause
        self._open_incident = {
            "incident": number,
            "cause": fault.cause,
            "rank": fault.rank,
            "detail": fault.detail,
            "attempt": attempt.number,
            "phase": fault.phase,
            "step": fault.step,
            "fault_unix_s": fault.fault_unix_s,
            "fault_time_from": fault.fault_time_from,
            "detected_unix_s": fault.detected_unix_s,
            "detection_latency_s": round(fault.detected_unix_s - fault.fault_unix_s, 3),
            "stop_s": round(stop_s, 3),
            "diagnostics": str(directory.relative_to(self.run_dir)),
            "flight_recorder": verdict,
            "action": "restart",
            "resumed_from_step": None,
            "steps_lost": None,
            "restart_s": None,
            "catch_up_s": None,
        }
        return number

    def _collect_diagnostics(self, attempt: Attempt, fault: Fault, directory: Path) -> None:
        live = [worker for worker in attempt.workers if worker.alive]
        states = {worker.rank: worker.state() for worker in live}
        for worker in live:
            stacks_path(self.run_dir, worker.rank).write_text("")
            worker.signal(signal.SIGUSR1)
            if states[worker.rank] in ("T", "t"):
                worker.signal(signal.SIGCONT)  # a stopped process handles the dump once continued
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while time.monotonic() < deadline:
            if all(stacks_path(self.run_dir, w.rank).stat().st_size > 0 for w in live if w.alive):
                time.sleep(0.1)  # let the last thread's lines land
                break
            time.sleep(0.05)
        for worker in live:
            source = stacks_path(self.run_dir, worker.rank)
            if source.exists() and source.stat().st_size:
                shutil.copyfile(source, directory / f"stacks-rank{worker.rank}.txt")
        ranks = {}
        for worker in attempt.workers:
            record = attempt.heartbeats.get(worker.rank)
            ranks[str(worker.rank)] = {
                "pid": worker.pid,
                "exit": None if worker.exit_code is None else describe_exit(worker.exit_code),
                "process_state": states.get(worker.rank),
                "heartbeat": None if record is None else record.__dict__,
            }
            (directory / f"log-rank{worker.rank}.txt").write_text(worker.log_tail())
        summary = {"cause": fault.cause, "rank": fault.rank, "detail": fault.detail, "ranks": ranks}
        (directory / "heartbeats.json").write_text(json.dumps(summary, indent=1) + "\n")

    def _update_open_incident(self, attempt: Attempt) -> None:
        """Fill in restart and catch-up times as the attempt after an incident progresses."""
        incident = self._open_incident
        if incident is None or incident["attempt"] == attempt.number:
            return
        detected = incident["detected_unix_s"]
        if incident["resumed_from_step"] is None and attempt.start_step is not None:
            incident["resumed_from_step"] = attempt.start_step
            incident["steps_lost"] = max(incident["step"] - attempt.start_step, 0)
        if incident["restart_s"] is None and attempt.first_step_unix_s is not None:
            incident["restart_s"] = round(attempt.first_step_unix_s - detected, 3)
            incident["restart_to_first_step_s"] = round(
                attempt.first_step_unix_s - attempt.spawned_unix_s, 3
            )
        caught_up = None
        if attempt.start_step is not None and attempt.start_step >= incident["step"]:
            caught_up = attempt.compile_unix_s  # resumed at (or past) the pre-fault step
        elif attempt.max_step >= incident["step"] and attempt.first_step_unix_s is not None:
            caught_up = max(
                record.unix_s for record in attempt.heartbeats.values() if record.phase != "init"
            )
        if caught_up is not None:
            incident["catch_up_s"] = round(caught_up - detected, 3)
            self._write_incident()

    def _close_incident(self, attempt: Attempt) -> None:
        if self._open_incident is not None:
            self._update_open_incident(attempt)
        if self._open_incident is not None:
            self._write_incident()

    def _write_incident(self) -> None:
        incident = self._open_incident
        assert incident is not None
        self._open_incident = None
        self.incidents.append(incident)
        with (self.run_dir / "incidents.jsonl").open("a") as log:
            log.write(json.dumps(incident) + "\n")
        if incident["catch_up_s"] is not None:
            self.say(
                f"incident {incident['incident']}: caught up with step {incident['step']} "
                f"{incident['catch_up_s']:.1f} s after detection"
            )

    def _give_up(self, fault: Fault, reason: str, code: int) -> int:
        assert self._open_incident is not None
        self._open_incident["action"] = "stop"
        self._open_incident["stop_reason"] = reason
        self._write_incident()
        self._finish(f"stopped: {reason}")
        self.say(
            f"stopped after incident {self._incident_count} ({fault.cause} of rank {fault.rank}): "
            f"{reason}; exit code {code}; checkpoints in {self.run_dir / 'checkpoints'} are kept"
        )
        return code

    def _stop_on_request(self, attempt: Attempt) -> int:
        """SIGTERM / SIGINT to the supervisor (preemption): let workers save, then leave."""
        self.say(f"{self._stop_requested}: asking the workers to save and stop")
        for worker in attempt.workers:
            worker.signal(signal.SIGTERM)
            worker.signal(signal.SIGCONT)
        deadline = time.monotonic() + self.resilience.checkpoint_deadline_s
        for worker in attempt.workers:
            if not worker.wait(deadline - time.monotonic()):
                worker.signal(signal.SIGKILL)
                worker.wait(10.0)
            worker.close()
        attempt.ended_unix_s = time.time()
        attempt.outcome = f"stopped by {self._stop_requested}"
        self._close_incident(attempt)
        self._finish(attempt.outcome)
        return self._signal_exit_code()

    def _signal_exit_code(self) -> int:
        if self._stop_requested == "SIGINT":
            return exit_codes.INTERRUPTED
        return exit_codes.TERMINATED

    def _finish(self, outcome: str) -> None:
        ended = time.time()
        summary = write_goodput(
            self.run_dir, self.started_unix_s, ended, self.attempts, self.incidents, outcome
        )
        self.say(summary)


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


def flight_verdict(run_dir: Path, directory: Path) -> str | None:
    """The flight recorders' comparison (which rank stopped short of the others), with a copy
    of every rank's dump in the incident's directory."""
    for dump in sorted(flight_dir(run_dir).glob("rank*.json")):
        shutil.copyfile(dump, directory / f"flight-{dump.name}")
    verdict = diagnose(run_dir)
    return None if verdict is None else verdict.summary
