"""What the supervisor does after a fault: decide, a pure function of the fault, the job's history,
its resilience config and layout. The kind's own action is its row in msjax.resilience.fault_kinds;
the limits around it (bad slots, restart budget, no progress, multi-node jobs) are applied here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from msjax.config import ResilienceConfig
from msjax.launch.attempt import AttemptsWithoutProgress
from msjax.launch.fault_detection import DetectedFault
from msjax.launch.layout import JobLayout
from msjax.launch.slots import BadSlot, SlotFault, faults_in_a_row
from msjax.resilience import exit_codes, fault_kinds
from msjax.resilience.heartbeat import HeartbeatRecord

MAX_BACKOFF_S = 300.0
# phases in which a worker starts no save of its own (a save started before may still be written
# in the background: the checkpoints directory shows it, an unfinished step)
PHASES_WITHOUT_SAVES = ("compile", "step", "eval")


@dataclass(frozen=True)
class FaultHistory:
    """What the job has been through, as far as the policy needs it."""

    restarts: int  # restarts so far, before this fault's
    stalled: AttemptsWithoutProgress  # counted with the attempt this fault ended
    start_step: int | None = None  # the step the faulted attempt resumed at
    first_step_run: int | None = None  # the first step it computed (past skipped steps)
    slot: str | None = "0"  # the fault rank's slot (slots.slot_of); None: on another node
    node: str = ""  # the node this supervisor runs on
    slot_faults: tuple[SlotFault, ...] = ()  # the run's, this fault's included, oldest first
    # whether the job could go on without the fault's slot (a spare, or a mesh on the rest)
    can_leave_slot_out: bool = True
    # restarts so far that spent resilience.max_restarts (restart_spends_budget)
    restarts_spent: int = 0
    # the first fault of a slot re-admitted since (msjax.launch.readmission): the slot's
    # trial, not the job's failure; it spends no restart of resilience.max_restarts
    readmitted_slot_fault: bool = False


@dataclass(frozen=True)
class Action:
    """Restart (stop_code None) after backoff_s as restart number `restart`, or stop with
    stop_code for reason; skip_step: first add that step to the run's skipped steps."""

    stop_code: int | None = None
    reason: str = ""
    skip_step: int | None = None
    backoff_s: float = 0.0
    restart: int = 0
    bad_slot: BadSlot | None = None  # the fault's slot, marked bad now
    spends_budget: bool = False  # this restart spends resilience.max_restarts

    @property
    def name(self) -> str:
        """The incident's action."""
        return fault_kinds.RESTART if self.stop_code is None else fault_kinds.STOP


def decide(
    fault: DetectedFault, history: FaultHistory, resilience: ResilienceConfig, layout: JobLayout
) -> Action:
    """The fault kind's action, then the job's limits, first match wins: a multi-node job whose
    slot (this node) is marked bad stops with exit 9 under on_bad_node=exclude, a multi-node job
    restarts as a whole (exit 5), attempts without progress stop it (2 or 8), and so does a
    spent restart budget (4); else restart: at once after an attempt that made progress, else
    after a backoff that doubles per attempt without progress.
    A slot marked bad on one node under exclude is left out by the supervisor at the restart
    (msjax.launch.membership): attempts without progress do not stop the job then (it counts
    them afresh on its new membership), unless they are the same crash before the first step
    (a mistake, exit 2), or no spare and no smaller mesh could take the slot's place; a spent
    restart budget still does."""
    action = fault.kind.action
    if action == fault_kinds.STOP:
        code = fault.kind.stop_code or fault.kind.exit_code or exit_codes.CRASHED
        return _stop(_stop_reason(fault), code)
    skip_step = None
    if action == fault_kinds.SKIP_STEP:
        stop = _nonfinite_stop(fault, history, resilience)
        if stop is not None:
            return stop
        skip_step = fault.nonfinite_step
    bad = bad_slot(fault, history, resilience, layout)
    excluding = bad is not None and bad.on_bad_node == "exclude"
    if excluding and layout.nnodes > 1:
        reason = f"{bad.reason}; requeue the job without node {bad.node}"
        return Action(exit_codes.BAD_NODE, reason, skip_step, bad_slot=bad)
    limits = _limits(
        fault.kind, history, resilience, layout, skip_step, excluding and history.can_leave_slot_out
    )
    return dataclasses.replace(limits, bad_slot=bad)


