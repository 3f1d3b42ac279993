"""Which process slots a job runs on: the mesh re-planned for the healthy slots, and the slots
themselves (active with a rank, spare, excluded) as the supervisor keeps them.

Pure bookkeeping, no JAX: the supervisor acts on what these functions decide.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from msjax.config import Config
from msjax.config_checks import validate
from msjax.errors import ConfigError, MsjaxError
from msjax.resolve import resolve_mesh_shape


@dataclass(frozen=True)
class MeshPlan:
    """A mesh for `processes` workers: data, fsdp and expert shrunk, pipe and tensor kept, and
    the gradient accumulation that keeps each pass's rows per replica at most what they were."""

    data: int
    fsdp: int
    pipe: int
    tensor: int
    grad_accum_steps: int
    processes: int
    expert: int = 1

    @property
    def replicas(self) -> int:
        return self.data * self.fsdp * self.expert

    def overrides(self) -> list[str]:
        """The trainer's overrides that run this plan (after the job's own config)."""
        return [
            f"mesh.data={self.data}",
            f"mesh.fsdp={self.fsdp}",
            f"mesh.expert={self.expert}",
            f"mesh.pipe={self.pipe}",
            f"mesh.tensor={self.tensor}",
            f"train.grad_accum_steps={self.grad_accum_steps}",
        ]

    def applied(self, config: Config) -> Config:
        """The job's config on this plan's mesh (what its self-checks and workers run)."""
        mesh = dataclasses.replace(
            config.mesh,
            data=self.data,
            fsdp=self.fsdp,
            expert=self.expert,
            pipe=self.pipe,
            tensor=self.tensor,
        )
        train = dataclasses.replace(config.train, grad_accum_steps=self.grad_accum_steps)
        return dataclasses.replace(config, mesh=mesh, train=train)

    def describe(self) -> str:
        """`data 1 x fsdp 2 x pipe 1 x tensor 2 on 2 processes, ...` (expert named where split)."""
        expert = f" x expert {self.expert}" if self.expert > 1 else ""
        return (
            f"data {self.data} x fsdp {self.fsdp}{expert} x pipe {self.pipe} x tensor "
            f"{self.tensor} on {self.processes} processes, "
            f"train.grad_accum_steps={self.grad_accum_steps}"
        )


def full_plan(config: Config, devices_per_proc: int, processes: int) -> MeshPlan:
    """The job's own mesh (its -1 axis filled in for processes x devices_per_proc devices)."""
    sizes = resolve_mesh_shape(config.mesh, processes * devices_per_proc)
    return MeshPlan(
        sizes["data"],
        sizes["fsdp"],
        sizes["pipe"],
        sizes["tensor"],
        config.train.grad_accum_steps,
        processes,
        sizes["expert"],
    )


def _fits(config: Config, data: int, fsdp: int, expert: int, accum_steps: int) -> bool:
    """Whether the job's config is valid with these sizes (the trainer's own checks)."""
    mesh = dataclasses.replace(config.mesh, data=data, fsdp=fsdp, expert=expert)
    train = dataclasses.replace(config.train, grad_accum_steps=accum_steps)
    try:
        validate(dataclasses.replace(config, mesh=mesh, train=train))
    except ConfigError:
        return False
    return True


def _accum_steps_for(config: Config, full: MeshPlan, replicas: int) -> int | None:
    """The fewest accumulation passes that split a replica's share of the global batch into
    passes no larger than the full mesh's (memory per device stays what the job had)."""
    global_batch = config.train.global_batch
    rows_per_pass = global_batch // full.replicas // full.grad_accum_steps
    per_replica = global_batch // replicas
    for accum_steps in range(max(1, math.ceil(per_replica / rows_per_pass)), per_replica + 1):
        if per_replica % accum_steps == 0:
            return accum_steps
    return None


def replan_mesh(
    config: Config, devices_per_proc: int, job_processes: int, healthy_processes: int
) -> MeshPlan:
    """The largest mesh on at most `healthy_processes` workers that keeps pipe and tensor,
    shrinks data, fsdp and expert (expert, then fsdp, kept as large as they can: they bound
    memory per device; expert only to a divisor of the job's, so it still divides the experts),
    still divides train.global_batch, and passes the trainer's config checks. The global batch,
    and so what the model sees at each step, is unchanged. MsjaxError (one line) if none fits."""
    full = full_plan(config, devices_per_proc, job_processes)
    if healthy_processes >= job_processes:
        return full
    global_batch = config.train.global_batch
    for data, fsdp, expert in _replica_shapes(full):
        replicas = data * fsdp * expert
        devices = replicas * full.pipe * full.tensor
        if devices % devices_per_proc or devices // devices_per_proc > healthy_processes:
            continue
        if global_batch % replicas:
            continue
        accum_steps = _accum_steps_for(config, full, replicas)
        if accum_steps is not None and _fits(config, data, fsdp, expert, accum_steps):
            processes = devices // devices_per_proc
            return MeshPlan(data, fsdp, full.pipe, full.tensor, accum_steps, processes, expert)
    raise MsjaxError(
        f"cannot re-plan the mesh on {healthy_processes} healthy processes x "
        f"{devices_per_proc} devices: pipe x tensor = {full.pipe * full.tensor} is kept, and no "
        f"data x fsdp x expert up to {full.data} x {full.fsdp} x {full.expert} fills whole "
        f"processes, divides train.global_batch={global_batch} and passes the config checks"
    )


