"""Every kind of fault in one table, KINDS: its exceptions, exit code, cause and supervisor action.
Adding a kind is one row here and its code in exit_codes.py (and docs/recovery.md, "Exit
codes"): msjax.train's exit ladder, msjax.launch.fault_detection and msjax.launch.policy all read
the row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from msjax.checkpoint.read_errors import CheckpointUnreadable
from msjax.errors import MsjaxError
from msjax.parallel.agreement import VoteTimeout
from msjax.resilience import exit_codes
from msjax.resilience.compile_cache import StaleCompileCache
from msjax.resilience.replica_guard import SilentCorruption
from msjax.resilience.worker import NonFiniteLoss, SavesFailing

# What the supervisor does about a fault (msjax.launch.policy.decide applies the limits around it)
RESTART = "restart"  # from the newest valid checkpoint, within resilience.max_restarts
STOP = "stop"  # end the job with the kind's exit code: a restart cannot help
SKIP_STEP = "skip_step"  # add the fault's step to the run's skipped steps, then restart
# (resilience.on_nonfinite_loss=stop makes it STOP)
MARK_SLOT_BAD = "mark_slot_bad"  # the slot that ran the rank is bad (resilience.on_bad_node)
ACTIONS = (RESTART, STOP, SKIP_STEP, MARK_SLOT_BAD)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _first_line(error: BaseException) -> str:
    lines = str(error).splitlines()
    return lines[0] if lines else ""


@dataclass(frozen=True)
class FaultKind:
    """One kind of fault. line and reason are what a worker that raised one of exceptions prints
    (after "msjax.train: ") and tells its peers as it leaves the job (msjax.resilience.job_end)."""

    name: str
    cause: str  # the incident's cause
    action: str  # one of ACTIONS
    exit_code: int | None = None  # a worker's exit code; None: seen by the supervisor alone
    exceptions: tuple[type[BaseException], ...] = ()
    line: Callable[[BaseException], str] = str
    reason: Callable[[BaseException], str] = str
    exit_detail: str = ""  # added to the exit's description in the incident
    # whether the rank it names is its cause, so that its slot's faults in a row are counted
    # (resilience.max_faults_per_slot); not for a mistake, a bad batch, or what every rank sees
    names_slot: bool = True
    # which errors of its exceptions' classes it is (all when None): a class shared with others
    matches: Callable[[BaseException], bool] | None = None
    # a kind the supervisor alone sees whose action is STOP: the launcher's exit code
    stop_code: int | None = None


USER_ERROR = FaultKind(
    "user_error",
    "user_error",
    STOP,
    exit_codes.USER_ERROR,
    (MsjaxError,),
    line=lambda error: f"error: {_one_line(error)}",
    reason=_first_line,
    names_slot=False,
)
NONFINITE_LOSS = FaultKind(
    "nonfinite_loss",
    "nonfinite_loss",
    SKIP_STEP,
    exit_codes.NONFINITE_LOSS,
    (NonFiniteLoss,),
    reason=lambda error: f"the loss of step {getattr(error, 'step', '?')} is not finite",
    names_slot=False,
)
SAVES_FAILED = FaultKind(
    "saves_failed",
    "crash",
    RESTART,
    exit_codes.SAVES_FAILED,
    (SavesFailing,),
    reason=lambda error: "checkpoint saves kept failing",
    exit_detail=" (checkpoint saves kept failing)",
)
# a crash with one line instead of a traceback: a peer that never voted; any other exception is a
# crash too, with its traceback in the log
CRASH = FaultKind("crash", "crash", RESTART, exit_codes.CRASHED, (VoteTimeout,))
CHECKPOINT_UNREADABLE = FaultKind(
    "checkpoint_unreadable",
    "crash",
    RESTART,
    exit_codes.CHECKPOINT_UNREADABLE,
    (CheckpointUnreadable,),  # every process raises it alike: no peer to blame
    reason=lambda error: "a checkpoint could not be read",
    exit_detail=" (a checkpoint that looks whole could not be read; it is left in place)",
    names_slot=False,
)


def _infrastructure(error: BaseException) -> bool:
    """An OS or storage error (a full disk, an unwritable or vanished mount), or devices that
    failed to initialise (JAX's RuntimeError "Unable to initialize backend ...")."""
    return isinstance(error, OSError) or str(error).startswith("Unable to initialize backend")


# the machine room, not the user nor a slot: restarted after resilience.infrastructure_backoff_s
# (doubling), never taken for a mistake; a spent restart budget then ends the launch with it
INFRASTRUCTURE = FaultKind(
    "infrastructure",
    "infrastructure",
    RESTART,
    exit_codes.INFRASTRUCTURE,
    (OSError, RuntimeError),  # OSError: msjax.writable.WriteFailed too
    line=_one_line,
    reason=_first_line,
    exit_detail=" (a full disk, a storage error or devices that failed to initialise)",
    names_slot=False,
    matches=_infrastructure,
)
INTERRUPTED = FaultKind(
    "interrupted",
    "crash",  # a worker interrupted from outside the supervisor: restarted like a crash
    RESTART,
    exit_codes.INTERRUPTED,
    (KeyboardInterrupt,),
    line=lambda error: "interrupted",
    reason=lambda error: "interrupted",
)
STALE_COMPILE_CACHE = FaultKind(
    "stale_compile_cache",
    "stale_compile_cache",
    RESTART,  # at once: the restart compiles afresh (the entry is gone)
    exit_codes.STALE_COMPILE_CACHE,
    (StaleCompileCache,),
    reason=lambda error: "a compile cache entry failed at its first step (dropped)",
    exit_detail=" (a compile cache entry failed at its first step; dropped, so the restart "
    "compiles afresh)",
    names_slot=False,  # the entry's fault, not the machine's
)
SELF_CHECK_FAILED = FaultKind(
    "self_check_failed", "self_check_failed", MARK_SLOT_BAD, exit_codes.SELF_CHECK_FAILED
)
SILENT_CORRUPTION = FaultKind(
    "silent_corruption",
    "silent_corruption",
    MARK_SLOT_BAD,
    exit_codes.SILENT_CORRUPTION,
    (SilentCorruption,),  # every process finds the same ranks bad (the rerun state machine)
    reason=lambda error: (
        "silent corruption on rank "
        + (", ".join(map(str, getattr(error, "ranks", ()))) or "unknown")
    ),
)
# the supervisor's reading of exit 11 when the guard could blame no replica (two replicas that
# each reproduce their own state): the job stops, and no slot is marked bad
UNATTRIBUTED_CORRUPTION = FaultKind(
    "unattributed_corruption",
    "silent_corruption",
    STOP,
    exit_codes.SILENT_CORRUPTION,
    names_slot=False,
)
# the launcher's own code on a multi-node job; a process that exits with it (a check of the
# whole node) marks its slot bad too
BAD_NODE = FaultKind("bad_node", "bad_node", MARK_SLOT_BAD, exit_codes.BAD_NODE)
# a crash that repeats the one before it, the same exception at the same step on any rank or
# slot (msjax.launch.software_faults): the program's or its inputs' fault; no slot is marked
SOFTWARE_FAULT = FaultKind(
    "software_fault",
    "software_fault",
    STOP,
    names_slot=False,
    stop_code=exit_codes.SOFTWARE_FAULT,
)
# a self-check every slot of a round fails alike, twice (msjax.launch.supervisor): the node's or
# the storage's, not a slot's (cause infrastructure); retryable, and no slot is marked
SHARED_SELF_CHECK_FAILURE = FaultKind(
    "shared_self_check_failure",
    "infrastructure",
    STOP,
    names_slot=False,
    stop_code=exit_codes.INFRASTRUCTURE,
)
# seen by the supervisor alone
HANG = FaultKind("hang", "hang", RESTART)  # no progress past its phase's deadline
EARLY_EXIT = FaultKind(  # every worker exited 0 too soon
    "early_exit", "early_exit", RESTART, names_slot=False
)

# The first row whose exceptions match a worker's error decides; a row's exceptions are defined
# in modules that do not import this one.
KINDS = (
    USER_ERROR,
    NONFINITE_LOSS,
    SAVES_FAILED,
    CRASH,
    CHECKPOINT_UNREADABLE,
    INFRASTRUCTURE,
    INTERRUPTED,
    STALE_COMPILE_CACHE,
    SELF_CHECK_FAILED,
    SILENT_CORRUPTION,
    BAD_NODE,
    SOFTWARE_FAULT,
    SHARED_SELF_CHECK_FAILURE,
    HANG,
    EARLY_EXIT,
)


def kind_of_error(error: BaseException) -> FaultKind | None:
    """The kind a worker's error is (the first row that lists its class); None: an unexpected
    error, a crash whose traceback goes to the log."""
    for kind in KINDS:
        matched = kind.exceptions and isinstance(error, kind.exceptions)
        if matched and (kind.matches is None or kind.matches(error)):
            return kind
    return None


def kind_of_exit(code: int) -> FaultKind:
    """The kind a worker's non-zero exit code (or -signal) tells; a crash when no row has it."""
    for kind in KINDS:
        if kind.exit_code == code:
            return kind
    return CRASH
