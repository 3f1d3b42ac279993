"""The fault table (msjax.resilience.fault_kinds) and the supervisor's pure policy
(msjax.launch.policy.decide): what each kind of fault makes the supervisor do, with the limits
around it, from plain inputs (no processes)."""

from __future__ import annotations

import dataclasses
import errno
from pathlib import Path

import pytest

from msjax.checkpoint.read_errors import CheckpointUnreadable
from msjax.config import ResilienceConfig
from msjax.errors import MsjaxError
from msjax.launch.attempt import Attempt, AttemptsWithoutProgress
from msjax.launch.fault_detection import DetectedFault
from msjax.launch.incidents import Incident, IncidentLog
from msjax.launch.layout import JobLayout
from msjax.launch.policy import FaultHistory, decide, ranks_to_kill_at_once
from msjax.launch.slots import SlotFault, faults_in_a_row, slot_of
from msjax.parallel.agreement import VoteTimeout
from msjax.resilience import exit_codes, fault_kinds
from msjax.resilience.compile_cache import StaleCompileCache
from msjax.resilience.fault_kinds import KINDS, kind_of_error, kind_of_exit
from msjax.resilience.heartbeat import HeartbeatRecord
from msjax.resilience.worker import NonFiniteLoss, SavesFailing
from msjax.run_dir import RunDir
from msjax.writable import WriteFailed

ONE_NODE = JobLayout(nprocs=2, devices_per_proc=1)
TWO_NODES = JobLayout(nprocs=1, devices_per_proc=1, nnodes=2)


def fault(kind: fault_kinds.FaultKind, step: int = 5, nonfinite_step: int | None = None):
    return DetectedFault(
        kind,
        1,
        "detail",
        10.0,
        9.0,
        "exit seen by polling",
        step,
        "step",
        nonfinite_step=nonfinite_step,
    )


def history(
    restarts: int = 0, stalled: int = 0, start_step: int = 0, spent: int = 0, **more
) -> FaultHistory:
    return FaultHistory(
        restarts,
        AttemptsWithoutProgress(count=stalled, **more),
        start_step,
        start_step,
        restarts_spent=spent,
    )


def test_each_worker_exit_code_belongs_to_one_kind():
    codes = [kind.exit_code for kind in KINDS if kind.exit_code is not None]
    assert len(codes) == len(set(codes))
    assert kind_of_exit(exit_codes.SAVES_FAILED) is fault_kinds.SAVES_FAILED
    assert kind_of_exit(exit_codes.SELF_CHECK_FAILED).cause == "self_check_failed"
    assert kind_of_exit(exit_codes.SILENT_CORRUPTION).action == fault_kinds.MARK_SLOT_BAD
    assert kind_of_exit(exit_codes.BAD_NODE).action == fault_kinds.MARK_SLOT_BAD
    assert kind_of_exit(-9) is fault_kinds.CRASH  # a signal
    assert kind_of_exit(99) is fault_kinds.CRASH  # a code no kind has
    assert {kind.action for kind in KINDS} <= set(fault_kinds.ACTIONS)
    assert all(kind.exit_code is not None for kind in KINDS if kind.exceptions)


def test_reserved_exit_codes_are_distinct():
    assert (exit_codes.BAD_NODE, exit_codes.SELF_CHECK_FAILED, exit_codes.SILENT_CORRUPTION) == (
        9,
        10,
        11,
    )


