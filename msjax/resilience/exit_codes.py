"""Exit codes of `python -m msjax.train` and `python -m msjax.launch`, one per fault class.

Schedulers key their restart policies on these (docs/reference/exit-codes.md; launch/slurm,
launch/k8s).
"""

OK = 0  # train.steps reached
CRASHED = 1  # train: an unexpected error (its traceback is in the log); the supervisor restarts
USER_ERROR = 2  # a config or command-line mistake: restarting cannot help
NONFINITE_LOSS = 3  # a loss was NaN or infinite (train); with on_nonfinite_loss=stop (launch)
RESTARTS_EXHAUSTED = 4  # launch: resilience.max_restarts spent; the last good checkpoint is kept
JOB_RESTART_NEEDED = 5  # launch, multi-node: a worker failed; restart the whole job to resume
SAVES_FAILED = 6  # train: checkpoint saves kept failing (disk full, I/O errors); the supervisor
# restarts the attempt from the last good checkpoint
CHECKPOINT_UNREADABLE = 7  # train: a checkpoint that looks whole could not be read (I/O or
# permission error, out of memory); it is left in place: retry, here or elsewhere
NO_PROGRESS = 8  # launch: several attempts in a row committed no checkpoint newer than the one
# they resumed from; the last good checkpoint is kept: retry on another node
BAD_NODE = 9  # launch, multi-node: this node's slot was marked bad; requeue without this node
# (the launcher's last line names the node)
SELF_CHECK_FAILED = 10  # msjax.doctor or a worker: a self-check failed on this process
SILENT_CORRUPTION = 11  # train: a data-parallel replica's parameters differed from the others'
# and the difference came back when its window was replayed (or resilience.on_corruption=stop);
# the message names the rank: a machine that computes or stores wrong numbers
STALE_COMPILE_CACHE = 12  # train: an executable loaded from the compile cache failed at its
# first step; its entry is dropped and the supervisor restarts at once (the attempt recompiles),
# charging no slot
SOFTWARE_FAULT = 13  # launch: the same failure repeated at the same step after a restart: the
# program's or its inputs' fault, not a machine's; no slot is marked (the line names the log)
INFRASTRUCTURE = 14  # a failure of the machine room, not of a slot (a full disk, storage errors,
# a device that fails to initialise, a self-check every slot fails alike): retry later
WRITE_FAILED = 74  # msjax.hf export: OUT_DIR could not be written (disk full, I/O error);
# nothing half-written is left (sysexits' EX_IOERR): free space and rerun
INTERRUPTED = 130  # SIGINT
TERMINATED = 143  # launch: SIGTERM (e.g. preemption); workers saved a checkpoint; rerun to resume

RETRYABLE = (
    RESTARTS_EXHAUSTED,
    JOB_RESTART_NEEDED,
    CHECKPOINT_UNREADABLE,
    NO_PROGRESS,
    BAD_NODE,
    INFRASTRUCTURE,
    TERMINATED,
)  # worth a fresh job elsewhere
# the same job would fail the same way again
FATAL = (USER_ERROR, NONFINITE_LOSS, SOFTWARE_FAULT)
