"""The supervisor: starts the workers of one job, watches exits and heartbeats, and on a fault
records an incident, stops every worker and restarts the job from the newest valid checkpoint.

It never imports JAX and never needs a worker to be healthy to act (design principle 5). What
counts as a fault is in fault_detection.py, what is done about it in policy.py, which slots run
the job and on which mesh in job_membership.py, what an incident records in incidents.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import IO, Any

from msjax.checkpoint.commits import committed_steps, uncommitted_entries
from msjax.config import Config
from msjax.distributed import worker_env
from msjax.launch.attempt import Attempt, AttemptsWithoutProgress
from msjax.launch.devices import slot_devices
from msjax.launch.fault_detection import (
    DetectedFault,
    Poll,
    Timings,
    detect,
    name_the_corrupt_rank,
    start_up_failure,
    timings_of,
    use_injection_time,
)
from msjax.launch.incidents import (
    Incident,
    IncidentDir,
    IncidentLog,
    collect_diagnostics,
    flight_verdict,
)
from msjax.launch.job_membership import JobMembership
from msjax.launch.launches import (
    REQUEUE,
    RUNNING,
    append_launch,
    attempt_record,
    newest_committed,
    read_launches,
    requeue_incident,
    scheduler_context,
)
from msjax.launch.layout import JobLayout
from msjax.launch.policy import Action, FaultHistory, decide, ranks_to_kill_at_once
from msjax.launch.slots import (
    SlotFault,
    mark_bad,
    node_name,
    read_slot_faults,
    record_slot_fault,
    slot_of,
)
from msjax.launch.software_faults import repeated_crash
from msjax.launch.workers import WorkerProcess, free_port, stop_workers
from msjax.observe.goodput import session_split, write_goodput
from msjax.parallel.agreement import job_secret
from msjax.resilience import exit_codes, fault_kinds
from msjax.resilience.faults import ENV_VAR as FAULT_ENV_VAR
from msjax.resilience.faults import SLOT_ENV_VAR
from msjax.resilience.skips import read_skipped_steps_here, record_skipped_step
from msjax.run_dir import RunDir
from msjax.writable import warn_write_dropped


def launch_id(layout: JobLayout, context: dict[str, Any], started_unix_s: float) -> str:
    """What names this launch of the job alike on every node (slot faults are grouped by it):
    the job's secret (fresh per launch under launch/slurm), else its scheduler job and
    coordinator; on one node, this supervisor's start."""
    if layout.nnodes == 1:
        return f"{socket.gethostname()} {started_unix_s:.6f}"
    secret = job_secret()
    if secret is not None:
        return hashlib.sha256(secret).hexdigest()[:16]
    return f"{context['slurm_job_id']}.{context['slurm_restart_count']} {layout.coordinator}"