@pytest.mark.parametrize(
    ("error", "code", "reason"),
    [
        (MsjaxError("bad key\nmore"), exit_codes.USER_ERROR, "bad key"),
        (
            NonFiniteLoss(7, float("nan")),
            exit_codes.NONFINITE_LOSS,
            "the loss of step 7 is not finite",
        ),
        (SavesFailing("x"), exit_codes.SAVES_FAILED, "checkpoint saves kept failing"),
        (WriteFailed("disk full"), exit_codes.INFRASTRUCTURE, "disk full"),
        (
            OSError(errno.ENOSPC, "No space left on device"),
            exit_codes.INFRASTRUCTURE,
            "[Errno 28] No space left on device",
        ),
        (
            RuntimeError("Unable to initialize backend 'cuda': no devices\nmore"),
            exit_codes.INFRASTRUCTURE,
            "Unable to initialize backend 'cuda': no devices",
        ),
        (
            VoteTimeout("stop", 3, [1], 2.0),
            exit_codes.CRASHED,
            "vote stop round 3: no vote from rank(s) 1 within 2 s",
        ),
        (
            CheckpointUnreadable("x"),
            exit_codes.CHECKPOINT_UNREADABLE,
            "a checkpoint could not be read",
        ),
        (KeyboardInterrupt(), exit_codes.INTERRUPTED, "interrupted"),
    ],
)
def test_a_worker_error_finds_its_kind(error, code, reason):
    kind = kind_of_error(error)
    assert kind is not None and kind.exit_code == code
    assert kind.reason(error) == reason


def test_an_unexpected_error_is_no_kind_of_its_own():
    assert kind_of_error(ValueError("boom")) is None  # a crash with its traceback


def test_a_user_error_is_one_line():
    kind = kind_of_error(MsjaxError("bad\n  key"))
    assert (
        kind is fault_kinds.USER_ERROR and kind.line(MsjaxError("bad\n  key")) == "error: bad key"
    )


def test_a_crash_restarts_with_a_backoff_that_doubles_per_attempt_without_progress():
    resilience = ResilienceConfig(restart_backoff_s=1.5)
    first = decide(fault(fault_kinds.CRASH), history(stalled=1), resilience, ONE_NODE)
    assert (first.stop_code, first.backoff_s, first.restart, first.name) == (
        None,
        1.5,
        1,
        "restart",
    )
    stalled = decide(fault(fault_kinds.HANG), history(restarts=3, stalled=2), resilience, ONE_NODE)
    assert (stalled.backoff_s, stalled.restart) == (3.0, 4)


def test_a_fault_after_progress_restarts_at_once():
    """An attempt that committed a newer checkpoint before its fault says nothing about the next
    one failing: no backoff delays its restart (restart latency); one without progress waits."""
    resilience = ResilienceConfig(restart_backoff_s=1.5)
    after_progress = decide(fault(fault_kinds.CRASH), history(restarts=4), resilience, ONE_NODE)
    assert (after_progress.stop_code, after_progress.backoff_s, after_progress.restart) == (
        None,
        0.0,
        5,
    )
    stuck = decide(fault(fault_kinds.CRASH), history(restarts=4, stalled=1), resilience, ONE_NODE)
    assert stuck.backoff_s == 1.5


def test_the_backoff_is_capped():
    resilience = ResilienceConfig(restart_backoff_s=100.0, max_attempts_without_progress=9)
    action = decide(fault(fault_kinds.CRASH), history(stalled=5), resilience, ONE_NODE)
    assert action.backoff_s == 300.0


def test_a_user_error_stops_with_exit_2_whatever_the_budget():
    action = decide(fault(fault_kinds.USER_ERROR), history(), ResilienceConfig(), ONE_NODE)
    assert (action.stop_code, action.name) == (exit_codes.USER_ERROR, "stop")
    assert action.reason == "a worker reported a user error"


def test_the_restart_budget_spent_is_exit_4():
    resilience = ResilienceConfig(max_restarts=2)
    first = decide(fault(fault_kinds.CRASH), history(1, stalled=1, spent=1), resilience, ONE_NODE)
    assert (first.restart, first.spends_budget) == (2, True)
    spent = decide(fault(fault_kinds.CRASH), history(2, stalled=1, spent=2), resilience, ONE_NODE)
    assert spent.stop_code == exit_codes.RESTARTS_EXHAUSTED
    assert "resilience.max_restarts=2" in spent.reason


