"""The corruption guard: the data-parallel replicas' whole state (parameters and optimizer
state) fingerprinted on device and compared, the replica that differs named, and the rerun state
machine that tells a transient mismatch from a persistent one. The loop's side (when to check,
the replay) is in msjax.training.replica_checks.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from msjax.resilience.compiled_later import CompiledLater
from msjax.run_dir import RunDir

# the verdicts of RUN_DIR/replica_mismatches.jsonl that end the run (SilentCorruption)
PERSISTENT, UNDECIDED, COMPUTE_CHECK = "persistent", "undecided", "compute_check"
FINAL_VERDICTS = (PERSISTENT, UNDECIDED, COMPUTE_CHECK)


class SilentCorruption(Exception):
    """A replica's state differed from the others' and the difference came back when its window
    was replayed (or resilience.on_corruption=stop), or a device failed the in-training
    known-answer check: the ranks named are bad. No rank named: corruption that no check could
    pin on one replica (two replicas that each reproduce their own state bitwise)."""

    def __init__(self, message: str, ranks: Sequence[int]):
        super().__init__(message)
        self.ranks = tuple(ranks)


def _block_fingerprint(block: Any) -> Any:
    """uint32[2] of one device's block: the sum of its 32-bit words, and the sum of each word
    times an odd weight of its position (2i + 1), both modulo 2**32. Any single flipped bit
    changes both: a flip adds or takes +-2**b, and an odd weight times 2**b is never 0."""
    import jax
    import jax.numpy as jnp

    itemsize = jnp.dtype(block.dtype).itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[itemsize]
    words = jax.lax.bitcast_convert_type(block, unsigned).reshape(-1).astype(jnp.uint32)
    weights = jax.lax.iota(jnp.uint32, words.shape[0]) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * weights, dtype=jnp.uint32)])


class ReplicaFingerprints:
    """One jitted program: every device fingerprints its own block of each tensor of the state
    (parameters, optimizer state, step), and one all-gather of those integers (2 x 4 bytes per
    tensor per device) gives every device, and so every process, the same table. No tensor
    leaves its device."""

    def __init__(self, mesh: Any, state_shardings: Any):
        import jax
        from jax.sharding import PartitionSpec

        from msjax.checkpoint.fingerprint import leaf_name
        from msjax.parallel.mesh import MESH_AXES

        self.mesh = mesh
        self._compiled: CompiledLater | None = None
        paths = jax.tree_util.tree_flatten_with_path(state_shardings)[0]
        self.tensor_names = tuple(leaf_name(path) for path, _ in paths)
        specs = jax.tree.map(lambda sharding: sharding.spec, state_shardings)

        def local(state: Any) -> Any:
            blocks = jax.tree.leaves(state)
            mine = jax.numpy.stack([_block_fingerprint(block) for block in blocks])  # [K, 2]
            return jax.lax.all_gather(mine, MESH_AXES)  # [devices, K, 2], mesh order

        self._program = jax.jit(
            # the all-gather leaves the same table on every device; shard_map's replication
            # check does not infer that through an all_gather over several axes
            jax.shard_map(
                local, mesh=mesh, in_specs=(specs,), out_specs=PartitionSpec(), check_vma=False
            )
        )

    def lower(self, abstract_state: Any) -> Any:
        return self._program.lower(abstract_state)

    def compile(self, abstract_state: Any) -> None:
        """Compile the program on a thread of its own from now on: the first steps need not
        wait for it, and the first check seldom does."""
        self._compiled = CompiledLater(
            lambda: self.lower(abstract_state).compile(), "replica-fingerprints"
        )

    def table(self, state: Any) -> np.ndarray:
        """uint64 [data, fsdp, expert, pipe, tensor, tensors]: each device's fingerprint of each
        of its blocks of the state, read from this process's own copy of the gathered table."""
        gathered = (self._program if self._compiled is None else self._compiled.get())(state)
        local = np.asarray(gathered.addressable_shards[0].data)  # [devices, K, 2] uint32
        combined = (local[..., 0].astype(np.uint64) << np.uint64(32)) | local[..., 1]
        return combined.reshape(*self.mesh.devices.shape, len(self.tensor_names))