STANDBY_CHECK_EVERY_S = 5.0  # how often a running attempt's warm standbys are looked after


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
        self.node = node_name()
        self.launch_id = launch_id(layout, self.context, self.started_unix_s)
        # which slot runs which rank (one node); spares wait in their own processes
        self.membership = JobMembership(
            config, layout, self.run_dir, faults, spares, self.incidents, self.say
        )
        self.slots = self.membership.slots
        self._standbys_checked = (-1, 0.0)  # the attempt _keep_standbys_ready last looked in, when
        self._recorded_unix_s = 0.0  # when this launch's record was last appended
        self.committed_at_start = newest_committed(self.run_dir)
        self._checkpoints_said = False  # the launch's checkpoints line (train.sbatch reads it)

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
            if not self._checkpoints_said:  # a stop's own last line says it first
                self._say_checkpoints()
            self.membership.close(self.resilience.stop_grace_s)
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _say_checkpoints(self) -> None:
        """The newest committed checkpoint now and at this launch's start, as the launch's last
        line but one: launch/slurm/train.sbatch spends its requeue budget only on a run of the
        job that committed no newer one."""
        now = newest_committed(self.run_dir)
        self._checkpoints_said = True
        self.say(
            f"checkpoints: newest committed step {'none' if now is None else now} (step "
            f"{'none' if self.committed_at_start is None else self.committed_at_start} at this "
            "launch's start)"
        )

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
        self.say(f"incident {number}: requeue: {incident.detail}")

    def _run(self) -> int:
        if self.keeps_record:
            self._open_requeue_incident()
        self._record_launch(time.time(), RUNNING, goodput=False)  # on record before any worker
        restarts = restarts_spent = 0
        stalled = AttemptsWithoutProgress()
        while True:
            attempt, fault = self._self_check(len(self.attempts))
            if attempt is None:
                attempt = self._spawn(len(self.attempts))
                fault = self._watch(attempt)
                if fault is not None:  # the same exception at the same step again: no slot's
                    fault = repeated_crash(fault, self.attempts, self.run_dir.path) or fault
            # what this attempt timed shortens the next one's deadlines from its first step on
            self.timed_before = timings_of(attempt.heartbeats.values(), self.timed_before)
            if self._stop_requested is not None:
                return self._stop_on_request(attempt)
            if fault is None and self.membership.regrow_ready:
                self.membership.stop_for_regrow(attempt)
                continue
            if fault is None:
                stop_workers(attempt.workers, self.resilience.stop_grace_s)  # all exited: reaps
                attempt.outcome = "done"
                self.incidents.close(attempt)
                self._finish("done")
                self.say(f"done: train.steps={self.config.train.steps} reached")
                return exit_codes.OK
            number = self._record_fault(attempt, fault)
            stalled.attempt_ended(self._made_progress(attempt), start_up_failure(fault, attempt))
            history = FaultHistory(restarts, stalled, restarts_spent=restarts_spent)
            action = self._decide(attempt, fault, number, history)
            if self.membership.take_change():  # other slots, another mesh: a fresh count
                stalled = AttemptsWithoutProgress()
            if action.stop_code is not None:
                return self._give_up(fault, action)
            restarts, restarts_spent = action.restart, restarts_spent + action.spends_budget
            self.say(
                f"restart {restarts} ({restarts_spent} of resilience.max_restarts="
                f"{self.resilience.max_restarts} spent) in {action.backoff_s:.1f} s, from the "
                "newest valid checkpoint"
            )
            self._sleep(action.backoff_s)
            if self._stop_requested is not None:
                self._finish(f"stopped by {self._stop_requested}")
                return self._signal_exit_code()

    def _decide(
        self, attempt: Attempt, fault: DetectedFault, number: int, history: FaultHistory
    ) -> Action:
        """The policy's action on incident number (msjax.launch.policy), and its first effects:
        the skipped step, the slot's fault and its marking as bad, the incident's record."""
        slot = slot_of(self.layout, fault.rank, self.node)
        if self.layout.nnodes == 1:  # the slot that holds the rank now (spares, a shrunk mesh)
            slot = str(self.slots.slot_of(fault.rank))
        if slot is None and fault.kind.names_slot:
            self.say(f"rank {fault.rank} runs on another node: node {self.node} is not blamed")
        if fault.kind.names_slot and slot is not None:
            group = f"{self.launch_id}/{attempt.number}"
            record_slot_fault(
                self.run_dir,
                SlotFault(slot, fault.rank, fault.cause, number, fault.fault_unix_s, group),
            )
        history = dataclasses.replace(
            history,
            start_step=attempt.start_step,
            first_step_run=attempt.first_step_run(self._skipped_steps()),
            slot=slot,
            node=self.node,
            slot_faults=tuple(read_slot_faults(self.run_dir)),
            can_leave_slot_out=self.membership.can_leave_out(),
            readmitted_slot_fault=fault.kind.names_slot
            and self.layout.nnodes == 1
            and self.membership.first_fault_since_readmission(int(slot)),
        )
        action = decide(fault, history, self.resilience, self.layout)
        if action.skip_step is not None:
            record_skipped_step(
                self.run_dir.path, action.skip_step, f"non-finite loss (incident {number})"
            )
        if action.bad_slot is not None:
            self._mark_bad(action)
        assert self.incidents.open_incident is not None
        self.incidents.open_incident.take(action)
        if self._excludes(action):
            action = self.membership.exclude(action, fault)
        return action

    def _excludes(self, action: Action) -> bool:
        bad = action.bad_slot
        return (
            bad is not None
            and bad.on_bad_node == "exclude"
            and self.layout.nnodes == 1
            and action.stop_code is None
        )

    def _mark_bad(self, action: Action) -> None:
        bad = action.bad_slot
        assert bad is not None
        try:
            mark_bad(self.run_dir, bad, time.time())
        except OSError as error:  # a full disk: the incident still records it
            warn_write_dropped(self.run_dir.bad_slots, error)
        if bad.on_bad_node == "restart":
            then = "it stays in the job (resilience.on_bad_node=restart)"
        elif self._excludes(action):
            then = "excluding it (resilience.on_bad_node=exclude)"
        elif self.layout.nnodes == 1 and action.stop_code is not None:
            then = "the job stops"
        else:
            then = "leaving it out"
        self.say(f"{bad.reason}; {then}")

    def _made_progress(self, attempt: Attempt) -> bool:
        """Progress is a checkpoint committed past the one the attempt resumed from; without
        checkpoints, steps past it."""
        if not self.config.checkpoint.enabled:
            return attempt.made_progress
        return attempt.committed_progress(self.run_dir.checkpoints)

    def _skipped_steps(self) -> frozenset[int]:
        try:
            return read_skipped_steps_here(self.run_dir.path)  # never JAX in the supervisor
        except (OSError, ValueError, KeyError, TypeError):
            return frozenset()  # the workers refuse a garbled skip list themselves

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self._stop_requested is None:
            self._keep_record_current(time.time())  # a back-off may last minutes
            time.sleep(min(self.poll_s, max(deadline - time.monotonic(), 0)))

    def _self_check(self, number: int) -> tuple[Attempt | None, DetectedFault | None]:
        """The self-checks before attempt `number` (resilience.check_budget_s > 0; msjax.doctor):
        (None, None) when this node's ranks all pass, else an attempt that never started its
        workers and a fault: SELF_CHECK_FAILED naming the first failing rank's slot, or, when
        every slot of one node failed the same check in two rounds in a row (the first is
        checked again once), SHARED_SELF_CHECK_FAILURE: the node's or the storage's, no slot
        to blame (exit 14)."""
        if self.resilience.check_budget_s <= 0:
            return None, None
        from msjax.launch.self_check_rounds import detail, failed_by_every_rank, report_lines

        layout = self.layout
        slots: list[int] | None = None
        if layout.nnodes == 1:  # the slots that will run a rank: spares taking one, a shrunk mesh
            slots = list(self.slots.rank_slots)
            ranks, num_processes = list(range(len(slots))), len(slots)
        else:
            ranks = [layout.process_id(local_rank) for local_rank in range(layout.nprocs)]
            num_processes = layout.num_processes
        # the job's round first: its verdict is RUN_DIR/health/ATTEMPT.json
        checks = self._check_round(number, ranks, num_processes, slots)
        spare_checks = self.membership.start_spare_checks(number)
        health = checks.wait()  # bounded by resilience.check_budget_s
        committed = committed_steps(self.run_dir.checkpoints)
        self.membership.finish_spare_checks(spare_checks, number, committed[-1] if committed else 0)
        for line in report_lines(health):
            self.say(f"self-checks before attempt {number}: {line}")
        shared = failed_by_every_rank(health, ranks) if layout.nnodes == 1 else []
        if shared:
            self.say(
                f"self-checks before attempt {number}: every slot failed {', '.join(shared)}: "
                "the node's or the storage's, not a slot's; checking once more"
            )
            health = self._check_round(number, ranks, num_processes, slots).wait()
            for line in report_lines(health):
                self.say(f"self-checks before attempt {number}, again: {line}")
            shared = failed_by_every_rank(health, ranks)
        if health.passed:
            return None, None
        attempt = Attempt.started(number, [])
        attempt.newest_committed_at_spawn = committed[-1] if committed else None
        self.attempts.append(attempt)
        now = time.time()
        kind, why = fault_kinds.SELF_CHECK_FAILED, detail(health)
        if shared:
            kind = fault_kinds.SHARED_SELF_CHECK_FAILURE
            why = f"every slot failed {', '.join(shared)} in two rounds in a row: {why}"
        fault = DetectedFault(
            kind,
            health.failed_ranks[0],
            why,
            detected_unix_s=now,
            fault_unix_s=now - health.wall_s,
            fault_time_from="the self-checks' start",
            step=committed[-1] if committed else 0,
            phase="self_check",
        )
        return attempt, fault

    def _check_round(
        self, number: int, ranks: list[int], num_processes: int, slots: list[int] | None
    ) -> Any:
        """A round of msjax.doctor's self-checks over ranks (in slots), started."""
        from msjax.launch.self_check_rounds import SelfCheckRound

        return SelfCheckRound(
            self.membership.planned_config(),
            ranks,
            num_processes,
            self.layout.devices_per_proc,
            self.layout.coordinator or f"127.0.0.1:{free_port()}",
            number,
            self.faults,
            slots=slots,
        )

    def _worker_base_env(self) -> dict[str, str]:
        """What every worker's environment holds whatever its rank (spares start with it)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.layout.devices_per_proc is not None:
            env["JAX_NUM_CPU_DEVICES"] = str(self.layout.devices_per_proc)
        if self.faults:
            env[FAULT_ENV_VAR] = self.faults
        return env

    def _spawn(self, number: int) -> Attempt:
        layout = self.layout
        coordinator = layout.coordinator or f"127.0.0.1:{free_port()}"
        args = self.membership.worker_args(self.train_args)
        command = [sys.executable, "-m", "msjax.train", *args]
        committed = committed_steps(self.run_dir.checkpoints)  # before any worker can save
        one_node = layout.nnodes == 1
        num_processes = len(self.slots.rank_slots) if one_node else layout.num_processes
        if one_node:  # ranks a shrunk mesh no longer has: their last records would mislead
            for gone in range(num_processes, layout.nprocs):
                self.run_dir.heartbeat(gone).unlink(missing_ok=True)
                self.run_dir.flight_record(gone).unlink(missing_ok=True)
        workers, warm = [], 0
        for local_rank, slot in enumerate(self.slots.rank_slots):
            rank = layout.process_id(local_rank)
            self.run_dir.heartbeat(rank).unlink(missing_ok=True)
            job_env = {
                **worker_env(coordinator, num_processes, rank, number),
                SLOT_ENV_VAR: str(slot if one_node else rank),  # injected faults follow the slot
                **slot_devices(slot if one_node else local_rank, layout.devices_per_proc),
            }
            echo = self.out if rank == 0 else None
            log = self.run_dir.log(rank)
            waiting = self.membership.take_waiting(slot)
            if waiting is not None:  # a spare or a warm standby: its imports are done
                waiting.assign(rank, log, number, echo)  # before it can print as that rank
                waiting.hand_over(rank, job_env, args)
                workers.append(waiting)
                warm += 1
                continue
            env = {**self._worker_base_env(), **job_env}
            workers.append(WorkerProcess(rank, command, env, log, number, echo=echo))
        self.membership.keep_spares_ready(number, self._worker_base_env())
        attempt = Attempt.started(number, workers)
        attempt.newest_committed_at_spawn = committed[-1] if committed else None
        self.attempts.append(attempt)
        ranks = (
            f"ranks {workers[0].rank}-{workers[-1].rank}"
            if len(workers) > 1
            else f"rank {workers[0].rank}"
        )
        where = ""
        if one_node and (self.slots.spares() or self.membership.shrunk):
            where = f", slots {self.slots.describe()}"
        if warm:
            where += f", {warm} of them waiting with their imports done"
        self.say(
            f"attempt {number}: {len(workers)} workers ({ranks} of {num_processes}), "
            f"coordinator {coordinator}, pids {' '.join(str(w.pid) for w in workers)}{where}"
        )
        return attempt

    def _watch(self, attempt: Attempt) -> DetectedFault | None:
        """Poll exits and heartbeats until the attempt finishes (None) or a detector
        (fault_detection.DETECTORS) finds a fault."""
        last_poll_unix_s = time.time()
        while True:
            if self._stop_requested is not None:
                return None
            now_unix_s = time.time()
            exited = [w for w in attempt.workers if w.poll() is not None]
            attempt.read_heartbeats(self.run_dir)
            self.incidents.update(attempt)
            poll = Poll(
                attempt,
                exited,
                last_poll_unix_s,
                now_unix_s,
                self.resilience,
                self.config.train.steps,
                self.timed_before,
            )
            if poll.all_exited and not poll.failed:
                attempt.ended_unix_s = now_unix_s
            fault = detect(poll)
            if fault is not None:
                name_the_corrupt_rank(fault, self.run_dir)
                use_injection_time(fault, attempt, self.run_dir)
                return fault
            if poll.all_exited:
                return None  # every worker exited 0 and says it finished
            if self.membership.poll_readmission(attempt, self._worker_base_env()):
                return None  # _run stops the attempt and grows the mesh back
            self._keep_standbys_ready(attempt, now_unix_s)
            self._keep_record_current(now_unix_s)
            last_poll_unix_s = now_unix_s
            time.sleep(self.poll_s)

    def _keep_standbys_ready(self, attempt: Attempt, now_unix_s: float) -> None:
        """Once the attempt has stepped for resilience.warm_standby_after_s, a warm standby
        waits in each of its slots (a process with its imports done), so that a restart skips
        them. Not before: their imports would slow the attempt's own start, and a short job
        never needs one. Checked again every few seconds of the attempt, to replace one that
        ended."""
        first_step = attempt.first_step_unix_s
        if not self.resilience.warm_standbys or first_step is None:
            return
        if now_unix_s - first_step < self.resilience.warm_standby_after_s:
            return
        checked_attempt, checked_unix_s = self._standbys_checked
        if (
            checked_attempt == attempt.number
            and now_unix_s - checked_unix_s < STANDBY_CHECK_EVERY_S
        ):
            return
        self._standbys_checked = (attempt.number, now_unix_s)
        started = self.membership.keep_standbys_ready(attempt.number, self._worker_base_env())
        if started:
            slots = " ".join(str(slot) for slot in started)
            self.say(f"attempt {attempt.number}: warm standbys start in slot(s) {slots}")

    # --- after a fault -------------------------------------------------------------------------

    def _record_fault(self, attempt: Attempt, fault: DetectedFault) -> int:
        """Diagnostics into RUN_DIR/incidents/<n>/, then stop every worker. Returns n."""
        self.incidents.close(attempt)
        number = self.incidents.next_number()
        self.say(
            f"incident {number}: {fault.label} ({fault.detail}) "
            f"at step {fault.step}, phase {fault.phase}"
        )
        incident = IncidentDir(self.run_dir.incident(number))
        incident.path.mkdir(parents=True, exist_ok=True)
        # the flight records first: collecting stacks wakes a stopped worker, stopping adds events
        verdict = flight_verdict(self.run_dir, incident)
        collect_diagnostics(attempt, fault, self.run_dir, incident)
        killed_at_once = self._kill_at_once(attempt, fault.rank)
        stop_s, killed = stop_workers(attempt.workers, self.resilience.stop_grace_s)
        attempt.ended_unix_s = time.time()
        attempt.outcome = fault.cause
        diagnostics = str(incident.path.relative_to(self.run_dir.path))
        record = Incident.of_fault(number, fault, attempt, stop_s, diagnostics, verdict, killed)
        record.killed_at_once = killed_at_once
        self.incidents.open(record)
        return number

    def _kill_at_once(self, attempt: Attempt, faulty_rank: int) -> list[int]:
        """SIGKILL the faulty rank (it is not trusted to finish anything), then the other ranks
        with nothing left to finish (policy.ranks_to_kill_at_once), and return the latter. The
        rest get SIGTERM and resilience.stop_grace_s."""
        for worker in attempt.workers:
            if worker.rank == faulty_rank:
                worker.signal(signal.SIGKILL)
        attempt.read_heartbeats(self.run_dir)  # what the others do now that it is gone
        try:
            save_being_written = bool(uncommitted_entries(self.run_dir.checkpoints))
        except OSError:
            save_being_written = True  # not known: each rank gets its grace
        live = {worker.rank for worker in attempt.workers if worker.alive}
        heartbeats = {rank: hb for rank, hb in attempt.heartbeats.items() if rank in live}
        ranks = ranks_to_kill_at_once(faulty_rank, heartbeats, save_being_written)
        for worker in attempt.workers:
            if worker.rank in ranks:
                worker.signal(signal.SIGKILL)
        return ranks

    def _give_up(self, fault: DetectedFault, action: Action) -> int:
        reason, code = action.reason, action.stop_code
        assert code is not None
        self.incidents.write()
        self._finish(f"stopped: {reason}")
        self._say_checkpoints()  # before the last line, which names what stopped the job
        self.say(
            f"stopped after incident {self.incidents.count} ({fault.label}): "
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

    def _keep_record_current(self, now_unix_s: float) -> None:
        """Append this launch's record again every resilience.launch_record_every_s while it runs:
        a launcher killed outright (SIGKILL) leaves its time up to the last one on record."""
        if now_unix_s - self._recorded_unix_s >= self.resilience.launch_record_every_s:
            self._record_launch(now_unix_s, RUNNING, goodput=False)

    def _record_launch(self, ended: float, outcome: str, goodput: bool = True) -> str | None:
        """Append this launch (so far) to launches.jsonl and (goodput) write the run's
        goodput.json; returns goodput's summary line. Node 0's supervisor alone keeps the run's
        record."""
        if not self.keeps_record:
            return None
        self._recorded_unix_s = ended
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
        summary = None
        if goodput:
            summary = write_goodput(self.run_dir, [*self.earlier_launches, launch], outcome)
        append_launch(self.run_dir, launch)
        return summary