def test_a_restart_after_progress_spends_no_budget():
    """The eleventh fault of a long run that committed checkpoints between its faults restarts:
    only restarts after an attempt that committed nothing new spend resilience.max_restarts."""
    resilience = ResilienceConfig(max_restarts=10)
    after_progress = decide(
        fault(fault_kinds.CRASH), history(10, stalled=0, spent=3), resilience, ONE_NODE
    )
    assert (after_progress.stop_code, after_progress.restart) == (None, 11)
    assert after_progress.spends_budget is False
    stuck = decide(fault(fault_kinds.CRASH), history(10, stalled=1, spent=10), resilience, ONE_NODE)
    assert stuck.stop_code == exit_codes.RESTARTS_EXHAUSTED
    assert stuck.reason.startswith("restart budget spent (resilience.max_restarts=10: restarts ")
    none = decide(fault(fault_kinds.CRASH), history(), ResilienceConfig(max_restarts=0), ONE_NODE)
    assert none.stop_code == exit_codes.RESTARTS_EXHAUSTED  # 0: the first fault ends the job


def test_infrastructure_faults_back_off_for_minutes_then_end_retryable_never_as_a_mistake():
    resilience = ResilienceConfig(
        max_restarts=9,
        max_attempts_without_progress=3,
        infrastructure_backoff_s=5.0,
        infrastructure_backoff_max_s=240.0,
    )
    infrastructure = fault(fault_kinds.INFRASTRUCTURE)
    backoffs = [
        decide(infrastructure, history(n - 1, stalled=n, spent=n - 1), resilience, ONE_NODE)
        for n in range(1, 10)
    ]
    assert [a.stop_code for a in backoffs] == [None] * 9  # past the limit of stalled attempts
    assert [a.backoff_s for a in backoffs] == [5, 10, 20, 40, 80, 160, 240, 240, 240]
    same = history(9, stalled=10, spent=9, start_up_failure="x", same_start_up_failures=10)
    last = decide(infrastructure, same, resilience, ONE_NODE)
    assert last.stop_code == exit_codes.INFRASTRUCTURE in exit_codes.RETRYABLE
    assert "resilience.max_restarts=9" in last.reason


def test_attempts_without_progress_are_exit_8_or_2_when_the_same_start_up_crash():
    resilience = ResilienceConfig(max_attempts_without_progress=3)
    stalled = decide(fault(fault_kinds.CRASH), history(stalled=3), resilience, ONE_NODE)
    assert stalled.stop_code == exit_codes.NO_PROGRESS
    same = history(stalled=3, start_up_failure="exit 1 in phase init: #", same_start_up_failures=3)
    mistake = decide(fault(fault_kinds.CRASH), same, resilience, ONE_NODE)
    assert mistake.stop_code == exit_codes.USER_ERROR and "exit 1 in phase init" in mistake.reason
    assert decide(fault(fault_kinds.CRASH), history(stalled=2), resilience, ONE_NODE).restart == 1


def test_a_nonfinite_loss_skips_its_step_then_restarts():
    action = decide(
        fault(fault_kinds.NONFINITE_LOSS, nonfinite_step=12),
        history(start_step=10),
        ResilienceConfig(),
        ONE_NODE,
    )
    assert (action.skip_step, action.stop_code, action.restart) == (12, None, 1)


def test_a_nonfinite_loss_on_the_first_step_run_or_under_stop_ends_the_job():
    on_first = decide(
        fault(fault_kinds.NONFINITE_LOSS, nonfinite_step=10),
        history(start_step=10),
        ResilienceConfig(),
        ONE_NODE,
    )
    assert (on_first.stop_code, on_first.skip_step) == (exit_codes.NONFINITE_LOSS, None)
    assert "resuming at step 10" in on_first.reason
    stop = decide(
        fault(fault_kinds.NONFINITE_LOSS, nonfinite_step=12),
        history(start_step=10),
        ResilienceConfig(on_nonfinite_loss="stop"),
        ONE_NODE,
    )
    assert (stop.stop_code, stop.skip_step) == (exit_codes.NONFINITE_LOSS, None)