@dataclass(frozen=True)
class Mismatch:
    """Replicas whose state differs after `step`; the last check that agreed was at
    `agreed_step` (the window is agreed_step..step)."""

    step: int
    agreed_step: int
    tensor: str  # the first tensor (in the state's order) whose fingerprints differ
    devices: tuple[tuple[int, ...], ...]  # mesh coordinates (MESH_AXES order) named
    device_ranks: tuple[int, ...]  # the process holding each of them
    majority: bool  # the named devices differ from a majority; else no majority to judge by
    table: np.ndarray

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.device_ranks)))

    def describe(self) -> str:
        places = "; ".join(f"rank {rank} ({self._coordinates(rank)})" for rank in self.ranks)
        if self.majority:
            who = f"{places} differs from the other replicas"
        else:
            replicas = self.table.shape[0]
            who = f"{places} disagree, with no majority of {replicas} data replicas to judge by"
        return (
            f"the data-parallel replicas' state differs after step {self.step} (window: "
            f"steps {self.agreed_step}..{self.step}, the last check that agreed at step "
            f"{self.agreed_step}): {who}; first in {self.tensor}"
        )

    def _coordinates(self, rank: int) -> str:
        from msjax.parallel.mesh import named_place

        owned = zip(self.devices, self.device_ranks, strict=True)
        places = [place for place, owner in owned if owner == rank]
        shape = self.table.shape[:-1]
        return "; ".join(
            " ".join(f"{axis}={index}" for axis, index in named_place(place, shape).items())
            for place in places
        )

    def record(self, event: str) -> dict[str, Any]:
        from msjax.parallel.mesh import named_place

        shape = self.table.shape[:-1]
        return {
            "event": event,
            "step": self.step,
            "window": [self.agreed_step, self.step],
            "tensor": self.tensor,
            "ranks": list(self.ranks),
            "devices": [named_place(place, shape) for place in self.devices],
            "majority": self.majority,
        }


def compare(
    table: np.ndarray,
    step: int,
    agreed_step: int,
    tensor_names: Sequence[str],
    process_of: Callable[[tuple[int, ...]], int],
) -> Mismatch | None:
    """None when every data replica holds the same fingerprints; else the devices that differ
    from the majority at their place (every device there, where no majority exists)."""
    replicas = table.shape[0]
    differs = (table != table[:1]).any(axis=0)  # [fsdp, pipe, tensor, K]
    if not differs.any():
        return None
    named: set[tuple[int, ...]] = set()
    for *place, tensor in zip(*np.nonzero(differs), strict=True):
        column = [int(table[(replica, *place, tensor)]) for replica in range(replicas)]
        values, counts = np.unique(column, return_counts=True)
        if counts.max() * 2 > replicas:
            majority_value = values[counts.argmax()]
            off = [replica for replica in range(replicas) if column[replica] != majority_value]
        else:
            off = list(range(replicas))
        named.update((replica, *map(int, place)) for replica in off)
    devices = tuple(sorted(named))
    majority = len({device[0] for device in devices}) < replicas
    first_tensor = int(np.nonzero(differs.reshape(-1, differs.shape[-1]).any(axis=0))[0][0])
    device_ranks = tuple(process_of(device) for device in devices)
    return Mismatch(
        step, agreed_step, tensor_names[first_tensor], devices, device_ranks, majority, table
    )


def changed_devices(before: np.ndarray, after: np.ndarray) -> set[tuple[int, ...]]:
    """The devices (mesh coordinates) whose fingerprints differ between two tables of the same
    step: a replica that computed and kept its parameters right reproduces them bitwise."""
    changed = (before != after).any(axis=-1)
    return {tuple(int(i) for i in index) for index in zip(*np.nonzero(changed), strict=True)}


