"""Which slots of this node run the job, on which mesh, and how that changes: a bad slot is
excluded (a spare takes its rank, or the mesh shrinks onto the healthy slots), an excluded one is
re-admitted once its self-check passes, and the job grows back at a checkpoint. The supervisor
asks; the bookkeeping itself is msjax.launch.membership's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from msjax.checkpoint.commits import committed_steps
from msjax.config import Config
from msjax.errors import MsjaxError
from msjax.launch.attempt import Attempt
from msjax.launch.devices import slot_devices
from msjax.launch.fault_detection import DetectedFault
from msjax.launch.incidents import Incident, IncidentLog
from msjax.launch.layout import JobLayout
from msjax.launch.membership import MeshPlan, Slots, full_plan, replan_mesh
from msjax.launch.policy import Action
from msjax.launch.probe import SlotProbe, probe_failed_incident
from msjax.launch.readmission import Readmission, SlotCheck, kept_out_incident
from msjax.launch.self_check_rounds import HealthRound
from msjax.launch.slots import read_slot_faults
from msjax.launch.workers import WorkerProcess, stop_workers
from msjax.resilience import exit_codes, fault_kinds
from msjax.run_dir import RunDir

# a probe trains past the step a slot failed at (the furthest rank's heartbeat, or the checkpoint
# the attempt resumed from when that is newer): that step and the one after it (the heartbeat may
# not have told the step in flight yet)
PROBE_STEPS_PAST = 2
REGROW = "regrow"  # not a fault: the job stops at a checkpoint to return to a larger mesh


class JobMembership:
    """The slots and mesh of a job on one node (`Slots`, `MeshPlan`), the spares' waiting
    processes, and the re-admission of excluded slots."""

    def __init__(
        self,
        config: Config,
        layout: JobLayout,
        run_dir: RunDir,
        faults: str | None,
        spares: int,
        incidents: IncidentLog,
        say: Callable[[str], None],
    ):
        self.config = config
        self.layout = layout
        self.run_dir = run_dir
        self.incidents = incidents
        self.say = say
        self.slots = Slots(layout.nprocs, spares)
        # processes that did their imports and wait for a rank (msjax.launch.spare), by slot:
        # each spare slot's, and a warm standby in each rank slot (resilience.warm_standbys)
        self.waiting: dict[int, WorkerProcess] = {}
        self.full_plan: MeshPlan | None = None
        if layout.devices_per_proc is not None and layout.nnodes == 1:
            with contextlib.suppress(MsjaxError):  # a mesh that does not fit: workers refuse it
                self.full_plan = full_plan(config, layout.devices_per_proc, layout.nprocs)
        self.plan = self.full_plan
        self.changed = False  # since the supervisor last asked (`take_change`)
        self.regrow_ready = False  # a checkpoint past the re-admission is committed
        self._regrow_after_step: int | None = None  # stop at a checkpoint past this step
        self._readmitted: dict[str, Any] = {}  # slot: its passed check, until the regrow
        self._on_trial: set[int] = set()  # re-admitted slots that have not faulted since
        self.readmission = Readmission(config, layout, run_dir, faults)
        # with self-checks on, a spare waits only once it has passed its own (check_spares)
        checking = config.resilience.check_budget_s > 0
        self.unchecked_spares = set(self.slots.spares()) if checking else set()

    # --- what the workers run ------------------------------------------------------------------

    @property
    def shrunk(self) -> bool:
        return self.plan is not None and self.plan != self.full_plan

    def planned_config(self) -> Config:
        """The job's config on the mesh it runs now (re-planned for the healthy slots)."""
        return self.plan.applied(self.config) if self.shrunk and self.plan else self.config

    def worker_args(self, train_args: list[str]) -> list[str]:
        """The trainer's arguments: the job's, and the re-planned mesh when it is not the job's."""
        if not self.shrunk or self.plan is None:
            return list(train_args)
        return [*train_args, *self.plan.overrides()]

    def take_change(self) -> bool:
        """Whether the membership changed since the last call (the job counts afresh then)."""
        changed, self.changed = self.changed, False
        return changed

    # --- spares --------------------------------------------------------------------------------

    def start_spare_checks(self, attempt: int) -> list[SlotCheck]:
        """The self-checks of the spares not checked yet, each slot alone, started (they run
        beside the job's own round, started before them)."""
        return [self.readmission.start(slot, attempt) for slot in sorted(self.unchecked_spares)]

    def finish_spare_checks(self, checks: list[SlotCheck], attempt: int, step: int) -> None:
        """Wait for each spare's check (bounded by its budget) and judge it: a spare that
        fails is excluded, an incident of its own; one that passes may wait for a rank."""
        for check in checks:
            health = check.checks.wait()
            self.unchecked_spares.discard(check.slot)
            verdict = str(health.path.relative_to(self.run_dir.path))
            if health.passed:
                self.say(f"spare slot {check.slot} passed its self-check ({verdict})")
                continue
            self.slots.drop_spare(check.slot, time.time())
            number = self.incidents.next_number()
            incident = kept_out_incident(
                number, check, health, attempt, step, self.slots, as_spare=True
            )
            self.incidents.add(incident)
            self.say(
                f"incident {number}: spare slot {check.slot} failed its self-check ({verdict}); "
                "excluded, it never waits for a rank"
            )

    def keep_spares_ready(self, number: int, env: dict[str, str]) -> None:
        """A waiting process in every spare slot that passed its check (started anew where one
        has ended)."""
        checked = [slot for slot in self.slots.spares() if slot not in self.unchecked_spares]
        self._keep_waiting(checked, number, env, self.run_dir.spare_log)

    def keep_standbys_ready(self, number: int, env: dict[str, str]) -> list[int]:
        """A warm standby in every slot that runs a rank, for the next restart (started anew
        where one has ended); the slots it started one in. A slot that left the job (excluded)
        has its standby stopped: that process would run on the machine left out."""
        rank_slots, spares = set(self.slots.rank_slots), set(self.slots.spares())
        gone = [slot for slot in self.waiting if slot not in rank_slots | spares]
        stop_workers([self.waiting.pop(slot) for slot in gone], grace_s=1.0)
        return self._keep_waiting(sorted(rank_slots), number, env, self.run_dir.standby_log)

    def _keep_waiting(
        self, slots: list[int], number: int, env: dict[str, str], log: Callable[[int], Path]
    ) -> list[int]:
        started = []
        for slot in slots:
            waiting = self.waiting.get(slot)
            if waiting is not None and waiting.alive:
                continue
            if waiting is not None:
                waiting.close()
            spare_module = [sys.executable, "-m", "msjax.launch.spare"]
            command = [*spare_module, str(self.run_dir.path), str(slot)]
            slot_env = {**env, **slot_devices(slot, self.layout.devices_per_proc)}
            self.waiting[slot] = WorkerProcess(-1, command, slot_env, log(slot), number, echo=None)
            started.append(slot)
        return started

    def take_waiting(self, slot: int) -> WorkerProcess | None:
        """The process waiting in `slot` (a spare, or a rank slot's warm standby), taken out of
        the pool; None where there is none (or it ended while waiting: a fresh worker starts
        instead)."""
        waiting = self.waiting.pop(slot, None)
        if waiting is not None and not waiting.alive:
            waiting.close()
            return None
        return waiting

    def close(self, grace_s: float) -> None:
        """The job ends: a re-admission check under way is cancelled, the waiting processes
        (spares, warm standbys) stop."""
        self.readmission.cancel()
        stop_workers(list(self.waiting.values()), grace_s)

    # --- excluding a bad slot ------------------------------------------------------------------

    def replan(self, healthy: int | None = None) -> MeshPlan:
        """The mesh for the healthy slots, or for `healthy` processes (the job's own when all
        are healthy)."""
        devices_per_proc = self.layout.devices_per_proc
        if self.full_plan is None or devices_per_proc is None:
            raise MsjaxError(
                "the mesh cannot be re-planned without --devices-per-proc (the devices each "
                "process holds) and a mesh that fits them"
            )
        if healthy is None:
            healthy = len(self.slots.healthy())
        return replan_mesh(self.config, devices_per_proc, self.layout.nprocs, healthy)

    def can_leave_out(self) -> bool:
        """Whether the job on this node could go on without one of its slots: a spare takes
        its rank, or a mesh fits the healthy slots left."""
        if self.slots.spares():
            return True
        healthy = len(self.slots.healthy()) - 1
        if healthy < 1:
            return False
        try:
            self.replan(healthy)
        except MsjaxError:
            return False
        return True

    def exclude(self, action: Action, fault: DetectedFault) -> Action:
        """Take the slot the policy marked bad out of the job (one node): a spare takes its
        rank, else the mesh shrinks onto the healthy slots; the restart then runs on them. The
        action becomes a stop (exit 8) where no mesh fits."""
        bad = action.bad_slot
        incident = self.incidents.open_incident
        assert bad is not None and incident is not None
        slot = int(bad.slot)
        faults = {f.incident: f for f in read_slot_faults(self.run_dir)}
        first = faults.get(bad.incidents[0]) if bad.incidents else None
        record: dict[str, Any] = {
            "slot": slot,
            "rank": fault.rank,
            "incidents": list(bad.incidents),
            "first_fault_unix_s": first.fault_unix_s if first else fault.fault_unix_s,
            "detected_unix_s": fault.detected_unix_s,
            "checked_unix_s": None,  # no self-check of the slot on this path
            "excluded_unix_s": time.time(),
            "first_step_unix_s": None,  # on the new mesh: filled in as the next attempt runs
            "first_fault_to_new_mesh_s": None,
        }
        spare = self.slots.exclude(slot, record["excluded_unix_s"])
        if fault.kind is not fault_kinds.SELF_CHECK_FAILED:  # a self-check cannot tell it healed
            committed = committed_steps(self.run_dir.checkpoints)  # the attempt resumed there
            failed_at = max(fault.step, committed[-1] if committed else 0)
            self.readmission.probe_steps[slot] = failed_at + PROBE_STEPS_PAST
        incident.membership = record
        self.changed = True
        why = f"slot {slot} (rank {fault.rank}) excluded"
        if spare is not None:
            record.update(action="spare", spare_slot=spare, slots=self.slots.describe())
            self.say(f"{why}; spare slot {spare} takes rank {fault.rank}, the mesh is unchanged")
            return action
        try:
            plan = self.replan()
        except MsjaxError as error:
            record.update(action="stop", slots=self.slots.describe())
            stop = dataclasses.replace(
                action, stop_code=exit_codes.NO_PROGRESS, reason=f"{why}, and {error}"
            )
            incident.take(stop)
            return stop
        self.slots.arrange(plan.processes)
        self.plan = plan
        record.update(action="shrink", mesh=plan.describe(), slots=self.slots.describe())
        self.say(f"{why}; no spare left: the job goes on on {plan.describe()}")
        return action

    # --- re-admitting it, growing back ---------------------------------------------------------

    def poll_readmission(self, attempt: Attempt, env: dict[str, str]) -> bool:
        """Re-admit an excluded slot once its time out is over and its self-check passes
        (msjax.launch.readmission; one that fails stays out for another time out). On the job's
        own mesh it waits as a spare; on a shrunk one the job stops at its next committed
        checkpoint to grow back (True)."""
        checked = self.readmission.poll(self.slots, attempt.number)
        if checked is not None:
            self._take_readmission_verdict(attempt, *checked, env)
        probe = self.readmission.poll_probe()
        if probe is not None:
            self._take_probe_verdict(attempt, probe, env)
        if self._regrow_after_step is None:
            return False
        committed = committed_steps(self.run_dir.checkpoints)
        self.regrow_ready = bool(committed) and committed[-1] > self._regrow_after_step
        return self.regrow_ready

    def _take_readmission_verdict(
        self, attempt: Attempt, check: SlotCheck, health: HealthRound, env: dict[str, str]
    ) -> None:
        """Re-admit the checked slot (passed) or keep it out another time out (failed)."""
        slot = check.slot
        verdict = str(health.path.relative_to(self.run_dir.path))
        if not health.passed:
            self.slots.keep_out(slot, time.time())
            number = self.incidents.next_number()
            self.incidents.add(
                kept_out_incident(
                    number, check, health, attempt.number, attempt.max_step, self.slots
                )
            )
            self.say(
                f"incident {number}: slot {slot} failed its self-check for re-admission "
                f"({verdict}); it stays excluded, checked again after {self._time_out(slot)}"
            )
            return
        if slot in self.readmission.probe_steps:  # excluded for a fault in training
            probe = self.readmission.start_probe(slot, verdict)
            self.say(
                f"slot {slot} passed its self-check for re-admission ({verdict}); it trains "
                f"alone for {probe.steps} steps, past the step it failed at, before it rejoins"
            )
            return
        self._readmit(attempt, slot, verdict, env)

    def _time_out(self, slot: int) -> str:
        after_s = self.config.resilience.readmit_after_s
        time_out_s = self.slots.time_out_s(slot, after_s)
        return f"{time_out_s:g} s (resilience.readmit_after_s={after_s:g}, doubled each time)"

    def _take_probe_verdict(self, attempt: Attempt, probe: SlotProbe, env: dict[str, str]) -> None:
        """Re-admit the probed slot (it trained past its step) or keep it out (it failed)."""
        why = probe.failure()
        if why is None:
            del self.readmission.probe_steps[probe.slot]
            probe_dir = str(probe.run_dir.relative_to(self.run_dir.path))
            self._readmit(attempt, probe.slot, probe.health, env, probe_dir)
            return
        self.slots.keep_out(probe.slot, time.time())
        number = self.incidents.next_number()
        self.incidents.add(
            probe_failed_incident(number, probe, why, attempt.number, attempt.max_step, self.slots)
        )
        self.say(
            f"incident {number}: slot {probe.slot} failed its training probe for re-admission: "
            f"{why}; it stays excluded, checked again after {self._time_out(probe.slot)}"
        )

    def _readmit(
        self,
        attempt: Attempt,
        slot: int,
        verdict: str,
        env: dict[str, str],
        probe: str | None = None,
    ) -> None:
        """The slot rejoins: a spare on the job's own mesh, else the job grows back at its next
        checkpoint. verdict: its self-check's; probe: its training probe's run dir, if any."""
        after = f"resilience.readmit_after_s={self.config.resilience.readmit_after_s:g}"
        self._on_trial.add(slot)
        passed = "its self-check passed" + (f" and its probe trained ({probe})" if probe else "")
        self.slots.readmit(slot)
        if not self.shrunk:
            self.slots.make_spare(slot)
            self.keep_spares_ready(attempt.number, env)
            self.say(f"slot {slot} re-admitted after {after}, {passed}: a spare now")
            return
        self._readmitted[str(slot)] = {
            "checked_unix_s": time.time(),
            "health": verdict,
            **({"probe": probe} if probe else {}),
        }
        if self._regrow_after_step is None:
            committed = committed_steps(self.run_dir.checkpoints)
            self._regrow_after_step = committed[-1] if committed else -1
        self.say(
            f"slot {slot} re-admitted after {after}, {passed} ({verdict}): the job returns to "
            "a larger mesh at its next checkpoint"
        )

    def first_fault_since_readmission(self, slot: int) -> bool:
        """Whether `slot` was re-admitted and this is its first fault since (asked once per
        fault): such a fault spends no restart (msjax.launch.policy)."""
        if slot not in self._on_trial:
            return False
        self._on_trial.discard(slot)
        return True

    def stop_for_regrow(self, attempt: Attempt) -> None:
        """Stop the shrunk job (SIGTERM: each worker saves and stops) and lay its ranks over
        the mesh for the healthy slots: an incident of its own, no restart counted."""
        self.incidents.close(attempt)
        number = self.incidents.next_number()
        stopped_unix_s = time.time()
        committed = committed_steps(self.run_dir.checkpoints)
        stop_s, killed = stop_workers(attempt.workers, self.config.resilience.stop_grace_s)
        attempt.ended_unix_s = time.time()
        attempt.outcome = REGROW
        self.regrow_ready, self._regrow_after_step = False, None
        readmitted, self._readmitted = self._readmitted, {}
        plan = self.replan()  # fits: it held before on fewer slots
        self.slots.arrange(plan.processes)
        self.plan = plan
        detail = f"checkpoint {committed[-1]} committed after slots were re-admitted"
        self.incidents.open(
            Incident(
                incident=number,
                cause=REGROW,
                rank=None,
                detail=detail,
                attempt=attempt.number,
                phase=None,
                step=attempt.max_step,
                fault_unix_s=stopped_unix_s,
                fault_time_from="re-admission",
                detected_unix_s=stopped_unix_s,
                detection_latency_s=0.0,
                stop_s=round(stop_s, 3),
                diagnostics=None,
                flight_recorder=None,
                action=REGROW,
                killed_after_grace=killed,
                membership={
                    "action": REGROW,
                    "mesh": plan.describe(),
                    "slots": self.slots.describe(),
                    "readmitted": readmitted,
                    "stopped_unix_s": stopped_unix_s,
                    "first_step_unix_s": None,
                },
            )
        )
        self.say(f"incident {number}: {detail}; the job goes on on {plan.describe()}")