def test_a_multi_node_job_skips_the_step_then_restarts_as_a_whole():
    action = decide(
        fault(fault_kinds.NONFINITE_LOSS, nonfinite_step=12),
        history(start_step=10),
        ResilienceConfig(),
        TWO_NODES,
    )
    assert (action.stop_code, action.skip_step) == (exit_codes.JOB_RESTART_NEEDED, 12)
    crash = decide(fault(fault_kinds.CRASH), history(), ResilienceConfig(), TWO_NODES)
    assert crash.stop_code == exit_codes.JOB_RESTART_NEEDED


BASE_KEYS = [
    "incident",
    "cause",
    "rank",
    "detail",
    "attempt",
    "phase",
    "step",
    "fault_unix_s",
    "fault_time_from",
    "detected_unix_s",
    "detection_latency_s",
    "stop_s",
    "diagnostics",
    "flight_recorder",
    "action",
    "resumed_from_step",
    "steps_lost",
    "restart_s",
    "catch_up_s",
    "killed_after_grace",
]


def incident_of(kind: fault_kinds.FaultKind, **fields) -> Incident:
    attempt = Attempt(number=2, workers=[], spawned_unix_s=8.0)
    detected = fault(kind, **fields)
    return Incident.of_fault(4, detected, attempt, 0.5, "incidents/4", None, [1])


def test_an_incident_record_keeps_its_keys_and_takes_the_action_decided():
    restarted = incident_of(fault_kinds.CRASH)
    assert list(restarted.record()) == BASE_KEYS
    stalled = history(stalled=1)
    restarted.take(decide(fault(fault_kinds.CRASH), stalled, ResilienceConfig(), ONE_NODE))
    record = restarted.record()
    assert list(record) == [*BASE_KEYS, "backoff_s", "restart"]
    assert (record["cause"], record["action"], record["restart"], record["backoff_s"]) == (
        "crash",
        "restart",
        1,
        1.0,
    )
    assert (record["detection_latency_s"], record["killed_after_grace"]) == (1.0, [1])
    stopped = incident_of(fault_kinds.NONFINITE_LOSS, nonfinite_step=12)
    action = decide(
        fault(fault_kinds.NONFINITE_LOSS, nonfinite_step=12),
        history(start_step=10),
        ResilienceConfig(),
        TWO_NODES,
    )
    stopped.take(action)
    record = stopped.record()
    assert (record["action"], record["skipped_step"], "restart" in record) == ("stop", 12, False)
    assert record["stop_reason"] == action.reason


def slot_fault(slot: str, incident: int, at: float, group: str | None = None) -> SlotFault:
    return SlotFault(
        slot, int(slot) if slot.isdigit() else 1, "crash", incident, at, group or f"g{incident}"
    )


def slot_history(slot: str, faults: list[SlotFault], node: str = "host") -> FaultHistory:
    return dataclasses.replace(history(), slot=slot, node=node, slot_faults=tuple(faults))


def test_a_slot_is_bad_after_max_faults_per_slot_faults_in_a_row_it_caused():
    resilience = ResilienceConfig(max_faults_per_slot=3)
    two = [slot_fault("3", 1, 1.0), slot_fault("3", 2, 2.0)]
    assert (
        decide(fault(fault_kinds.CRASH), slot_history("3", two), resilience, ONE_NODE).bad_slot
        is None
    )
    three = [*two, slot_fault("3", 3, 3.0)]
    action = decide(fault(fault_kinds.HANG), slot_history("3", three), resilience, ONE_NODE)
    assert action.bad_slot is not None
    assert (action.bad_slot.slot, action.bad_slot.incidents) == ("3", (1, 2, 3))
    assert action.bad_slot.reason == (
        "slot 3 is marked bad: the named cause of 3 faults in a row (incidents 1, 2, 3: crash, "
        "crash, crash; resilience.max_faults_per_slot=3)"
    )
    # on one node: a restart, without the slot (the supervisor excludes it)
    assert (action.stop_code, action.restart, action.bad_slot.on_bad_node) == (None, 1, "exclude")