@dataclass(frozen=True)
class Replay:
    """Replay from the newest checkpoint (replicas agreed) at or before step `at_most`, checking
    the replicas after every step up to `until`."""

    at_most: int
    until: int


KnownAnswerCheck = Callable[[], tuple[int, ...]]  # ranks whose devices fail it, alike everywhere


class RerunStateMachine:
    """Megatron's rerun state machine, made multi-process: every process feeds it the same
    gathered fingerprints, so all take the same transitions.

    run: a check that agrees moves the window's start; a mismatch (window L..C) replays from the
      newest checkpoint at or before L, checking every step up to C (on_corruption=stop: bad now).
    replay: no mismatch through C: transient, blamed on the replica whose state at C differs
      from its own replay (logged; the run goes on from the replay). One that comes back is
      persistent: with a majority its ranks are bad at once; with none (two replicas) `locate`
      replays up to that step once more.
    locate: the replica whose fingerprints at that step changed between the two replays is the
      one that did not compute or keep its state right: its ranks are bad. Where each replica
      reproduced itself bitwise (a stuck bit), the known-answer check runs on every device: the
      ranks that fail it are bad; none failing, the verdict is undecided and nobody is blamed.
    """

    def __init__(
        self,
        on_corruption: str,
        start_step: int,
        log: Callable[[dict[str, Any], str], None],
        known_answer: KnownAnswerCheck = lambda: (),
    ):
        self.on_corruption = on_corruption
        self.mode = "run"
        self.agreed_step = start_step  # a restored checkpoint, or a fresh state: agreed
        self.first: Mismatch | None = None
        self.came_back: Mismatch | None = None
        self.replay: Replay | None = None
        self.log = log
        self.known_answer = known_answer

    def checks_every_step(self, step: int) -> bool:
        """Whether the state after `step` updates is checked because a replay is under way."""
        return self.replay is not None and step <= self.replay.until

    def observe(self, step: int, table: np.ndarray, mismatch: Mismatch | None) -> Replay | None:
        """The outcome of the check after `step` updates (its table, and the mismatch found in
        it): None to go on, a Replay to start now; SilentCorruption where a rank is found bad."""
        if self.mode == "run":
            return self._run(step, mismatch)
        if self.mode == "replay":
            return self._replaying(step, table, mismatch)
        return self._locating(step, table, mismatch)

    def _run(self, step: int, mismatch: Mismatch | None) -> Replay | None:
        if mismatch is None:
            self.agreed_step = step
            return None
        self.log(mismatch.record("mismatch"), f"warning: {mismatch.describe()}")
        if self.on_corruption == "stop":
            self._persistent(mismatch, "resilience.on_corruption=stop")
        self.first, self.mode = mismatch, "replay"
        self.replay = Replay(self.agreed_step, step)
        return self.replay

    def _replaying(self, step: int, table: np.ndarray, mismatch: Mismatch | None) -> Replay | None:
        assert self.first is not None and self.replay is not None
        if mismatch is None:
            if step < self.replay.until:
                return None
            self._transient(step, table)
            return None
        how = f"it came back when the window from step {self.replay.at_most} was replayed"
        if mismatch.majority:
            self._bad(mismatch, mismatch.ranks, how)
        self.came_back, self.mode = mismatch, "locate"
        self.replay = Replay(self.replay.at_most, step)
        return self.replay

    def _transient(self, step: int, table: np.ndarray) -> None:
        """The replay agreed through the mismatch's step: the replica whose state there differs
        from its own replay is the one that went wrong once."""
        first, replay = self.first, self.replay
        assert first is not None and replay is not None
        suspects = dict(zip(first.devices, first.device_ranks, strict=True))
        changed = changed_devices(first.table, table)
        ranks = sorted({rank for device, rank in suspects.items() if device in changed})
        blamed = f"rank {', '.join(map(str, ranks))}" if ranks else "no replica"
        self.log(
            {
                **first.record("transient"),
                "ranks": ranks,
                "named_by_mismatch": list(first.ranks),
                "replayed_from": replay.at_most,
            },
            f"the replica mismatch after step {first.step} was transient: replayed from step "
            f"{replay.at_most} or before, the replicas agreed through step {step}; {blamed} "
            "differed from its own replay; going on from the replay",
        )
        self.mode, self.agreed_step, self.first, self.replay = "run", step, None, None

    def _locating(self, step: int, table: np.ndarray, mismatch: Mismatch | None) -> Replay | None:
        assert self.came_back is not None and self.replay is not None
        how = f"it came back when the window from step {self.replay.at_most} was replayed"
        if step < self.replay.until:
            if mismatch is not None:  # earlier than in the first replay: no reproduction to use
                self._persistent(mismatch, how)
            return None
        suspects = dict(zip(self.came_back.devices, self.came_back.device_ranks, strict=True))
        changed = changed_devices(self.came_back.table, table)
        culprits = sorted({rank for device, rank in suspects.items() if device in changed})
        if culprits:
            how += "; a second replay reproduced every other replica bitwise"
            self._bad(self.came_back, culprits, how)
        how += "; a second replay reproduced each replica as before"
        self._persistent(self.came_back, how)
        return None

    def _persistent(self, mismatch: Mismatch, how: str) -> None:
        """A mismatch that stays: its ranks are bad where a majority names them; with none, the
        known-answer check decides, or nobody is blamed (UNDECIDED)."""
        if mismatch.majority:
            self._bad(mismatch, mismatch.ranks, how)
        failed = sorted(set(self.known_answer()))
        if failed:
            self._bad(
                mismatch,
                failed,
                f"{how}; the known-answer check failed on rank(s) " + ", ".join(map(str, failed)),
            )
        line = (
            f"{mismatch.describe()}; persistent ({how}); every device passed the known-answer "
            "check: no replica can be blamed, none is marked bad"
        )
        self.log({**mismatch.record(UNDECIDED), "bad_ranks": [], "how": how}, line)
        raise SilentCorruption(line, ())

    def _bad(self, mismatch: Mismatch, ranks: Sequence[int], how: str) -> None:
        named = ", ".join(str(rank) for rank in ranks)
        line = f"{mismatch.describe()}; persistent ({how}): rank {named} marked bad"
        self.log({**mismatch.record(PERSISTENT), "bad_ranks": list(ranks), "how": how}, line)
        raise SilentCorruption(line, ranks)


