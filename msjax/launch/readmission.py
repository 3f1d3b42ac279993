"""A slot checked alone: once resilience.readmit_after_s is over, an excluded slot's self-check
runs while the job goes on; a slot that passes rejoins (the supervisor acts on it), one that fails
stays excluded for another time out, twice as long, an incident of its own (action
`stay_excluded`). A slot excluded for a fault in training must also pass a training probe
(msjax.launch.probe) past the step it failed at. A spare is
checked the same way before it waits; one that fails is excluded (action `exclude_spare`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from msjax.config import Config
from msjax.errors import MsjaxError
from msjax.launch.incidents import Incident
from msjax.launch.layout import JobLayout
from msjax.launch.membership import Slots, replan_mesh
from msjax.launch.probe import SlotProbe, start_probe
from msjax.launch.self_check_rounds import HealthRound, SelfCheckRound, detail
from msjax.launch.workers import free_port, stop_workers
from msjax.resilience.fault_kinds import SELF_CHECK_FAILED
from msjax.run_dir import RunDir

STAY_EXCLUDED = "stay_excluded"  # the incident's action when a slot fails its re-admission check
EXCLUDE_SPARE = "exclude_spare"  # the incident's action when a spare fails its check


@dataclass
class SlotCheck:
    """A slot's self-check for re-admission, under way."""

    slot: int
    checks: SelfCheckRound
    started_unix_s: float


class Readmission:
    """The check for re-admission of one excluded slot at a time (the one excluded longest),
    polled by the supervisor on every poll of an attempt: it never waits on the check."""

    def __init__(self, config: Config, layout: JobLayout, run_dir: RunDir, faults: str | None):
        self.config = config
        self.layout = layout
        self.run_dir = run_dir
        self.faults = faults
        self.running: SlotCheck | None = None
        # slots excluded for a fault in training: the steps their probe runs (msjax.launch.probe)
        self.probe_steps: dict[int, int] = {}
        self.probing: SlotProbe | None = None
        self._probes_started = 0

    def poll(self, slots: Slots, attempt: int) -> tuple[SlotCheck, HealthRound] | None:
        """Start the check of the first slot due when none runs; once the running one has
        settled, that check and its verdict (the slot is still excluded: the caller re-admits
        it or keeps it out)."""
        after_s = self.config.resilience.readmit_after_s
        if self.probing is not None:
            return None  # one slot at a time: its probe first
        if self.running is None:
            due = slots.readmit_due(time.time(), after_s)
            if due:
                self.running = self.start(due[0], attempt)
            return None
        if not self.running.checks.settled():
            return None
        check, self.running = self.running, None
        return check, check.checks.finish()

    def cancel(self) -> None:
        """The job ends: stop a check or a probe under way (no verdict)."""
        if self.running is not None:
            self.running.checks.cancel()
            self.running = None
        if self.probing is not None:
            stop_workers([self.probing.worker], grace_s=1.0)
            self.probing = None

    def start_probe(self, slot: int, health: str) -> SlotProbe:
        """The training probe of `slot`, which passed its self-check (health), started."""
        config, _ = self._one_slot_config()
        self._probes_started += 1
        self.probing = start_probe(
            config,
            slot,
            self.probe_steps[slot],
            self.run_dir,
            self.faults,
            self.layout.devices_per_proc,
            self._probes_started,
            health,
        )
        return self.probing

    def poll_probe(self) -> SlotProbe | None:
        """The probe under way once it has settled (its verdict is the caller's), else None."""
        if self.probing is None or not self.probing.settled():
            return None
        probe, self.probing = self.probing, None
        return probe

    def start(self, slot: int, attempt: int) -> SlotCheck:
        """The self-checks of `slot` alone, started (see _one_slot_config)."""
        config, collectives = self._one_slot_config()
        checks = SelfCheckRound(
            config,
            [0],
            1,
            self.layout.devices_per_proc,
            f"127.0.0.1:{free_port()}",
            attempt,
            self.faults,
            slots=[slot],
            logs=[self.run_dir.check_log(slot)],
            collectives=collectives,
        )
        return SlotCheck(slot, checks, time.time())

    def _one_slot_config(self) -> tuple[Config, bool]:
        """The config a slot is checked alone with: the job's mesh shrunk onto one process (its
        tensor and pipe groups all-reduced within the slot); where none fits one process, the
        job's own config and no all-reduce (the slot holds no whole group to check alone)."""
        devices_per_proc = self.layout.devices_per_proc
        if devices_per_proc is None:
            return self.config, False
        try:
            plan = replan_mesh(self.config, devices_per_proc, self.layout.nprocs, 1)
        except MsjaxError:
            return self.config, False
        return plan.applied(self.config), True


def kept_out_incident(
    number: int,
    check: SlotCheck,
    health: HealthRound,
    attempt: int,
    step: int,
    slots: Slots,
    as_spare: bool = False,
) -> Incident:
    """The incident of a slot that failed its check alone: for re-admission (it stays
    excluded), or as a spare before it waits (it is excluded). `attempt`: the one running, or
    the one about to start; `step`: where the job is."""
    now = time.time()
    action = EXCLUDE_SPARE if as_spare else STAY_EXCLUDED
    checked = "checked as a spare" if as_spare else "checked for re-admission"
    return Incident(
        incident=number,
        cause=SELF_CHECK_FAILED.cause,
        rank=None,  # the slot holds no rank while excluded or waiting
        detail=f"slot {check.slot}, {checked}: {detail(health)}",
        attempt=attempt,
        phase="self_check",
        step=step,
        fault_unix_s=check.started_unix_s,
        fault_time_from="the self-checks' start",
        detected_unix_s=now,
        detection_latency_s=round(now - check.started_unix_s, 3),
        stop_s=0.0,
        diagnostics=str(health.path.relative_to(check.checks.run_dir.path)),
        flight_recorder=None,
        action=action,
        membership={
            "action": action,
            "slot": check.slot,
            "checked_unix_s": now,
            "health": str(health.path.relative_to(check.checks.run_dir.path)),
            "slots": slots.describe(),
        },
    )