def test_with_max_faults_per_slot_1_the_first_fault_marks_the_slot_bad_in_the_singular():
    resilience = ResilienceConfig(max_faults_per_slot=1)
    one = [slot_fault("3", 1, 1.0)]
    action = decide(fault(fault_kinds.CRASH), slot_history("3", one), resilience, ONE_NODE)
    assert action.bad_slot is not None
    assert action.bad_slot.reason == (
        "slot 3 is marked bad: the named cause of 1 fault (incident 1: crash; "
        "resilience.max_faults_per_slot=1)"
    )


def test_with_the_defaults_a_slot_crashing_at_every_start_is_excluded_before_no_progress_stops():
    resilience = ResilienceConfig()  # max_faults_per_slot = max_attempts_without_progress = 3
    three = [slot_fault("3", n, float(n)) for n in (1, 2, 3)]
    stalled = dataclasses.replace(slot_history("3", three), stalled=history(stalled=3).stalled)
    action = decide(fault(fault_kinds.CRASH), stalled, resilience, ONE_NODE)
    assert action.bad_slot is not None and action.bad_slot.slot == "3"
    assert (action.stop_code, action.restart) == (None, 1)  # restarts without slot 3
    # without a slot to leave out, the same history stops the job (exit 8)
    others = [slot_fault("1", 1, 1.0), slot_fault("2", 2, 2.0), slot_fault("3", 3, 3.0)]
    stuck = dataclasses.replace(slot_history("3", others), stalled=history(stalled=3).stalled)
    assert decide(fault(fault_kinds.CRASH), stuck, resilience, ONE_NODE).stop_code == (
        exit_codes.NO_PROGRESS
    )
    # nor where the job cannot go on without slot 3 (no spare, no smaller mesh): exit 8
    alone = dataclasses.replace(stalled, can_leave_slot_out=False)
    cornered = decide(fault(fault_kinds.CRASH), alone, resilience, ONE_NODE)
    assert cornered.stop_code == exit_codes.NO_PROGRESS and cornered.bad_slot is not None
    assert cornered.reason.startswith("3 attempts in a row committed no checkpoint newer")
    # the same crash before the first step each time is a mistake, slot or not (exit 2)
    same = history(stalled=3, start_up_failure="exit 1 in phase init: #", same_start_up_failures=3)
    mistake = dataclasses.replace(slot_history("3", three), stalled=same.stalled)
    assert decide(fault(fault_kinds.CRASH), mistake, resilience, ONE_NODE).stop_code == (
        exit_codes.USER_ERROR
    )


def test_a_fault_of_another_slot_between_breaks_the_row():
    resilience = ResilienceConfig(max_faults_per_slot=2)
    faults = [slot_fault("3", 1, 1.0), slot_fault("1", 2, 2.0), slot_fault("3", 3, 3.0)]
    assert (
        decide(fault(fault_kinds.CRASH), slot_history("3", faults), resilience, ONE_NODE).bad_slot
        is None
    )


def test_in_one_attempt_of_the_job_the_first_fault_is_the_cause_the_others_follow_from_it():
    # node n2's crash made n1's worker fail too, seen a moment later by n1's launcher (and
    # written first)
    faults = [
        slot_fault("n2", 1, 1.0, "a"),
        slot_fault("n1", 3, 2.6, "b"),
        slot_fault("n2", 2, 2.5, "b"),
    ]
    assert [f.incident for f in faults_in_a_row(faults, "n2")] == [1, 2]
    assert faults_in_a_row(faults, "n1") == []
    resilience = ResilienceConfig(max_faults_per_slot=2)
    n2 = decide(fault(fault_kinds.CRASH), slot_history("n2", faults, "n2"), resilience, TWO_NODES)
    assert n2.stop_code == exit_codes.BAD_NODE
    assert n2.reason.startswith("node n2 is marked bad: the named cause of 2 faults in a row")
    assert n2.reason.endswith("; requeue the job without node n2")
    n1 = decide(fault(fault_kinds.CRASH), slot_history("n1", faults, "n1"), resilience, TWO_NODES)
    assert (n1.stop_code, n1.bad_slot) == (exit_codes.JOB_RESTART_NEEDED, None)


