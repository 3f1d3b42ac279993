"""The supervisor: starts the workers of one job, watches exits and heartbeats, and on a fault
records an incident, stops every worker and restarts the job from the newest valid checkpoint.

It never imports JAX and never needs a worker to be healthy to act (design principle 5). What
counts as a fault is in fault_detection.py, what an incident records in incidents.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from msjax.checkpoint.commits import committed_steps
from msjax.config import Config
from msjax.distributed import worker_env
from msjax.errors import MsjaxError
from msjax.launch.attempt import Attempt, AttemptsWithoutProgress
from msjax.launch.fault_detection import (
    Fault,
    Timings,
    early_exit_fault,
    exit_fault,
    hang_fault,
    nonfinite_fault,
    start_up_failure,
    timings_of,
    use_injection_time,
)
from msjax.launch.incidents import (
    IncidentDir,
    IncidentLog,
    collect_diagnostics,
    flight_verdict,
    incident_record,
)
from msjax.launch.launches import (
    REQUEUE,
    append_launch,
    attempt_record,
    read_launches,
    requeue_incident,
    scheduler_context,
)
from msjax.launch.membership import MeshPlan, Slots, full_plan, replan_mesh
from msjax.launch.spare import write_assignment
from msjax.launch.workers import WorkerProcess, stop_workers
from msjax.observe.goodput import session_split, write_goodput
from msjax.resilience import exit_codes
from msjax.resilience.faults import ENV_VAR as FAULT_ENV_VAR
from msjax.resilience.faults import SLOT_ENV_VAR
from msjax.resilience.skips import read_skipped_steps, record_skipped_step
from msjax.run_dir import RunDir

MAX_BACKOFF_S = 300.0
REGROW = "regrow"  # not a fault: the job stops at a checkpoint to return to a larger mesh
NOT_THE_MACHINE = ("user_error", "nonfinite_loss", REGROW)  # causes no slot is blamed for


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
        spares: int = 0,
    ):
        self.config = config
        self.resilience = config.resilience
        self.run_dir = RunDir(run_dir)
        self.train_args = train_args
        self.layout = layout
        self.faults = faults
        self.out = out if out is not None else sys.stdout
        self.poll_s = poll_s
        self.started_unix_s = time.time()
        self.attempts: list[Attempt] = []
        self.incidents = IncidentLog(self.run_dir, self.say)
        self._stop_requested: str | None = None
        self._stop_requested_unix_s: float | None = None
        # node 0 keeps the run's record across launches (requeues): launches.jsonl, goodput.json
        self.keeps_record = layout.node_rank == 0
        self.context = scheduler_context()
        self.earlier_launches = read_launches(self.run_dir) if self.keeps_record else []
        self.timed_before: Timings = {}  # steps and saves timed by the attempts so far
        # which slot runs which rank (one node); spares wait in their own processes
        self.slots = Slots(layout.nprocs, spares)
        self.spare_workers: dict[int, WorkerProcess] = {}
        self.full_plan: MeshPlan | None = None
        if layout.devices_per_proc is not None and layout.nnodes == 1:
            with contextlib.suppress(MsjaxError):  # a mesh that does not fit: workers refuse it
                self.full_plan = full_plan(config, layout.devices_per_proc, layout.nprocs)
        self.plan = self.full_plan
        self.membership_changed = False
        self._regrow_after_step: int | None = None  # stop at a checkpoint past this step

    def say(self, text: str) -> None:
        self.out.write(f"msjax.launch: {text}\n")
        self.out.flush()

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
            stop_workers(list(self.spare_workers.values()), self.resilience.stop_grace_s)
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop_requested = signal.Signals(signum).name
        if self._stop_requested_unix_s is None:
            self._stop_requested_unix_s = time.time()

    def _open_requeue_incident(self) -> None:
        """A launch after one that did not finish the run (a requeued job) is an incident."""
        if not self.earlier_launches or self.earlier_launches[-1]["outcome"] == "done":
            return
        number = self.incidents.next_number()
        incident = requeue_incident(
            number, self.earlier_launches[-1], self.started_unix_s, self.context
        )
        self.incidents.open(incident)
        self.say(f"incident {number}: requeue: {incident['detail']}")

    def _run(self) -> int:
        if self.keeps_record:
            self._open_requeue_incident()
        restarts = 0
        stalled = AttemptsWithoutProgress()
        while True:
            attempt = self._spawn(len(self.attempts))
            fault = self._watch(attempt)
            # what this attempt timed shortens the next one's deadlines from its first step on
            self.timed_before = timings_of(attempt.heartbeats.values(), self.timed_before)
            if self._stop_requested is not None:
                return self._stop_on_request(attempt)
            if fault is None:
                stop_workers(attempt.workers, self.resilience.stop_grace_s)  # all exited: reaps
                attempt.outcome = "done"
                self.incidents.close(attempt)
                self._finish("done")
                self.say(f"done: train.steps={self.config.train.steps} reached")
                return exit_codes.OK
            if fault.cause == REGROW:
                self._stop_for_regrow(attempt, fault)
                continue
            number = self._record_fault(attempt, fault)
            stalled.attempt_ended(self._made_progress(attempt), start_up_failure(fault, attempt))
            code = self._stop_code(fault, number, attempt)
            if code is None:
                code = self._exclude_bad_slot(fault)
            if self.membership_changed:  # other slots, another mesh: a fresh count
                self.membership_changed = False
                stalled = AttemptsWithoutProgress()
            if code is None:
                code = self._stalled_code(fault, stalled)
            if code is None:
                code = self._budget_code(fault, restarts)
            if code is not None:
                return code
            backoff_s = min(
                self.resilience.restart_backoff_s * 2 ** max(stalled.count - 1, 0),
                MAX_BACKOFF_S,
            )
            restarts += 1
            assert self.incidents.open_incident is not None
            self.incidents.open_incident["backoff_s"] = backoff_s
            self.incidents.open_incident["restart"] = restarts
            self.say(
                f"restart {restarts} of at most {self.resilience.max_restarts} in "
                f"{backoff_s:.1f} s, from the newest valid checkpoint"
            )
            self._sleep(backoff_s)
            if self._stop_requested is not None:
                self._finish(f"stopped by {self._stop_requested}")
                return self._signal_exit_code()

    def _made_progress(self, attempt: Attempt) -> bool:
        """Progress is a checkpoint committed past the one the attempt resumed from; without
        checkpoints, steps past it."""
        if not self.config.checkpoint.enabled:
            return attempt.made_progress
        return attempt.committed_progress(self.run_dir.checkpoints)

    def _stop_code(self, fault: Fault, number: int, attempt: Attempt) -> int | None:
        """The exit code if this fault itself ends the job; None to go on. A non-finite loss to
        roll back adds its step to the run's skipped steps, unless it came from the attempt's
        first step: then the state it restored is bad, not a batch, and skipping cannot help."""
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
            assert fault.nonfinite_step is not None and self.incidents.open_incident is not None
            skipped = self._skipped_steps()
            if fault.nonfinite_step == attempt.first_step_run(skipped):
                return self._give_up(
                    fault,
                    f"non-finite loss at step {fault.nonfinite_step}, the first step after "
                    f"resuming at step {attempt.start_step}: the state is bad, not a batch "
                    "(skipping batches cannot help)",
                    exit_codes.NONFINITE_LOSS,
                )
            record_skipped_step(
                self.run_dir.path, fault.nonfinite_step, f"non-finite loss (incident {number})"
            )
            self.incidents.open_incident["skipped_step"] = fault.nonfinite_step
        if self.layout.nnodes > 1:
            return self._give_up(
                fault,
                "a multi-node job restarts as a whole; the scheduler resumes it",
                exit_codes.JOB_RESTART_NEEDED,
            )
        return None

    def _stalled_code(self, fault: Fault, stalled: AttemptsWithoutProgress) -> int | None:
        """Attempts in a row without progress: the same crash before the first step each time
        is a mistake (exit 2); otherwise this machine cannot go on (exit 8)."""
        limit = self.resilience.max_attempts_without_progress
        if stalled.same_start_up_failures >= limit:
            return self._give_up(
                fault,
                f"the same failure before the first step in {limit} attempts in a row "
                f"({stalled.start_up_failure}); restarting cannot help "
                f"(resilience.max_attempts_without_progress={limit})",
                exit_codes.USER_ERROR,
            )
        if stalled.count >= limit:
            return self._give_up(
                fault,
                f"{stalled.count} attempts in a row committed no checkpoint newer than the "
                f"one they resumed from (resilience.max_attempts_without_progress={limit})",
                exit_codes.NO_PROGRESS,
            )
        return None

    def _budget_code(self, fault: Fault, restarts: int) -> int | None:
        if restarts >= self.resilience.max_restarts:
            return self._give_up(
                fault,
                f"restart budget spent (resilience.max_restarts={self.resilience.max_restarts})",
                exit_codes.RESTARTS_EXHAUSTED,
            )
        return None

    def _skipped_steps(self) -> frozenset[int]:
        try:
            return read_skipped_steps(self.run_dir.path)
        except (OSError, ValueError, KeyError, TypeError):
            return frozenset()  # the workers refuse a garbled skip list themselves

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self._stop_requested is None:
            time.sleep(min(self.poll_s, max(deadline - time.monotonic(), 0)))

    def _worker_base_env(self) -> dict[str, str]:
        """What every worker's environment holds whatever its rank (spares start with it)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.layout.devices_per_proc is not None:
            env["JAX_NUM_CPU_DEVICES"] = str(self.layout.devices_per_proc)
        if self.faults:
            env[FAULT_ENV_VAR] = self.faults
        return env

    def _worker_args(self) -> list[str]:
        """The trainer's arguments: the job's, and the re-planned mesh when it is not the job's."""
        if self.plan is None or self.plan == self.full_plan:
            return list(self.train_args)
        return [*self.train_args, *self.plan.overrides()]

    def _keep_spares_ready(self, number: int) -> None:
        """A waiting process in every spare slot (started anew where one has ended)."""
        for slot in self.slots.spares():
            spare = self.spare_workers.get(slot)
            if spare is not None and spare.alive:
                continue
            if spare is not None:
                spare.close()
            command = [sys.executable, "-m", "msjax.launch.spare", str(self.run_dir.path)]
            log = self.run_dir.spare_log(slot)
            env = self._worker_base_env()
            self.spare_workers[slot] = WorkerProcess(
                -1, [*command, str(slot)], env, log, number, echo=None
            )

    def _spawn(self, number: int) -> Attempt:
        layout = self.layout
        coordinator = layout.coordinator or f"127.0.0.1:{free_port()}"
        args = self._worker_args()
        command = [sys.executable, "-m", "msjax.train", *args]
        committed = committed_steps(self.run_dir.checkpoints)  # before any worker can save
        one_node = layout.nnodes == 1
        num_processes = len(self.slots.rank_slots) if one_node else layout.num_processes
        if one_node:  # ranks a shrunk mesh no longer has: their last records would mislead
            for gone in range(num_processes, layout.nprocs):
                self.run_dir.heartbeat(gone).unlink(missing_ok=True)
                self.run_dir.flight_record(gone).unlink(missing_ok=True)
        workers = []
        for local_rank, slot in enumerate(self.slots.rank_slots):
            rank = layout.process_id(local_rank)
            self.run_dir.heartbeat(rank).unlink(missing_ok=True)
            job_env = {
                **worker_env(coordinator, num_processes, rank, number),
                SLOT_ENV_VAR: str(slot if one_node else rank),  # injected faults follow the slot
            }
            spare = self.spare_workers.pop(slot, None)
            if spare is not None and not spare.alive:
                spare.close()  # ended while waiting (its bound): a fresh worker instead
            elif spare is not None:  # a spare taking a rank: imports done
                write_assignment(self.run_dir.path, slot, rank, job_env, args)
                spare.rank, spare.spawned_unix_s = rank, time.time()
                workers.append(spare)
                continue
            env = {**self._worker_base_env(), **job_env}
            echo = self.out if rank == 0 else None
            log = self.run_dir.log(rank)
            workers.append(WorkerProcess(rank, command, env, log, number, echo=echo))
        self._keep_spares_ready(number)
        attempt = Attempt.started(number, workers)
        attempt.newest_committed_at_spawn = committed[-1] if committed else None
        self.attempts.append(attempt)
        ranks = (
            f"ranks {workers[0].rank}-{workers[-1].rank}"
            if len(workers) > 1
            else f"rank {workers[0].rank}"
        )
        where = ""
        if one_node and (self.slots.spares() or self.plan != self.full_plan):
            where = f", slots {self.slots.describe()}"
        self.say(
            f"attempt {number}: {len(workers)} workers ({ranks} of {num_processes}), "
            f"coordinator {coordinator}, pids {' '.join(str(w.pid) for w in workers)}{where}"
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
            attempt.read_heartbeats(self.run_dir)
            self.incidents.update(attempt)
            fault = None
            if failed:
                fault = exit_fault(attempt, failed, last_poll_unix_s)
            elif len(exited) == len(attempt.workers):
                attempt.ended_unix_s = now_unix_s
                if attempt.finished(self.config.train.steps):
                    return None
                return early_exit_fault(attempt, now_unix_s)
            else:
                fault = (
                    nonfinite_fault(attempt)
                    or hang_fault(attempt, self.resilience, self.timed_before)
                    or self._regrow_fault(attempt)
                )
            if fault is not None:
                use_injection_time(fault, attempt, self.run_dir)
                return fault
            last_poll_unix_s = now_unix_s
            time.sleep(self.poll_s)

    # --- membership: excluding a bad slot, re-admitting it ------------------------------------

    def _replan(self) -> MeshPlan:
        """The mesh for the healthy slots (the job's own when all are healthy)."""
        if self.full_plan is None:
            raise MsjaxError(
                "the mesh cannot be re-planned without --devices-per-proc (the devices each "
                "process holds)"
            )
        devices_per_proc = self.layout.devices_per_proc
        assert devices_per_proc is not None  # full_plan is None without it
        healthy = len(self.slots.healthy())
        return replan_mesh(self.config, devices_per_proc, self.layout.nprocs, healthy)

    def _exclude_bad_slot(self, fault: Fault) -> int | None:
        """Count the fault against the slot it names; at resilience.max_faults_per_slot in a row
        that slot is excluded: a spare takes its rank, else the mesh shrinks onto the healthy
        slots. Returns an exit code where the job cannot go on, else None (restart)."""
        if self.layout.nnodes > 1 or self.resilience.on_bad_node != "exclude":
            return None
        slot = None if fault.cause in NOT_THE_MACHINE else self.slots.slot_of(fault.rank)
        in_a_row = self.slots.note_fault(slot, fault.fault_unix_s)
        if slot is None or in_a_row < self.resilience.max_faults_per_slot:
            return None
        incident = self.incidents.open_incident
        assert incident is not None
        record: dict[str, Any] = {
            "slot": slot,
            "rank": fault.rank,
            "faults_in_a_row": in_a_row,
            "first_fault_unix_s": self.slots.streak_first_fault_unix_s,
            "detected_unix_s": fault.detected_unix_s,
            "checked_unix_s": None,  # no self-check of the slot here (msjax.doctor)
            "excluded_unix_s": time.time(),
            "first_step_unix_s": None,
            "first_fault_to_new_mesh_s": None,
        }
        spare = self.slots.exclude(slot, record["excluded_unix_s"])
        why = f"slot {slot} (rank {fault.rank}) excluded: the cause of {in_a_row} faults in a row"
        incident["membership"] = record
        self.membership_changed = True
        if spare is not None:
            record.update(action="spare", spare_slot=spare, slots=self.slots.describe())
            self.say(f"{why}; spare slot {spare} takes rank {fault.rank}, the mesh is unchanged")
            return None
        try:
            plan = self._replan()
        except MsjaxError as error:
            record.update(action="stop", slots=self.slots.describe())
            return self._give_up(fault, f"{why}, and {error}", exit_codes.NO_PROGRESS)
        self.slots.arrange(plan.processes)
        self.plan = plan
        record.update(action="shrink", mesh=plan.describe(), slots=self.slots.describe())
        self.say(f"{why}; no spare left: the job goes on on {plan.describe()}")
        return None

    def _regrow_fault(self, attempt: Attempt) -> Fault | None:
        """Re-admit slots whose time out is over. On the job's own mesh they wait as spares; on
        a shrunk one the job stops at its next checkpoint to grow back (a REGROW 'fault')."""
        now = time.time()
        due = self.slots.readmit_due(now, self.resilience.readmit_after_s)
        if due:
            after = f"resilience.readmit_after_s={self.resilience.readmit_after_s:g}"
            if self.plan == self.full_plan:
                for slot in due:
                    self.slots.make_spare(slot)
                self._keep_spares_ready(attempt.number)
                self.say(f"slot(s) {due} re-admitted after {after}: spare(s) now")
            else:
                committed = committed_steps(self.run_dir.checkpoints)
                self._regrow_after_step = committed[-1] if committed else -1
                self.say(
                    f"slot(s) {due} re-admitted after {after}: the job returns to a larger mesh "
                    "at its next checkpoint"
                )
        if self._regrow_after_step is None:
            return None
        committed = committed_steps(self.run_dir.checkpoints)
        if not committed or committed[-1] <= self._regrow_after_step:
            return None
        return Fault(
            REGROW,
            -1,
            f"checkpoint {committed[-1]} committed after slots were re-admitted",
            now,
            now,
            "re-admission",
            attempt.max_step,
            "step",
        )

    def _stop_for_regrow(self, attempt: Attempt, fault: Fault) -> None:
        """Stop the shrunk job (SIGTERM: each worker saves and stops) and lay its ranks over
        the mesh for the healthy slots; an incident of its own, no restart counted."""
        self.incidents.close(attempt)
        number = self.incidents.next_number()
        stop_s, killed = stop_workers(attempt.workers, self.resilience.stop_grace_s)
        attempt.ended_unix_s = time.time()
        attempt.outcome = REGROW
        self._regrow_after_step = None
        plan = self._replan()  # fits: it held before on fewer slots
        self.slots.arrange(plan.processes)
        self.plan = plan
        record = incident_record(number, fault, attempt, stop_s, "", None)
        record["killed_after_grace"] = killed
        record["action"] = REGROW
        record["membership"] = {
            "action": REGROW,
            "mesh": plan.describe(),
            "slots": self.slots.describe(),
            "stopped_unix_s": attempt.ended_unix_s,
            "first_step_unix_s": None,
        }
        self.incidents.open(record)
        self.say(f"incident {number}: {fault.detail}; the job goes on on {plan.describe()}")

    # --- after a fault -------------------------------------------------------------------------

    def _record_fault(self, attempt: Attempt, fault: Fault) -> int:
        """Diagnostics into RUN_DIR/incidents/<n>/, then stop every worker. Returns n."""
        self.incidents.close(attempt)
        number = self.incidents.next_number()
        self.say(
            f"incident {number}: {fault.cause} of rank {fault.rank} ({fault.detail}) "
            f"at step {fault.step}, phase {fault.phase}"
        )
        incident = IncidentDir(self.run_dir.incident(number))
        incident.path.mkdir(parents=True, exist_ok=True)
        # the flight records first: collecting stacks wakes a stopped worker, stopping adds events
        verdict = flight_verdict(self.run_dir, incident)
        collect_diagnostics(attempt, fault, self.run_dir, incident)
        # the faulty rank is not trusted to finish anything: SIGKILL; the others get SIGTERM
        for worker in attempt.workers:
            if worker.rank == fault.rank:
                worker.signal(signal.SIGKILL)
        stop_s, killed = stop_workers(attempt.workers, self.resilience.stop_grace_s)
        attempt.ended_unix_s = time.time()
        attempt.outcome = fault.cause
        diagnostics = str(incident.path.relative_to(self.run_dir.path))
        record = incident_record(number, fault, attempt, stop_s, diagnostics, verdict)
        record["killed_after_grace"] = killed  # ranks that did not stop on SIGTERM in time
        self.incidents.open(record)
        return number

    def _give_up(self, fault: Fault, reason: str, code: int) -> int:
        incident = self.incidents.open_incident
        assert incident is not None
        incident["action"] = "stop"
        incident["stop_reason"] = reason
        self.incidents.write()
        self._finish(f"stopped: {reason}")
        self.say(
            f"stopped after incident {self.incidents.count} ({fault.cause} of rank {fault.rank}): "
            f"{reason}; exit code {code}; checkpoints in {self.run_dir.checkpoints} are kept"
        )
        return code

    def _stop_on_request(self, attempt: Attempt) -> int:
        """SIGTERM / SIGINT to the supervisor (preemption): let workers save, then leave."""
        self.say(f"{self._stop_requested}: asking the workers to save and stop")
        # on record before waiting: a scheduler may kill this process before the workers stop
        self._record_launch(time.time(), f"stopping on {self._stop_requested}")
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
        attempt.outcome = f"stopped by {self._stop_requested}"
        self.incidents.close(attempt)
        self._finish(attempt.outcome)
        return self._signal_exit_code()

    def _signal_exit_code(self) -> int:
        if self._stop_requested == "SIGINT":
            return exit_codes.INTERRUPTED
        return exit_codes.TERMINATED

    def _finish(self, outcome: str) -> None:
        summary = self._record_launch(time.time(), outcome)
        if summary is not None:
            self.say(summary)

    def _record_launch(self, ended: float, outcome: str) -> str | None:
        """Append this launch (so far) to launches.jsonl and write the run's goodput.json;
        returns goodput's summary line. Node 0's supervisor alone keeps the run's record."""
        if not self.keeps_record:
            return None
        faults = [i for i in self.incidents.written if i["cause"] != REQUEUE]
        launch = {
            "launch": len(self.earlier_launches) + 1,
            **self.context,
            "nnodes": self.layout.nnodes,
            "started_unix_s": self.started_unix_s,
            "ended_unix_s": ended,
            "stop_requested_unix_s": self._stop_requested_unix_s,
            "outcome": outcome,
            "attempts": [attempt_record(attempt) for attempt in self.attempts],
            "incidents": len(self.incidents.written),
            "split_s": session_split(ended, self.attempts, faults),
        }
        summary = write_goodput(self.run_dir, [*self.earlier_launches, launch], outcome)
        append_launch(self.run_dir, launch)
        return summary