def recorded_verdict(run_dir: Path) -> dict[str, Any] | None:
    """The last record in run_dir's replica_mismatches.jsonl that ended the run (a persistent
    mismatch, an undecided one, a failed known-answer check); None: there is none."""
    path = RunDir(run_dir).replica_mismatches
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") in FINAL_VERDICTS:
            return record
    return None


def recorded_bad_ranks(run_dir: Path) -> tuple[int, ...]:
    """The ranks the last verdict in run_dir marked bad (none: no such record, or undecided)."""
    verdict = recorded_verdict(run_dir)
    return tuple(int(rank) for rank in (verdict or {}).get("bad_ranks", ()))


class MismatchLog:
    """RUN_DIR/replica_mismatches.jsonl, one record per event (process 0 writes it)."""

    def __init__(
        self,
        run_dir: Path,
        is_writer: bool,
        message: Callable[[str], None],
        barrier: Callable[[], None] = lambda: None,
    ):
        self.path = RunDir(run_dir).replica_mismatches
        self.is_writer = is_writer
        self.message = message
        self.barrier = barrier  # every process waits here until the writer has written

    def __call__(self, record: dict[str, Any], line: str) -> None:
        record = {**record, "unix_s": time.time()}
        final = record["event"] in FINAL_VERDICTS
        if not final:  # a final one ends the run, and its error says it
            self.message(line)
        if self.is_writer:
            with self.path.open("a") as log:
                log.write(json.dumps(record) + "\n")
                log.flush()
                os.fsync(log.fileno())
        if final:
            self.barrier()  # on disk before any process leaves: the supervisor reads the rank
