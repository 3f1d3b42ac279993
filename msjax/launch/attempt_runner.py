"""One attempt of the job from start to end: the self-checks before it (msjax.launch.
self_check_rounds), its workers started (spares and warm standbys taking their slots), then their
exits and heartbeats watched until it finishes or a detector (fault_detection) finds a fault.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from msjax.checkpoint.commits import committed_steps
from msjax.config import Config, ResilienceConfig
from msjax.distributed import worker_env
from msjax.launch.attempt import Attempt
from msjax.launch.devices import slot_devices
from msjax.launch.fault_detection import (
    DetectedFault,
    Poll,
    Timings,
    detect,
    name_the_corrupt_rank,
    use_injection_time,
)
from msjax.launch.incidents import IncidentLog
from msjax.launch.job_membership import JobMembership
from msjax.launch.layout import JobLayout
from msjax.launch.membership import Slots
from msjax.launch.self_check_rounds import (
    HealthRound,
    SelfCheckRound,
    detail,
    failed_by_every_rank,
    report_lines,
)
from msjax.launch.workers import WorkerProcess, free_port
from msjax.resilience import fault_kinds
from msjax.resilience.faults import ENV_VAR as FAULT_ENV_VAR
from msjax.resilience.faults import SLOT_ENV_VAR
from msjax.run_dir import RunDir

STANDBY_CHECK_EVERY_S = 5.0  # how often a running attempt's warm standbys are looked after


@dataclass
class AttemptRunner:
    """Starts and watches the job's attempts on this node; `attempts` is the launch's list."""

    config: Config
    layout: JobLayout
    run_dir: RunDir
    train_args: list[str]  # the workers' arguments (--config FILE)
    faults: str | None  # injected faults (MSJAX_FAULT syntax)
    membership: JobMembership
    incidents: IncidentLog
    attempts: list[Attempt]
    out: IO[str]  # rank 0's output is echoed here
    say: Callable[[str], None]
    poll_s: float
    timed_before: Timings = field(default_factory=dict, init=False)  # by the attempts so far
    # the attempt keep_standbys_ready last looked in, and when
    _standbys_checked: tuple[int, float] = field(default=(-1, 0.0), init=False)

    @property
    def resilience(self) -> ResilienceConfig:
        return self.config.resilience

    @property
    def slots(self) -> Slots:
        return self.membership.slots

    # --- self-checks before an attempt ---------------------------------------------------------

    def self_check(self, number: int) -> tuple[Attempt | None, DetectedFault | None]:
        """The self-checks before attempt `number` (resilience.check_budget_s > 0; msjax.doctor):
        (None, None) when this node's ranks all pass, else an attempt that never started its
        workers and a fault: SELF_CHECK_FAILED naming the first failing rank's slot, or, when
        every slot of one node failed the same check in two rounds in a row (the first is
        checked again once), SHARED_SELF_CHECK_FAILURE: the node's or the storage's, no slot
        to blame (exit 14)."""
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
        return self._failed_checks(number, health, shared, committed)

    def _failed_checks(
        self, number: int, health: HealthRound, shared: list[str], committed: list[int]
    ) -> tuple[Attempt, DetectedFault]:
        """An attempt that never started its workers, and the fault its self-checks found."""
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
    ) -> SelfCheckRound:
        """A round of msjax.doctor's self-checks over ranks (in slots), started."""
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

    # --- the attempt's workers -----------------------------------------------------------------

    def worker_base_env(self) -> dict[str, str]:
        """What every worker's environment holds whatever its rank (spares start with it)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.layout.devices_per_proc is not None:
            env["JAX_NUM_CPU_DEVICES"] = str(self.layout.devices_per_proc)
        if self.faults:
            env[FAULT_ENV_VAR] = self.faults
        return env

    def spawn(self, number: int) -> Attempt:
        """Start attempt `number`'s workers, a spare or warm standby taking a slot where one
        waits, and say where they run."""
        layout = self.layout
        coordinator = layout.coordinator or f"127.0.0.1:{free_port()}"
        args = self.membership.worker_args(self.train_args)
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
            worker, was_waiting = self._worker(rank, slot, number, args, job_env)
            workers.append(worker)
            warm += was_waiting
        self.membership.keep_spares_ready(number, self.worker_base_env())
        attempt = Attempt.started(number, workers)
        attempt.newest_committed_at_spawn = committed[-1] if committed else None
        self.attempts.append(attempt)
        self._say_spawned(attempt, coordinator, num_processes, warm)
        return attempt

    def _worker(
        self, rank: int, slot: int, number: int, args: list[str], job_env: dict[str, str]
    ) -> tuple[WorkerProcess, bool]:
        """The rank's worker, and whether it was waiting: a spare or a warm standby in its slot
        (its imports done) is handed the rank, else a fresh process starts."""
        echo = self.out if rank == 0 else None
        log = self.run_dir.log(rank)
        waiting = self.membership.take_waiting(slot)
        if waiting is not None:
            waiting.assign(rank, log, number, echo)  # before it can print as that rank
            waiting.hand_over(rank, job_env, args)
            return waiting, True
        env = {**self.worker_base_env(), **job_env}
        command = [sys.executable, "-m", "msjax.train", *args]
        return WorkerProcess(rank, command, env, log, number, echo=echo), False

    def _say_spawned(
        self, attempt: Attempt, coordinator: str, num_processes: int, warm: int
    ) -> None:
        workers = attempt.workers
        ranks = (
            f"ranks {workers[0].rank}-{workers[-1].rank}"
            if len(workers) > 1
            else f"rank {workers[0].rank}"
        )
        where = ""
        if self.layout.nnodes == 1 and (self.slots.spares() or self.membership.shrunk):
            where = f", slots {self.slots.describe()}"
        if warm:
            where += f", {warm} of them waiting with their imports done"
        self.say(
            f"attempt {attempt.number}: {len(workers)} workers ({ranks} of {num_processes}), "
            f"coordinator {coordinator}, pids {' '.join(str(w.pid) for w in workers)}{where}"
        )

    # --- watching it ---------------------------------------------------------------------------

    def watch(
        self,
        attempt: Attempt,
        stop_requested: Callable[[], bool],
        keep_record_current: Callable[[float], None],
    ) -> DetectedFault | None:
        """Poll exits and heartbeats until the attempt finishes (None), a stop is requested
        (None) or a detector (fault_detection.DETECTORS) finds a fault."""
        last_poll_unix_s = time.time()
        while True:
            if stop_requested():
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
            if self.membership.poll_readmission(attempt, self.worker_base_env()):
                return None  # the supervisor stops the attempt and grows the mesh back
            self._keep_standbys_ready(attempt, now_unix_s)
            keep_record_current(now_unix_s)
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
        started = self.membership.keep_standbys_ready(attempt.number, self.worker_base_env())
        if started:
            slots = " ".join(str(slot) for slot in started)
            self.say(f"attempt {attempt.number}: warm standbys start in slot(s) {slots}")
