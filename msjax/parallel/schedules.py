"""Pipeline schedules as data: per iteration and stage, which microbatch (and repeat) runs forward
or backward, or nothing, and the facts that a schedule's costs are read from (iterations, bubble,
stash, the buffers its loop holds, what crosses `pipe`). The traced loops execute these tables;
`step.py` and the planner read the facts, never a schedule's name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

IDLE, FORWARD, BACKWARD = 0, 1, 2  # an action's kind
# columns of ScheduleTable.actions
KIND, MICROBATCH, REPEAT, STASH_SLOT = range(4)
# the branches of a loop that branches per device (1F1B's), in switch order: the table's kinds,
# then the last stage's forward, which runs the loss head too
IDLE_BRANCH, FORWARD_BRANCH, BACKWARD_BRANCH, HEAD_BRANCH = range(4)
GPIPE, CIRCULAR, ONE_F_ONE_B = "gpipe", "circular", "1f1b"  # PipelineConfig.schedule


def forward_table(stages: int, repeats: int, microbatches: int) -> np.ndarray:
    """GPipe (R = 1) and circular: stage s runs its (r M + m)-th pair at iteration r M + m + s."""
    iterations = repeats * microbatches + stages - 1
    actions = np.zeros((iterations, stages, 4), np.int32)
    actions[..., STASH_SLOT] = -1
    for iteration in range(iterations):
        for stage in range(stages):
            virtual = iteration - stage
            if 0 <= virtual < repeats * microbatches:
                microbatch, repeat = virtual % microbatches, virtual // microbatches
                actions[iteration, stage] = (FORWARD, microbatch, repeat, -1)
    return actions


def one_f_one_b_table(stages: int, repeats: int, microbatches: int) -> np.ndarray:
    """1F1B in unit iterations, one forward or one backward each: stage s runs microbatch m
    forward at iteration s + 2m and backward at 2P - 1 - s + 2m, so an activation reaches the next
    stage, and a gradient the previous one, just in time for the next iteration. Forwards fall on
    iterations t with t - s even, backwards on the others: 2(M + P - 1) iterations, P - 1 idle
    pairs per stage, bubble (P - 1) / (M + P - 1). Stage s holds P - s microbatches between their
    forward and backward (stage 0 the most), in slot m mod min(M, P). One repeat only.
    """
    iterations = 2 * (microbatches + stages - 1)
    slots = min(microbatches, stages)
    actions = np.zeros((iterations, stages, 4), np.int32)
    for stage in range(stages):
        for microbatch in range(microbatches):
            slot = microbatch % slots
            actions[stage + 2 * microbatch, stage] = (FORWARD, microbatch, 0, slot)
            backward = 2 * stages - 1 - stage + 2 * microbatch
            actions[backward, stage] = (BACKWARD, microbatch, 0, slot)
    return actions


def one_f_one_b_pairs(stages: int, parity: int) -> list[tuple[int, int]]:
    """The (source, target) stages of 1F1B's transfer after an iteration of this parity: a stage
    that ran a forward (t - s even) sends its output to s + 1, one that ran a backward sends its
    input's gradient to s - 1; so the stages pair up, (0, 1), (2, 3), ... after even iterations
    and (1, 2), (3, 4), ... after odd ones, and each sends one tensor."""
    pairs = []
    for stage in range(stages):
        target = stage + 1 if (parity - stage) % 2 == 0 else stage - 1
        if 0 <= target < stages:
            pairs.append((stage, target))
    return pairs


@dataclass(frozen=True)
class Schedule:
    """A kind of schedule: how its table is built and the loop that executes it."""

    name: str  # PipelineConfig.schedule
    build: Callable[[int, int, int], np.ndarray]  # (stages, repeats, microbatches) -> actions
    # the loop runs each microbatch's backward itself (1F1B) instead of leaving it to autodiff;
    # it then runs the loss head on the last stage, and every stage embeds the whole batch
    runs_backward: bool
    # each device branches on its own action, so an idle stage computes nothing; without
    # branching (one vmapped program over the stages) an idle stage computes on zeros
    branches_per_stage: bool
    # a microbatch goes round the stages more than once: the last stage's output returns to
    # stage 0, where it waits for its next repeat in a ring
    wraps_around: bool
    # float32 copies of a device's stacked layer weights that the loop keeps when a stage runs
    # a layer scan: its own copy and a stage run's gradient of all of them (one repeat's chunk
    # under circular, which costs less than a copy: one copy in all fits XLA's totals). Read off
    # XLA's buffer assignment, tiny and small configs, pipe 2 and 4 (tests/unit/test_plan.py).
    loop_weight_copies: int
    # pipeline.fsdp_gather=once: float32 copies of the device's stacked layer weights, whole
    # over fsdp, alive through the loop in place of loop_weight_copies: the gathered weights and
    # their gradient's accumulator; under 1F1B also a backward's gradient of them and their sum
    # over the replicas, both whole inside the loop's shard_map. Counted from the programs, and
    # held against XLA's totals on tiny, pipe 2 x fsdp 2 x tensor 2 (tests/unit/test_plan.py).
    gathered_weight_copies: int


SCHEDULES = {
    GPIPE: Schedule(GPIPE, forward_table, False, False, False, 2, 2),
    CIRCULAR: Schedule(CIRCULAR, forward_table, False, False, True, 1, 2),
    ONE_F_ONE_B: Schedule(ONE_F_ONE_B, one_f_one_b_table, True, True, False, 2, 4),
}


@dataclass(frozen=True)
class ScheduleTable:
    """What every stage does in every iteration of one pipeline schedule, and what that costs.

    actions[t, s] = (kind, microbatch, repeat, stash slot): stage s runs the forward or backward
    of (microbatch, repeat) in iteration t; the stash slot is where a forward keeps what its
    backward needs and where that backward reads it (-1 where nothing is kept). Idle entries hold
    zeros in every other column.
    """

    schedule: Schedule
    stages: int
    repeats: int
    microbatches: int
    actions: np.ndarray  # int32 [iterations, stages, 4]

    @property
    def name(self) -> str:
        return self.schedule.name

    @property
    def runs_backward(self) -> bool:
        return self.schedule.runs_backward

    @property
    def branches_per_stage(self) -> bool:
        return self.schedule.branches_per_stage

    @property
    def iterations(self) -> int:
        return int(self.actions.shape[0])

    @property
    def busy(self) -> int:
        """Stage-iterations that run something."""
        return int(np.sum(self.actions[..., KIND] != IDLE))

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-iterations idle."""
        return 1.0 - self.busy / (self.iterations * self.stages)

    @property
    def stash_slots(self) -> int:
        """Microbatches a stage holds at most between their forward and their backward."""
        return int(self.actions[..., STASH_SLOT].max()) + 1

    @property
    def stage_runs(self) -> int:
        """Stage forwards a device computes per step, idle iterations included where idle stages
        compute on zeros (the loop's forward under autodiff, whose backward mirrors it)."""
        if self.branches_per_stage:
            return self.repeats * self.microbatches
        return self.iterations

    @property
    def slots_per_stage(self) -> int:
        """Microbatches each stage holds of a forward loop's streams (its inputs, then its
        outputs): ceil(M / P), MaxText's state_io."""
        return -(-self.microbatches // self.stages)

    @property
    def return_slots(self) -> int:
        """Iterations a microbatch waits between leaving the last stage and entering stage 0
        again, M - P + 1, so the ring where it waits holds that many (0: nothing wraps)."""
        return self.microbatches - self.stages + 1 if self.schedule.wraps_around else 0

    @property
    def delays_wrap_around(self) -> bool:
        """Whether the wrap-around transfer goes out one iteration after the output it carries
        was made, so it overlaps the next iteration's stage run (MaxText's delayed rotation):
        possible where the output waits in the ring at least an iteration (M > P)."""
        return self.return_slots > 1

    @property
    def embedding_share(self) -> float:
        """Share of a replica's batch that one device embeds: the microbatches its stage holds,
        or all of them where the loop owns the backward (1F1B reads every input on every rank)."""
        return 1.0 if self.runs_backward else self.slots_per_stage / self.microbatches

    @property
    def head_share(self) -> float:
        """Share of a replica's batch whose loss head one device runs on average: the last stage
        alone where the loop owns the backward, else the microbatches a stage holds."""
        if self.runs_backward:
            return 1.0 / self.stages
        return self.slots_per_stage / self.microbatches

    @property
    def stream_buffers(self) -> int:
        """Microbatch-sized buffers a forward loop's stage holds outside its stage runs: its
        streams and their gradient, and the ring where microbatches wait to re-enter stage 0;
        with the wrap-around delayed, the outputs on their way there and their gradient."""
        delayed = 2 if self.delays_wrap_around else 0
        return 2 * self.slots_per_stage + self.return_slots + delayed

    @property
    def sends_per_iteration(self) -> float:
        """Stage activations (or their gradients) a device sends per iteration of the table over
        `pipe`, on average over devices. 1F1B: one tensor to the neighbour it pairs with (pairs
        alternate, see one_f_one_b_pairs), so (P - 1) / P. A forward loop runs each iteration
        forward and again backward (autodiff), and each time sends its output on and a column of
        the streams back: (P - 1) / P each, as stage 0 receives nothing and the last stage keeps
        its outputs; under circular the last stage's output goes on to stage 0 as well."""
        back = (self.stages - 1) / self.stages
        if self.runs_backward:
            return back
        on = 1.0 if self.schedule.wraps_around else back
        return 2 * (on + back)

    def branch_shares(self) -> tuple[float, ...] | None:
        """How often each branch of the per-device switch runs (IDLE_BRANCH ... HEAD_BRANCH), as
        a share of the switch's runs over all devices; None for loops that do not branch."""
        if not self.branches_per_stage:
            return None
        kinds = self.actions[..., KIND]
        last = np.zeros(kinds.shape, bool)
        last[:, -1] = True
        counts = [
            np.sum(kinds == IDLE),
            np.sum((kinds == FORWARD) & ~last),
            np.sum(kinds == BACKWARD),
            np.sum((kinds == FORWARD) & last),
        ]
        return tuple(float(count) / kinds.size for count in counts)

    def at(self, iteration: int, stage: int) -> tuple[int, int, int, int]:
        return tuple(int(value) for value in self.actions[iteration, stage])  # type: ignore[return-value]


@functools.lru_cache(maxsize=64)
def schedule_table(name: str, stages: int, repeats: int, microbatches: int) -> ScheduleTable:
    """The table of a schedule by its config name."""
    schedule = SCHEDULES[name]
    repeats = repeats if schedule.wraps_around else 1
    return ScheduleTable(
        schedule, stages, repeats, microbatches, schedule.build(stages, repeats, microbatches)
    )