def test_a_failed_self_check_or_persistent_corruption_marks_its_slot_at_once():
    for kind in (fault_kinds.SELF_CHECK_FAILED, fault_kinds.SILENT_CORRUPTION):
        one = [slot_fault("n2", 1, 1.0)]
        action = decide(fault(kind), slot_history("n2", one, "n2"), ResilienceConfig(), TWO_NODES)
        assert action.stop_code == exit_codes.BAD_NODE and action.bad_slot is not None
        assert kind.name.replace("_", " ") + " on rank 1" in action.reason


def test_a_ranks_fault_is_blamed_on_the_node_it_runs_on_alone():
    node_0, node_1 = (dataclasses.replace(TWO_NODES, node_rank=rank) for rank in (0, 1))
    assert (slot_of(node_0, 1, "n1"), slot_of(node_1, 1, "n2")) == (None, "n2")
    assert slot_of(ONE_NODE, 1, "host") == "1"
    for kind in (fault_kinds.SILENT_CORRUPTION, fault_kinds.SELF_CHECK_FAILED):
        elsewhere = dataclasses.replace(history(), slot=None, node="n1")
        action = decide(fault(kind), elsewhere, ResilienceConfig(max_faults_per_slot=1), node_0)
        assert (action.stop_code, action.bad_slot) == (exit_codes.JOB_RESTART_NEEDED, None)


def test_under_on_bad_node_restart_the_slot_is_marked_and_the_job_goes_on_as_before():
    resilience = ResilienceConfig(max_faults_per_slot=1, on_bad_node="restart")
    faults = [slot_fault("n2", 1, 1.0)]
    action = decide(
        fault(fault_kinds.CRASH), slot_history("n2", faults, "n2"), resilience, TWO_NODES
    )
    assert action.stop_code == exit_codes.JOB_RESTART_NEEDED
    assert action.bad_slot is not None and action.bad_slot.on_bad_node == "restart"


def test_faults_that_do_not_name_their_rank_as_cause_mark_no_slot():
    resilience = ResilienceConfig(max_faults_per_slot=1)
    faults = [slot_fault("0", 1, 1.0)]
    for kind in (fault_kinds.EARLY_EXIT, fault_kinds.CHECKPOINT_UNREADABLE):
        assert decide(fault(kind), slot_history("0", faults), resilience, ONE_NODE).bad_slot is None


def test_a_marked_slot_is_an_incident_field():
    incident = incident_of(fault_kinds.CRASH)
    faults = [slot_fault("n2", 1, 1.0), slot_fault("n2", 4, 2.0)]
    incident.take(
        decide(
            fault(fault_kinds.CRASH),
            slot_history("n2", faults, "n2"),
            ResilienceConfig(max_faults_per_slot=2),
            TWO_NODES,
        )
    )
    record = incident.record()
    assert record["action"] == "stop"
    assert record["bad_slot"]["node"] == "n2" and record["bad_slot"]["incidents"] == (1, 4)
    assert record["bad_slot"]["action"] == "stop"


def test_the_launchers_of_two_nodes_never_take_the_same_incident_number(tmp_path):
    """Each node's launcher numbers incidents in the run's shared folder: a number is claimed
    by making its incidents/<n>/ folder, so two launchers that started from the same log
    count (as two nodes of one job do) take distinct numbers, and a later launcher goes on
    after both."""
    run_dir = RunDir(tmp_path / "run")
    node0, node1 = IncidentLog(run_dir, print), IncidentLog(run_dir, print)
    taken = [node0.next_number(), node1.next_number(), node1.next_number(), node0.next_number()]
    assert taken == [1, 2, 3, 4]
    assert sorted(path.name for path in (tmp_path / "run" / "incidents").iterdir()) == [
        "1",
        "2",
        "3",
        "4",
    ]
    assert IncidentLog(run_dir, print).next_number() == 5