def bad_slot(
    fault: DetectedFault, history: FaultHistory, resilience: ResilienceConfig, layout: JobLayout
) -> BadSlot | None:
    """The fault's slot, if this fault marks it bad: a kind that does (a failed self-check,
    persistent corruption), or max_faults_per_slot faults in a row it was the named cause of,
    unless it is the only slot of a one-process job (faults in a row tell nothing of a slot
    with no other to compare it with, and the job cannot go on without it). None for a rank of
    another node: that node's launcher marks its own."""
    if not fault.kind.names_slot or history.slot is None:
        return None
    in_a_row = faults_in_a_row(history.slot_faults, history.slot)
    limit = resilience.max_faults_per_slot
    only_slot = layout.num_processes == 1 and not history.can_leave_slot_out
    if fault.kind.action == fault_kinds.MARK_SLOT_BAD:
        why = f"{fault.kind.name.replace('_', ' ')} on rank {fault.rank}"
    elif len(in_a_row) >= limit and not only_slot:
        incidents = ", ".join(str(f.incident) for f in in_a_row)
        causes = ", ".join(f.cause for f in in_a_row)
        several = len(in_a_row) > 1
        faults = f"{len(in_a_row)} faults in a row" if several else "1 fault"
        named = "incidents" if several else "incident"
        why = (
            f"the named cause of {faults} ({named} {incidents}: {causes}; "
            f"resilience.max_faults_per_slot={limit})"
        )
    else:
        return None
    where = f"node {history.node}" if layout.nnodes > 1 else f"slot {history.slot}"
    return BadSlot(
        history.slot,
        history.node,
        fault.rank,
        f"{where} is marked bad: {why}",
        resilience.on_bad_node,
        tuple(f.incident for f in in_a_row),
    )


def _limits(
    kind: fault_kinds.FaultKind,
    history: FaultHistory,
    resilience: ResilienceConfig,
    layout: JobLayout,
    skip_step: int | None,
    excluding: bool = False,
) -> Action:
    if layout.nnodes > 1:
        return _stop(
            "a multi-node job restarts as a whole; the scheduler resumes it",
            exit_codes.JOB_RESTART_NEEDED,
            skip_step,
        )
    infrastructure = kind is fault_kinds.INFRASTRUCTURE
    stop = None
    if not infrastructure:  # the machine room's faults are neither a mistake nor this machine's
        stop = _stalled_stop(history.stalled, resilience.max_attempts_without_progress, excluding)
    # a re-admitted slot's first fault is the slot's trial (msjax.launch.readmission)
    spends = restart_spends_budget(history.stalled) and not history.readmitted_slot_fault
    budget = resilience.max_restarts
    if stop is None and (budget == 0 or (spends and history.restarts_spent >= budget)):
        stop = _stop(
            f"restart budget spent (resilience.max_restarts={budget}: restarts after an "
            "attempt that committed no newer checkpoint; 0: none at all)",
            exit_codes.INFRASTRUCTURE if infrastructure else exit_codes.RESTARTS_EXHAUSTED,
        )
    if stop is not None:
        return Action(stop.stop_code, stop.reason, skip_step)
    doublings = max(history.stalled.count - 1, 0)
    if infrastructure:
        backoff_s = min(
            resilience.infrastructure_backoff_s * 2**doublings,
            resilience.infrastructure_backoff_max_s,
        )
    elif history.stalled.count == 0:
        # the attempt made progress: nothing says a restart now fails again, so none waits
        backoff_s = 0.0
    else:
        backoff_s = min(resilience.restart_backoff_s * 2**doublings, MAX_BACKOFF_S)
    return Action(
        skip_step=skip_step,
        backoff_s=backoff_s,
        restart=history.restarts + 1,
        spends_budget=spends,
    )


