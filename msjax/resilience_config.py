"""The resilience settings of a run (`resilience.*`): heartbeats, hang deadlines, restarts, the
corruption guard, exclusion of bad slots and the compile caches. Their checks are in
msjax.config_checks; what they drive is in msjax.resilience and msjax.launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ResilienceConfig:
    """Heartbeats, hang deadlines and restarts of supervised runs (`python -m msjax.launch`)."""

    heartbeat_every_s: float = 1.0  # each rank rewrites RUN_DIR/heartbeats/rank<r>.json this often
    # a process whose JAX coordination heartbeats stop this long ends the job on every process
    peer_timeout_s: int = 100
    # Hang: a rank's heartbeat shows no progress for longer than its phase's deadline.
    step_deadline_s: float = 120.0  # the step phase's deadline
    compile_deadline_s: float = 900.0  # compiling, the first step, evaluation
    # Start-up phases, each with its own deadline: joining the job and building (init), reading
    # or tokenizing the corpus (data: its progress counts, so only a stalled tokenizer is a
    # hang, however large the corpus), restoring a checkpoint (restore)
    init_deadline_s: float = 600.0
    data_deadline_s: float = 600.0  # reading or tokenizing the corpus (progress counts)
    restore_deadline_s: float = 900.0  # restoring a checkpoint
    checkpoint_deadline_s: float = 600.0  # a save, and waiting for saves in flight
    # Measured deadlines: once every rank has timed measured_deadline_after_steps steps (or
    # measured_deadline_after_saves saves) over the job's attempts, that phase's deadline becomes
    # max(floor_s, factor x the slowest one + heartbeat_every_s), never more than the configured
    # deadline above. measured_deadline_factor=0: the configured deadlines only.
    measured_deadline_factor: float = 5.0
    measured_deadline_floor_s: float = 10.0  # the least a measured deadline can be
    measured_deadline_after_steps: int = 20  # steps every rank times before the step deadline
    measured_deadline_after_saves: int = 3  # saves every rank times before the save deadline
    on_nonfinite_loss: Literal["stop", "rollback"] = "rollback"  # rollback: skip that batch
    # Corruption guard (msjax.resilience.replica_guard): every N steps, and before every save,
    # the data-parallel replicas' state (parameters, optimizer state) is fingerprinted on
    # device and compared (0: off)
    replica_check_every: int = 100
    # every N steps each device multiplies small known matrices through msjax's matmul path,
    # checked against the host's answer (msjax.resilience.compute_checks): wrong compute before
    # the gradients' all-reduce, which replicas cannot see; a device that fails ends the run
    # with exit code 11 naming its rank (0: off)
    compute_check_every: int = 100
    # a replica that differs: rerun replays the window from the last checkpoint before it
    # (transient if the mismatch does not come back); stop, or a mismatch that comes back,
    # ends the run with exit code 11 naming the rank
    on_corruption: Literal["rerun", "stop"] = "rerun"
    # a restart takes warm standbys: once an attempt has stepped for warm_standby_after_s, a
    # process with its imports done (JAX, msjax's trainer) waits in each slot for the next
    # attempt's rank (msjax.launch.spare), so that a restart does not import again
    warm_standbys: bool = True
    warm_standby_after_s: float = 30.0  # how long an attempt steps before standbys start
    # restarts that spend the budget before the supervisor gives up (exit 4, or 14 when the
    # last fault was the infrastructure's): those after an attempt that committed no checkpoint
    # newer than the one it resumed from; a restart after progress is free. 0: no restart at all
    max_restarts: int = 10
    # attempts in a row that commit no checkpoint newer than the one they resumed from: exit 8
    # (exit 2 if each crashed the same way before its first step: a mistake, not the machine)
    max_attempts_without_progress: int = 3
    # A slot (on one node a process place of msjax.launch, across nodes a node) is marked bad
    # when it is the named cause of max_faults_per_slot faults in a row, or fails a self-check,
    # or corrupts persistently; exclude: leave it out (a multi-node job's launcher exits 9, bad
    # node), restart: restart on it as on any fault (the marking is still recorded)
    on_bad_node: Literal["exclude", "restart"] = "exclude"
    # Exclusion comes before the limit of attempts without progress (the job counts them afresh
    # on its new membership): a slot that crashes at every start is left out with the defaults.
    # The same crash before the first step each time still stops the job (exit 2, a mistake's),
    # and a spent restart budget (exit 4).
    max_faults_per_slot: int = 3
    # On one node an excluded slot's rank goes to a spare (--spares), else the mesh shrinks onto
    # the healthy slots; after readmit_after_s (0: never; doubled after each failed try) the slot
    # rejoins once its self-check (and, if excluded for a fault in training, a training probe
    # past the step it failed at) passes (the full mesh again)
    readmit_after_s: float = 600.0
    # before a restart after an attempt that made no progress, doubled per such attempt in a row
    # (an attempt that made progress restarts at once)
    restart_backoff_s: float = 1.0
    # after an infrastructure fault (a full disk, storage errors, devices that fail to initialise:
    # exit 14) the back-off starts at infrastructure_backoff_s and doubles with each attempt in a
    # row without progress, up to infrastructure_backoff_max_s: the machine room gets minutes
    infrastructure_backoff_s: float = 5.0
    infrastructure_backoff_max_s: float = 300.0  # the longest back-off after such faults
    # how often a running launcher appends its record to RUN_DIR/launches.jsonl (also written at
    # its start and end): a launcher killed outright leaves its time up to the last one counted
    launch_record_every_s: float = 60.0
    stop_grace_s: float = 10.0  # SIGTERM to SIGKILL when stopping workers after a fault
    # compilation caches, so a restart loads its train step instead of compiling: msjax's signed
    # executables (on in runs started by msjax.launch, or wherever compile_cache_dir is set) and
    # JAX's persistent cache; false turns both off
    compile_cache: bool = True
    # both caches here; None: the signed executables in RUN_DIR/compile_cache and JAX's cache in
    # jax_compile_cache/ of this user's msjax cache folder (never in a run dir)
    compile_cache_dir: str | None = None
    # Self-checks (python -m msjax.doctor) before every start and restart under msjax.launch:
    # each must end within check_budget_s (0: no self-checks); a device whose known-answer
    # program takes more than slow_device_factor x the devices' median is flagged slow
    check_budget_s: float = 0.0
    slow_device_factor: float = 2.0  # also bounds an all-reduce group against its axis's median
