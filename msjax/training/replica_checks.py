"""The loop's side of the corruption guard: which steps are checked (replica fingerprints and the
known-answer check of every device) and what checkpoints record of it.
msjax.resilience.replica_guard compares; the loop (msjax.train) replays what a mismatch asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from msjax.loop_events import LoopEvents
from msjax.parallel.agreement import agree_any, process_vote
from msjax.resilience.compute_checks import ComputeCheck
from msjax.resilience.replica_guard import (
    COMPUTE_CHECK,
    MismatchLog,
    Replay,
    ReplicaFingerprints,
    RerunStateMachine,
    SilentCorruption,
    compare,
)

if TYPE_CHECKING:
    from msjax.training.decisions import Decision
    from msjax.training.prepare import PreparedRun


class ReplicaChecks(LoopEvents):
    """Every resilience.replica_check_every steps, before every save, a stop and the last step,
    and after every step of a replay: the replicas compared; every
    resilience.compute_check_every steps: every device's known-answer matmul checked (every
    process gets the same table from one all-gather, so every process takes the same turn)."""

    def __init__(self, run: PreparedRun):
        import jax

        resilience, mesh = run.config.resilience, run.program.mesh
        self.every = resilience.replica_check_every
        self.total_steps = run.config.train.steps
        self.enabled = self.every > 0 and mesh.shape["data"] > 1
        if self.every > 0 and not self.enabled:
            run.progress.message(
                "replica checks: mesh.data=1 holds no data-parallel replicas to compare; "
                "silent corruption is left to the known-answer self-check"
            )
        self.fingerprints = None
        if self.enabled:
            self.fingerprints = ReplicaFingerprints(mesh, run.program.state_shardings)
        self.abstract_state = run.abstract_state
        self.compute_every = resilience.compute_check_every
        self.mesh = mesh
        self._compute: ComputeCheck | None = None
        self._compiling = False  # whether the programs' compiles have started (start_compiling)
        self.log = MismatchLog(
            run.run_dir.path,
            jax.process_index() == 0,
            run.progress.message,
            barrier=lambda: agree_any(self.vote, False),
        )
        self.machine = RerunStateMachine(
            resilience.on_corruption, run.start.step, self.log, self.failing_ranks
        )
        # the mismatch log's barrier: every process waits there until its writer has written
        self.vote = process_vote("replica_guard", resilience.checkpoint_deadline_s)
        self.devices = mesh.devices
        self.agreed_at: int | None = None  # the step of the last check that agreed
        run.saves.replica_record = self.record  # every checkpoint records its replicas' check

    def failing_ranks(self) -> tuple[int, ...]:
        """The ranks whose devices get the known answer wrong (also the tie-break of two
        replicas that each reproduce their own state: replica_guard)."""
        if self._compute is None:
            self._compute = ComputeCheck(self.mesh)
        return self._compute.failing_ranks()

    def compute_due(self, step: int) -> bool:
        """Whether every device's known-answer matmul is checked after `step` updates."""
        return self.compute_every > 0 and step % self.compute_every == 0

    def step_end(self, record: dict[str, Any]) -> None:
        """A step's results are in: the checks' programs start compiling (once)."""
        self.start_compiling()

    def start_compiling(self) -> None:
        """Both programs compiled on threads of their own from now on (from the loop's first
        step's results, `step_end`): a (re)start's first step shares the host with neither
        compile, and the first check seldom waits for one."""
        if self._compiling:
            return
        self._compiling = True
        if self.fingerprints is not None:
            self.fingerprints.compile(self.abstract_state)
        if self.compute_every > 0 and self._compute is None:
            self._compute = ComputeCheck(self.mesh)

    def due(self, step: int, decision: Decision) -> bool:
        """Whether the state after `step` updates is checked now (either check)."""
        if self.compute_due(step):
            return True
        if not self.enabled:
            return False
        return (
            step % self.every == 0
            or decision.save
            or decision.stop_by is not None
            or step == self.total_steps
            or self.machine.checks_every_step(step)
        )

    def check(self, step: int, state: Any) -> Replay | None:
        """The checks due after `step` updates: None to go on, or the replay to start;
        SilentCorruption once a rank is found bad."""
        if self.compute_due(step):
            self.check_compute(step)
        if self.fingerprints is None:
            return None
        table = self.fingerprints.table(state)
        mismatch = compare(
            table,
            step,
            self.machine.agreed_step,
            self.fingerprints.tensor_names,
            lambda place: self.devices[place].process_index,
        )
        self.agreed_at = step if mismatch is None else None
        return self.machine.observe(step, table, mismatch)

    def check_compute(self, step: int) -> None:
        """SilentCorruption naming the ranks whose devices got the known answer wrong."""
        failed = self.failing_ranks()
        if not failed:
            return
        named = ", ".join(map(str, failed))
        line = (
            f"the known-answer matmul check after step {step} failed on rank {named}: its "
            f"device(s) compute wrong numbers; rank {named} marked bad"
        )
        window = [step - self.compute_every, step]
        record = {"event": COMPUTE_CHECK, "step": step, "window": window, "ranks": list(failed)}
        self.log({**record, "bad_ranks": list(failed)}, line)
        raise SilentCorruption(line, failed)

    def record(self, step: int) -> dict[str, Any]:
        """What a checkpoint of `step` records of its replicas (checked right before it)."""
        if not self.enabled:
            return {"checked": False}
        return {"checked": True, "agreed": self.agreed_at == step}
