"""How the supervisor tells a fault from an attempt's exits and heartbeats: DETECTORS, run in
order on every poll, each a function of what the poll saw; the kinds are those of
msjax.resilience.fault_kinds (a crash, a hang, a non-finite loss, an early exit, ...).
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from msjax.config import ResilienceConfig
from msjax.launch.attempt import Attempt
from msjax.launch.workers import LOG_HEADER, WorkerProcess, describe_exit
from msjax.resilience import exit_codes, fault_kinds
from msjax.resilience.fault_kinds import FaultKind, kind_of_exit
from msjax.resilience.faults import read_firings
from msjax.resilience.heartbeat import TIMED_PHASES, HeartbeatRecord
from msjax.resilience.replica_guard import UNDECIDED, recorded_verdict
from msjax.run_dir import RunDir


@dataclass
class DetectedFault:
    """A fault the supervisor saw (an injected one is msjax.resilience.faults.InjectedFault)."""

    kind: FaultKind
    rank: int
    detail: str
    detected_unix_s: float
    fault_unix_s: float  # when it happened, as well as known
    fault_time_from: str  # injection record, exit seen by polling, last heartbeat progress
    step: int  # updates completed by the furthest rank before the fault
    phase: str
    nonfinite_step: int | None = None
    corruption: dict[str, Any] | None = None  # silent corruption: the guard's verdict record

    @property
    def cause(self) -> str:
        return self.kind.cause

    @property
    def label(self) -> str:
        """The cause and the rank it names, for the launcher's lines (a corruption that no replay
        could pin on one replica names none)."""
        if self.kind is fault_kinds.UNATTRIBUTED_CORRUPTION:
            return f"{self.cause}, no rank named"
        return f"{self.cause} of rank {self.rank}"


# what a corruption incident keeps of the guard's verdict (RUN_DIR/replica_mismatches.jsonl)
CORRUPTION_KEYS = ("event", "step", "window", "ranks", "bad_ranks", "tensor")
# what each injected fault is detected as: its record times that fault alone (a rank's hang
# that fired earlier does not time its SIGKILL from outside)
DETECTED_AS = {
    "crash": fault_kinds.CRASH,
    "raise": fault_kinds.CRASH,
    "crash_in_save": fault_kinds.CRASH,
    "snapshot_bitflip": fault_kinds.CRASH,
    "memory_loss": fault_kinds.CRASH,
    "hang": fault_kinds.HANG,
    "nan": fault_kinds.NONFINITE_LOSS,
    "bad_token": fault_kinds.NONFINITE_LOSS,
    "save_error": fault_kinds.SAVES_FAILED,
    "bitflip": fault_kinds.SILENT_CORRUPTION,
    "stuck_bit": fault_kinds.SILENT_CORRUPTION,
    "opt_bitflip": fault_kinds.SILENT_CORRUPTION,
    "corrupt_compute": fault_kinds.SILENT_CORRUPTION,
}
# injected faults that end their process
INJECTED_CRASHES = tuple(kind for kind, seen in DETECTED_AS.items() if seen is fault_kinds.CRASH)
Timings = dict[str, tuple[int, float]]  # phase: (how many timed on every rank, the slowest s)


def timings_of(heartbeats: Collection[HeartbeatRecord], earlier: Timings | None = None) -> Timings:
    """What every rank's heartbeat has timed (the fewest timed on any rank, the slowest on
    any), added to what the job's earlier attempts timed."""
    timed = dict(earlier or {})
    for phase in TIMED_PHASES:
        ranks = [record.timings.get(phase, (0, 0.0)) for record in heartbeats]
        count = min((int(timing[0]) for timing in ranks), default=0)
        slowest = max((float(timing[1]) for timing in ranks), default=0.0)
        before = timed.get(phase, (0, 0.0))
        timed[phase] = (before[0] + count, max(before[1], slowest))
    return timed


def deadline_s(
    resilience: ResilienceConfig,
    phase: str,
    heartbeats: Collection[HeartbeatRecord] = (),
    earlier: Timings | None = None,
) -> float:
    """How long a rank may go without progress in phase before it counts as hung: the
    configured deadline, or less once the job has measured that phase (measured_deadline)."""
    measured = measured_deadline(resilience, phase, heartbeats, earlier)
    return measured[0] if measured is not None else configured_deadline_s(resilience, phase)


def measured_deadline(
    resilience: ResilienceConfig,
    phase: str,
    heartbeats: Collection[HeartbeatRecord],
    earlier: Timings | None = None,
) -> tuple[float, str] | None:
    """The deadline of a step or save phase from what every rank's heartbeat has timed in this
    attempt and the job's earlier ones (earlier), with the rule it came from; None until each
    rank has timed enough of them."""
    enough = {
        "step": resilience.measured_deadline_after_steps,
        "checkpoint": resilience.measured_deadline_after_saves,
    }
    if phase not in enough or not resilience.measured_deadline_factor:
        return None
    count, slowest_s = timings_of(heartbeats, earlier)[phase]
    if count < enough[phase]:
        return None
    factor, floor_s = resilience.measured_deadline_factor, resilience.measured_deadline_floor_s
    measured_s = max(floor_s, factor * slowest_s + resilience.heartbeat_every_s)
    configured_s = configured_deadline_s(resilience, phase)
    if measured_s >= configured_s:
        return None
    what = "step" if phase == "step" else "save"
    rule = (
        f"measured: max({floor_s:g} s, {factor:g} x the slowest {what} {slowest_s:.3g} s + "
        f"heartbeat {resilience.heartbeat_every_s:g} s) over {count} {what}s timed, "
        f"configured {configured_s:g} s"
    )
    return measured_s, rule