def beat(rank: int, phase: str) -> HeartbeatRecord:
    return HeartbeatRecord(rank, 100 + rank, 0, 6, 0, phase, 1.0, 2.0)


def test_after_a_fault_only_ranks_with_nothing_to_finish_go_without_their_grace():
    heartbeats = {
        rank: beat(rank, phase)
        for rank, phase in enumerate(["step", "step", "checkpoint", "drain", "compile", "eval"])
    }
    # rank 1 is the faulty one (SIGKILLed anyway); a save started or draining keeps its grace
    assert ranks_to_kill_at_once(1, heartbeats, save_being_written=False) == [0, 4, 5]
    # a save still being written on disk: every rank may be finishing its share of it
    assert ranks_to_kill_at_once(1, heartbeats, save_being_written=True) == []
    # a rank without a heartbeat (still starting, or its beat unreadable) keeps its grace
    assert ranks_to_kill_at_once(1, {}, save_being_written=False) == []


def test_a_compile_cache_entry_that_failed_restarts_and_marks_no_slot():
    error = StaleCompileCache(Path("train_step.xla"), RuntimeError("NOT_FOUND: Function f"))
    kind = kind_of_error(error)
    assert kind is fault_kinds.STALE_COMPILE_CACHE is kind_of_exit(exit_codes.STALE_COMPILE_CACHE)
    assert (kind.exit_code, kind.action) == (12, fault_kinds.RESTART)
    resilience = ResilienceConfig(max_faults_per_slot=1)
    action = decide(fault(kind), slot_history("0", [slot_fault("0", 1, 1.0)]), resilience, ONE_NODE)
    assert (action.stop_code, action.bad_slot) == (None, None)


def test_a_repeated_failure_stops_the_job_as_a_software_fault_and_marks_no_slot():
    resilience = ResilienceConfig(max_faults_per_slot=1)
    repeated = dataclasses.replace(
        fault(fault_kinds.SOFTWARE_FAULT), detail="InjectedError: boom at step 3 (rank0.log)"
    )
    faults = [slot_fault("1", 1, 1.0), slot_fault("1", 2, 2.0)]
    action = decide(repeated, slot_history("1", faults), resilience, ONE_NODE)
    assert (action.stop_code, action.bad_slot) == (exit_codes.SOFTWARE_FAULT, None)
    assert action.reason.endswith("not a machine's: InjectedError: boom at step 3 (rank0.log)")


def test_a_one_process_job_never_marks_its_only_slot_bad_for_faults_in_a_row():
    resilience = ResilienceConfig(max_faults_per_slot=2)
    one = JobLayout(nprocs=1, devices_per_proc=1)
    two = [slot_fault("0", 1, 1.0), slot_fault("0", 2, 2.0)]
    alone = dataclasses.replace(slot_history("0", two), can_leave_slot_out=False)
    action = decide(fault(fault_kinds.CRASH), alone, resilience, one)
    assert (action.bad_slot, action.stop_code, action.restart) == (None, None, 1)
    # with a spare to take its rank, the same slot is marked bad and left out
    spare = dataclasses.replace(alone, can_leave_slot_out=True)
    assert decide(fault(fault_kinds.CRASH), spare, resilience, one).bad_slot is not None


def test_a_readmitted_slots_first_fault_spends_no_restart():
    resilience = ResilienceConfig(max_restarts=2)
    # two restarts after attempts that committed nothing: the budget is spent
    spent = dataclasses.replace(history(restarts=2, stalled=1), restarts_spent=2)
    readmitted = dataclasses.replace(spent, readmitted_slot_fault=True)
    action = decide(fault(fault_kinds.CRASH), readmitted, resilience, ONE_NODE)
    assert (action.stop_code, action.spends_budget) == (None, False)
    # any other fault with the budget spent stops the job
    again = decide(fault(fault_kinds.CRASH), spent, resilience, ONE_NODE)
    assert again.stop_code == exit_codes.RESTARTS_EXHAUSTED