def _replica_shapes(full: MeshPlan) -> list[tuple[int, int, int]]:
    """(data, fsdp, expert) no larger than the job's, most devices first, then the larger
    expert, then the larger fsdp."""
    experts = [size for size in range(1, full.expert + 1) if full.expert % size == 0]
    shapes = [
        (data, fsdp, expert)
        for data in range(1, full.data + 1)
        for fsdp in range(1, full.fsdp + 1)
        for expert in experts
    ]
    return sorted(shapes, key=lambda s: (s[0] * s[1] * s[2], s[2], s[1]), reverse=True)


ACTIVE, SPARE, IDLE, EXCLUDED = "active", "spare", "idle", "excluded"
READMIT_MAX_DOUBLINGS = 6  # a slot's time out grows to at most 64 x resilience.readmit_after_s


class Slots:
    """The launcher's process places on one node: the first `nprocs` hold the job's ranks, the
    next `spares` wait as spares. A slot is where a worker runs, a rank its role in the mesh: an
    excluded slot's rank moves to a spare, or the job shrinks onto the healthy slots (those left
    out of a smaller mesh wait idle). Which slot is bad is the policy's (msjax.launch.policy)."""

    def __init__(self, nprocs: int, spares: int = 0):
        self.state = {slot: ACTIVE if slot < nprocs else SPARE for slot in range(nprocs + spares)}
        self.rank_slots = list(range(nprocs))  # rank -> slot
        self.excluded_unix_s: dict[int, float] = {}
        # time outs each slot has begun (exclusions and failed re-admissions): each doubles the
        # next, so a slot that keeps failing is checked ever more rarely (READMIT_MAX_DOUBLINGS)
        self.times_out: dict[int, int] = {}

    def slot_of(self, rank: int) -> int | None:
        return self.rank_slots[rank] if 0 <= rank < len(self.rank_slots) else None

    def spares(self) -> list[int]:
        return [slot for slot, state in self.state.items() if state == SPARE]

    def healthy(self) -> list[int]:
        """Slots that may run a rank (active or idle), in slot order; spares not counted."""
        return [slot for slot, state in self.state.items() if state in (ACTIVE, IDLE)]

    def exclude(self, slot: int, now_unix_s: float) -> int | None:
        """Take `slot` out of the job. Its rank goes to the first spare, which is returned; None
        when no spare is left (then `arrange` lays the ranks over a shrunk mesh)."""
        rank = self.rank_slots.index(slot)
        self.state[slot] = EXCLUDED
        self._time_out(slot, now_unix_s)
        spares = self.spares()
        if not spares:
            del self.rank_slots[rank]
            return None
        self.state[spares[0]] = ACTIVE
        self.rank_slots[rank] = spares[0]
        return spares[0]

    def drop_spare(self, slot: int, now_unix_s: float) -> None:
        """A spare that failed its self-check: excluded (checked again for re-admission)."""
        assert self.state[slot] == SPARE
        self.state[slot] = EXCLUDED
        self._time_out(slot, now_unix_s)

    def _time_out(self, slot: int, now_unix_s: float) -> None:
        self.excluded_unix_s[slot] = now_unix_s
        self.times_out[slot] = self.times_out.get(slot, 0) + 1

    def time_out_s(self, slot: int, after_s: float) -> float:
        """How long `slot` stays out this time: after_s, doubled for each time out it began
        before (re-admitted ones included), at most READMIT_MAX_DOUBLINGS times."""
        doublings = min(self.times_out.get(slot, 1) - 1, READMIT_MAX_DOUBLINGS)
        return after_s * 2**doublings

    def arrange(self, processes: int) -> None:
        """Ranks 0..processes-1 on the first healthy slots in slot order; the rest idle."""
        healthy = self.healthy()
        assert processes <= len(healthy)
        self.rank_slots = healthy[:processes]
        for slot in healthy:
            self.state[slot] = ACTIVE if slot in self.rank_slots else IDLE

    def readmit_due(self, now_unix_s: float, after_s: float) -> list[int]:
        """Excluded slots whose time out (time_out_s) is over (after_s=0: never), oldest exclusion
        first: each is re-admitted (readmit) once its checks pass, else kept out (keep_out)."""
        if after_s <= 0:
            return []
        due = [
            slot
            for slot, t in self.excluded_unix_s.items()
            if now_unix_s - t >= self.time_out_s(slot, after_s)
        ]
        return sorted(due, key=lambda slot: self.excluded_unix_s[slot])

    def readmit(self, slot: int) -> None:
        """An excluded slot becomes idle, healthy again: it rejoins at the job's next re-plan."""
        assert self.state[slot] == EXCLUDED
        self.state[slot] = IDLE
        del self.excluded_unix_s[slot]

    def keep_out(self, slot: int, now_unix_s: float) -> None:
        """An excluded slot that failed its check for re-admission: a time out twice as long
        starts."""
        assert self.state[slot] == EXCLUDED
        self._time_out(slot, now_unix_s)

    def make_spare(self, slot: int) -> None:
        """A healthy slot outside the mesh becomes a spare (it waits in its own process)."""
        assert self.state[slot] == IDLE
        self.state[slot] = SPARE

    def describe(self) -> dict[str, list[int]]:
        """Slots by state, for incidents and messages."""
        return {
            state: [slot for slot, held in self.state.items() if held == state]
            for state in (ACTIVE, SPARE, IDLE, EXCLUDED)
        }