def configured_deadline_s(resilience: ResilienceConfig, phase: str) -> float:
    """The phase's deadline as configured (resilience.*_deadline_s)."""
    if phase == "step":
        return resilience.step_deadline_s
    if phase in ("checkpoint", "drain", "done", "nonfinite"):
        return resilience.checkpoint_deadline_s
    startup = {
        "init": resilience.init_deadline_s,  # from spawn: joining the job, building the program
        "data": resilience.data_deadline_s,  # between reports of tokenizing progress
        "restore": resilience.restore_deadline_s,
    }
    return startup.get(phase, resilience.compile_deadline_s)  # compile, eval (which compiles)


@dataclass(frozen=True)
class Poll:
    """What one poll of an attempt saw, for the detectors."""

    attempt: Attempt
    exited: list[WorkerProcess]
    last_poll_unix_s: float
    now_unix_s: float
    resilience: ResilienceConfig
    steps: int  # train.steps
    timed_before: Timings  # what the job's earlier attempts timed

    @property
    def failed(self) -> list[WorkerProcess]:
        return [worker for worker in self.exited if worker.exit_code != 0]

    @property
    def all_exited(self) -> bool:
        return len(self.exited) == len(self.attempt.workers)


def exit_fault(poll: Poll) -> DetectedFault | None:
    """The first failed worker's exit: its exit code's kind (a crash when no kind has it)."""
    failed = poll.failed
    if not failed:
        return None
    attempt = poll.attempt
    first = min(failed, key=lambda w: (w.exited_unix_s or 0.0, w.rank))
    code = first.exit_code
    assert code is not None
    kind = kind_of_exit(code)
    record = attempt.heartbeats.get(first.rank)
    phase = record.phase if record is not None else "init"
    fault = DetectedFault(
        kind,
        first.rank,
        describe_exit(code) + kind.exit_detail,
        time.time(),
        poll.last_poll_unix_s,
        "exit seen by polling",
        attempt.max_step,
        phase,
    )
    if kind is fault_kinds.NONFINITE_LOSS:
        fault.nonfinite_step = record.step if record is not None else attempt.max_step
        fault.step = fault.nonfinite_step
        fault.detail = f"the loss of step {fault.nonfinite_step} is not finite"
    elif kind.cause == fault_kinds.CRASH.cause and not kind.exit_detail and first.rank == 0:
        fault.detail += "; rank 0 hosted the coordinator"
    return fault


def early_exit_fault(poll: Poll) -> DetectedFault | None:
    """Every worker exited 0, but not every one says it finished."""
    attempt, now_unix_s = poll.attempt, poll.now_unix_s
    if not poll.all_exited or poll.failed or attempt.finished(poll.steps):
        return None
    return DetectedFault(
        fault_kinds.EARLY_EXIT,
        attempt.workers[0].rank,
        "every worker exited 0 before train.steps",
        now_unix_s,
        now_unix_s,
        "exit seen by polling",
        attempt.max_step,
        "done",
    )


def nonfinite_fault(poll: Poll) -> DetectedFault | None:
    """A rank's heartbeat says its loss was not finite (it is leaving, or about to)."""
    attempt = poll.attempt
    for worker in attempt.workers:
        record = attempt.heartbeats.get(worker.rank)
        if record is not None and record.phase == "nonfinite":
            return DetectedFault(
                fault_kinds.NONFINITE_LOSS,
                worker.rank,
                f"the loss of step {record.step} is not finite",
                time.time(),
                record.unix_s,
                "heartbeat",
                record.step,
                "step",
                nonfinite_step=record.step,
            )
    return None