def restart_spends_budget(stalled: AttemptsWithoutProgress) -> bool:
    """The restart budget's rule: a restart spends resilience.max_restarts only when the attempt
    it follows committed no checkpoint newer than the one it resumed from. A fault after progress
    costs nothing, so that a run of weeks is not ended by its eleventh fault however much it
    committed in between; faults with nothing committed between them still end it.
    resilience.max_restarts=0 restarts nothing: the job stops at its first fault."""
    return stalled.count > 0


def _stop(reason: str, code: int, skip_step: int | None = None) -> Action:
    return Action(stop_code=code, reason=reason, skip_step=skip_step)


def _stop_reason(fault: DetectedFault) -> str:
    if fault.kind is fault_kinds.USER_ERROR:
        return "a worker reported a user error"
    if fault.kind is fault_kinds.SHARED_SELF_CHECK_FAILURE:
        return f"the node's or the storage's failure, not a slot's (retry later): {fault.detail}"
    if fault.kind is fault_kinds.SOFTWARE_FAULT:  # its detail names the exception, step and log
        return (
            f"the same failure again, the program's or its inputs', not a machine's: {fault.detail}"
        )
    return f"a worker reported {fault.kind.name.replace('_', ' ')}"


def _nonfinite_stop(
    fault: DetectedFault, history: FaultHistory, resilience: ResilienceConfig
) -> Action | None:
    """A non-finite loss ends the job under on_nonfinite_loss=stop, or when it came from the
    attempt's first step: then the state it restored is bad, not a batch, and skipping cannot
    help. None: roll back (skip that step)."""
    assert fault.nonfinite_step is not None
    if resilience.on_nonfinite_loss == "stop":
        return _stop(
            f"non-finite loss at step {fault.nonfinite_step} (resilience.on_nonfinite_loss=stop)",
            exit_codes.NONFINITE_LOSS,
        )
    if fault.nonfinite_step == history.first_step_run:
        return _stop(
            f"non-finite loss at step {fault.nonfinite_step}, the first step after "
            f"resuming at step {history.start_step}: the state is bad, not a batch "
            "(skipping batches cannot help)",
            exit_codes.NONFINITE_LOSS,
        )
    return None


def _stalled_stop(
    stalled: AttemptsWithoutProgress, limit: int, excluding: bool = False
) -> Action | None:
    """Attempts in a row without progress: the same crash before the first step each time is a
    mistake (exit 2); otherwise this machine cannot go on (exit 8), unless a slot is being left
    out now (`excluding`): the job then changes, and counts its attempts afresh."""
    if stalled.same_start_up_failures >= limit:
        return _stop(
            f"the same failure before the first step in {limit} attempts in a row "
            f"({stalled.start_up_failure}); restarting cannot help "
            f"(resilience.max_attempts_without_progress={limit})",
            exit_codes.USER_ERROR,
        )
    if stalled.count >= limit and not excluding:
        return _stop(
            f"{stalled.count} attempts in a row committed no checkpoint newer than the "
            f"one they resumed from (resilience.max_attempts_without_progress={limit})",
            exit_codes.NO_PROGRESS,
        )
    return None


def ranks_to_kill_at_once(
    faulty_rank: int, heartbeats: dict[int, HeartbeatRecord], save_being_written: bool
) -> list[int]:
    """The other ranks of a faulted attempt that are SIGKILLed at once rather than given
    resilience.stop_grace_s after SIGTERM: those whose last heartbeat says they are stepping,
    compiling or evaluating while no save is being written. With the faulty rank gone, no save
    can be entered together any more, so the grace could only let a save already in flight
    finish; such a rank has none (one stuck in a collective would wait out the whole grace).
    A rank in phase checkpoint or drain, or without a heartbeat, gets its grace."""
    if save_being_written:
        return []
    return sorted(
        rank
        for rank, record in heartbeats.items()
        if rank != faulty_rank and record.phase in PHASES_WITHOUT_SAVES
    )
