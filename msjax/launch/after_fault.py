"""What the supervisor does once an attempt has a fault: diagnostics into RUN_DIR/incidents/<n>/,
every worker stopped (the faulty rank and those with nothing to finish at once), the policy's
action decided (msjax.launch.policy) and its first effects recorded: the skipped step, the slot's
fault and its marking as bad, the incident's record, the slot left out.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from msjax.checkpoint.commits import uncommitted_entries
from msjax.config import Config, ResilienceConfig
from msjax.launch.attempt import Attempt
from msjax.launch.fault_detection import DetectedFault
from msjax.launch.incidents import (
    Incident,
    IncidentDir,
    IncidentLog,
    collect_diagnostics,
    flight_verdict,
)
from msjax.launch.job_membership import JobMembership
from msjax.launch.layout import JobLayout
from msjax.launch.policy import Action, FaultHistory, decide, ranks_to_kill_at_once
from msjax.launch.slots import SlotFault, mark_bad, read_slot_faults, record_slot_fault, slot_of
from msjax.launch.workers import stop_workers
from msjax.resilience.skips import read_skipped_steps_here, record_skipped_step
from msjax.run_dir import RunDir
from msjax.writable import warn_write_dropped


@dataclass
class AfterFault:
    """Records a fault's incident, stops the attempt, and takes the policy's decision on it."""

    config: Config
    layout: JobLayout
    run_dir: RunDir
    incidents: IncidentLog
    membership: JobMembership
    node: str  # this node's name (slot faults name it)
    launch_id: str  # groups this launch's slot faults (launches.launch_id)
    say: Callable[[str], None]

    @property
    def resilience(self) -> ResilienceConfig:
        return self.config.resilience

    def record_fault(self, attempt: Attempt, fault: DetectedFault) -> int:
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

    def decide(
        self, attempt: Attempt, fault: DetectedFault, number: int, history: FaultHistory
    ) -> Action:
        """The policy's action on incident number (msjax.launch.policy), and its first effects:
        the skipped step, the slot's fault and its marking as bad, the incident's record."""
        slot = self._blamed_slot(attempt, fault, number)
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

    def _blamed_slot(self, attempt: Attempt, fault: DetectedFault, number: int) -> str | None:
        """The slot that ran the faulty rank (None on another node), its fault on record when the
        fault's kind names a slot."""
        slot = slot_of(self.layout, fault.rank, self.node)
        if self.layout.nnodes == 1:  # the slot that holds the rank now (spares, a shrunk mesh)
            slot = str(self.membership.slots.slot_of(fault.rank))
        if slot is None and fault.kind.names_slot:
            self.say(f"rank {fault.rank} runs on another node: node {self.node} is not blamed")
        if fault.kind.names_slot and slot is not None:
            group = f"{self.launch_id}/{attempt.number}"
            record_slot_fault(
                self.run_dir,
                SlotFault(slot, fault.rank, fault.cause, number, fault.fault_unix_s, group),
            )
        return slot

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

    def made_progress(self, attempt: Attempt) -> bool:
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