def hang_fault(poll: Poll) -> DetectedFault | None:
    """A live rank past its phase's deadline without progress; the fault names the rank that
    stopped first: a SIGSTOPped one, else the one longest without progress."""
    attempt, resilience, earlier = poll.attempt, poll.resilience, poll.timed_before
    now = time.monotonic()
    live = [w for w in attempt.workers if w.alive]
    heartbeats = list(attempt.heartbeats.values())
    overdue = [
        worker
        for worker in live
        if now - attempt.progress_at[worker.rank]
        > deadline_s(resilience, _phase(attempt, worker.rank), heartbeats, earlier)
    ]
    if not overdue:
        return None
    stopped = [w for w in live if w.stopped]
    culprit = stopped[0] if stopped else min(live, key=lambda w: attempt.progress_at[w.rank])
    phase = _phase(attempt, culprit.rank)
    waited_s = now - attempt.progress_at[culprit.rank]
    detail = f"no progress in phase {phase} for {waited_s:.1f} s"
    measured = measured_deadline(resilience, phase, heartbeats, earlier)
    if measured is not None:
        detail += f" (deadline {measured[0]:.3g} s, {measured[1]})"
    else:
        detail += f" (deadline {configured_deadline_s(resilience, phase):g} s)"
    if stopped:
        detail += f"; the process is stopped (state {culprit.state()}, e.g. SIGSTOP)"
    detail += "; ranks past their deadline: " + ", ".join(str(w.rank) for w in overdue)
    return DetectedFault(
        fault_kinds.HANG,
        culprit.rank,
        detail,
        time.time(),
        attempt.progress_unix_s[culprit.rank],
        "last heartbeat progress",
        attempt.max_step,
        phase,
    )


Detector = Callable[[Poll], DetectedFault | None]
# run in this order on every poll; the first fault found ends the attempt
DETECTORS: tuple[Detector, ...] = (exit_fault, early_exit_fault, nonfinite_fault, hang_fault)


def detect(poll: Poll) -> DetectedFault | None:
    """The first fault a detector finds in what this poll saw; None: none (yet)."""
    for detector in DETECTORS:
        fault = detector(poll)
        if fault is not None:
            return fault
    return None


def _phase(attempt: Attempt, rank: int) -> str:
    record = attempt.heartbeats.get(rank)
    return record.phase if record is not None else "init"


def name_the_corrupt_rank(fault: DetectedFault, run_dir: RunDir) -> None:
    """Silent corruption: every worker exits 11 alike; the replicas' record names the bad rank,
    or says that no check could blame one (the job stops then, and no slot is marked bad)."""
    if fault.kind is not fault_kinds.SILENT_CORRUPTION:
        return
    verdict = recorded_verdict(run_dir.path)
    if verdict is None:
        return
    fault.corruption = {key: verdict.get(key) for key in CORRUPTION_KEYS}
    bad = [int(rank) for rank in verdict.get("bad_ranks", ())]
    if bad:
        fault.rank = bad[0]
        fault.detail += f" (replica_mismatches.jsonl names rank {', '.join(map(str, bad))})"
    elif verdict.get("event") == UNDECIDED:
        fault.kind = fault_kinds.UNATTRIBUTED_CORRUPTION
        fault.detail += (
            " (replica_mismatches.jsonl: ranks "
            + ", ".join(map(str, verdict.get("ranks", ())))
            + " disagree and each reproduced itself; no slot is blamed)"
        )


def use_injection_time(fault: DetectedFault, attempt: Attempt, run_dir: RunDir) -> None:
    """An injected fault's own record says exactly when it fired (a record of another kind of
    fault on that rank says nothing of this one); an injected crash also says which rank
    crashed, where the exits of the others (their collectives failing, the job's end they then
    published) were seen in the same poll and so could be named first."""
    workers = {worker.pid: worker for worker in attempt.workers}
    firings = [f for f in read_firings(run_dir.path) if f["pid"] in workers]
    crashed = [
        f for f in firings if f["kind"] in INJECTED_CRASHES and workers[f["pid"]].poll() is not None
    ]
    if fault.kind is fault_kinds.CRASH and crashed:
        first = min(crashed, key=lambda firing: firing["unix_s"])
        if first["rank"] != fault.rank:
            code = workers[first["pid"]].exit_code
            assert code is not None
            record = attempt.heartbeats.get(first["rank"])
            fault.rank = first["rank"]
            fault.detail = f"{describe_exit(code)}; the other ranks' exits followed from it"
            fault.phase = record.phase if record is not None else "init"
    for firing in firings:
        if firing["rank"] == fault.rank and DETECTED_AS.get(firing["kind"]) is fault.kind:
            fault.fault_unix_s = firing["unix_s"]
            fault.fault_time_from = f"injection record ({firing['fault']})"


def start_up_failure(fault: DetectedFault, attempt: Attempt) -> str | None:
    """What names a crash before the attempt's first step, to tell the same failure when it
    comes again: the exit, the phase and the worker's last line of output in this attempt, its
    numbers masked (times, pids, ports). None for any other fault: a hang, a SIGKILL (the OOM
    killer's too), an exit code of its own meaning, or a crash after the first step."""
    if fault.cause != fault_kinds.CRASH.cause or attempt.first_step_unix_s is not None:
        return None
    worker = next(worker for worker in attempt.workers if worker.rank == fault.rank)
    code = worker.exit_code
    if code is None or not (code == exit_codes.CRASHED or (code < 0 and -code != signal.SIGKILL)):
        return None
    lines = worker.log_tail().splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith(LOG_HEADER)]
    output = [line.strip() for line in lines[headers[-1] + 1 if headers else 0 :] if line.strip()]
    last = re.sub(r"\d+", "#", output[-1]) if output else "no output"
    return f"{describe_exit(code)} in phase {fault.phase}: {last}"
