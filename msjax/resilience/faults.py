"""Fault injection for tests and drills, read by each worker from the MSJAX_FAULT environment.

`MSJAX_FAULT="crash@step=7,rank=1;nan@step=9,rank=0"`: faults separated by `;`, each
`KIND@step=K,rank=R[,times=N][,percent=X]`. Kinds, all at step index K on rank R:
  crash          the process exits abruptly before step K runs
  raise          an exception (InjectedError) is raised before step K, in every attempt: a bug
                 the same run hits every time, whatever the slot
  hang           the loop stops making progress before step K (the process stays alive)
  nan            the loss rank R reads back for step K is NaN
  bad_token      rank R's first input token of step K is model.vocab_size, out of the table:
                 its embedding, and so the loss and every gradient of that step, are NaN
  slow           from step K on, rank R sleeps X percent of its step time after every step
  crash_in_save  the process exits while the checkpoint of step K is being written
  save_error     saves from step K on fail with OSError ENOSPC (a full disk), `times` saves
  disk_full      rank R's process fails with OSError ENOSPC (a full disk) before step K runs
  bitflip        after step K's update, one bit of rank R's copy of the first parameter flips
                 in device memory (firing n flips element n of its first local block)
  stuck_bit      after step K's update, the same bit of the same element of rank R's first
                 parameter flips, in every replay and attempt: a stuck memory cell that
                 reproduces bitwise (`times` is not needed)
  opt_bitflip    after step K's update, one bit of rank R's copy of the first floating tensor of
                 the optimizer state flips (firing n flips element n), `times` times
  memory_loss    rank R's node loses its memory before step K: the in-memory snapshots of its
                 process (its own and the copies it holds for a peer) are deleted, and the
                 process is killed (SIGKILL)
  corrupt_compute  every matmul rank R's process computes is slightly wrong, in every attempt
                 (step is not needed): a device with silent data corruption, for self-checks
Each fault fires `times` times (default 1) over all restarts of a run; firings are recorded in
RUN_DIR/faults.jsonl before they happen. Kept out of the config on purpose: a drill is not part of
what defines a run. Under msjax.launch, `rank=R` names the process slot that holds rank R when the
job starts (MSJAX_SLOT), and the fault stays with that slot, as a broken machine would.
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msjax.errors import MsjaxError
from msjax.run_dir import RunDir

ENV_VAR = "MSJAX_FAULT"
SLOT_ENV_VAR = "MSJAX_SLOT"  # the launcher's process slot this worker runs in (default: its rank)
KINDS = (
    "crash",
    "raise",
    "hang",
    "nan",
    "slow",
    "crash_in_save",
    "save_error",
    "disk_full",
    "bad_token",
    "corrupt_compute",
    "bitflip",
    "stuck_bit",
    "opt_bitflip",
    "snapshot_bitflip",
    "memory_loss",
)
PERSISTENT_KINDS = (
    "slow",
    "corrupt_compute",
    "stuck_bit",
    "raise",
)  # they act in every attempt, not `times` times
CORRUPTION = 1e-2  # corrupt_compute: a matmul's relative error (msjax.ops.matmul)
# bitflip: a mantissa bit per parameter width (bytes): the value changes by about 1/8, stays finite
BITFLIP_BIT = {2: 4, 4: 20, 8: 49}
CRASH_EXIT_CODE = 1  # what an injected crash exits with, like an uncaught exception


class InjectedError(RuntimeError):
    """The exception of an injected `raise`: to the worker, an unexpected error like any other."""


@dataclass(frozen=True)
class InjectedFault:
    kind: str
    step: int
    rank: int
    times: int = 1
    percent: float = 0.0

    @property
    def spec(self) -> str:
        extra = f",percent={self.percent:g}" if self.kind == "slow" else ""
        extra += f",times={self.times}" if self.times != 1 else ""
        if self.kind == "corrupt_compute":
            return f"{self.kind}@rank={self.rank}"
        return f"{self.kind}@step={self.step},rank={self.rank}{extra}"


def parse_faults(text: str) -> tuple[InjectedFault, ...]:
    """Faults from MSJAX_FAULT's syntax; MsjaxError naming the bad part."""
    faults = []
    for part in (part.strip() for part in text.split(";")):
        if not part:
            continue
        kind, at, options = part.partition("@")
        if kind not in KINDS or not at:
            raise MsjaxError(
                f"{ENV_VAR}: {part!r} must look like KIND@step=K,rank=R with KIND one of "
                + ", ".join(KINDS)
            )
        values: dict[str, float] = {}
        for option in options.split(","):
            key, equals, number = option.partition("=")
            key = key.strip()
            if key not in ("step", "rank", "times", "percent") or not equals:
                raise MsjaxError(
                    f"{ENV_VAR}: {option!r} in {part!r} is not one of step=K, rank=R, times=N, "
                    "percent=X"
                )
            try:
                values[key] = float(number)
            except ValueError:
                raise MsjaxError(f"{ENV_VAR}: {option!r} in {part!r} needs a number") from None
        if kind == "corrupt_compute":
            values.setdefault("step", 0.0)  # it acts on every step
        if "step" not in values or "rank" not in values:
            raise MsjaxError(f"{ENV_VAR}: {part!r} needs both step=K and rank=R")
        integers = {key: values[key] for key in ("step", "rank", "times") if key in values}
        for key, value in integers.items():
            if value != int(value) or value < (1 if key == "times" else 0):
                raise MsjaxError(f"{ENV_VAR}: {key}={value:g} in {part!r} must be a whole number")
        percent = values.get("percent", 0.0)
        if kind == "slow" and not (math.isfinite(percent) and percent > 0):
            raise MsjaxError(f"{ENV_VAR}: {part!r} needs percent=X > 0")
        faults.append(
            InjectedFault(
                kind,
                int(values["step"]),
                int(values["rank"]),
                int(values.get("times", 1)),
                percent,
            )
        )
    return tuple(faults)


def read_firings(run_dir: Path) -> list[dict]:
    """Every injected fault that fired in run_dir, oldest first."""
    path = RunDir(run_dir).faults
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class FaultInjector:
    """This rank's share of MSJAX_FAULT, with hooks the train loop calls at the right places."""

    def __init__(
        self,
        faults: tuple[InjectedFault, ...],
        run_dir: Path,
        rank: int,
        attempt: int,
        slot: int | None = None,
    ):
        self.run_dir = run_dir
        self.rank = rank
        self.slot = rank if slot is None else slot
        self.attempt = attempt
        fired: dict[str, int] = {}
        for firing in read_firings(run_dir):
            fired[firing["fault"]] = fired.get(firing["fault"], 0) + 1
        self._pending = [
            fault
            for fault in faults
            if fault.rank == self.slot
            and (fault.kind in PERSISTENT_KINDS or fired.get(fault.spec, 0) < fault.times)
        ]
        self._fired = fired  # firings per fault over every attempt so far
        self._last_step_at: float | None = None
        self._slow_noted = False
        corrupt = [fault for fault in self._pending if fault.kind == "corrupt_compute"]
        if corrupt:
            from msjax.ops.matmul import corrupt_matmuls  # jax only where a fault needs it

            self._record(corrupt[0], 0)
            corrupt_matmuls(CORRUPTION)  # before this process traces any program

    @classmethod
    def from_env(cls, run_dir: Path, rank: int, attempt: int) -> FaultInjector:
        slot = os.environ.get(SLOT_ENV_VAR, "")
        faults = parse_faults(os.environ.get(ENV_VAR, ""))
        return cls(faults, run_dir, rank, attempt, int(slot) if slot.isdigit() else None)

    @property
    def active(self) -> bool:
        return bool(self._pending)

    def _take(self, kind: str, step: int) -> InjectedFault | None:
        for fault in self._pending:
            if fault.kind == kind and fault.step == step:
                self._pending.remove(fault)
                self._record(fault, step)
                return fault
        return None

    def _record(self, fault: InjectedFault, step: int) -> None:
        record = {
            "fault": fault.spec,
            "kind": fault.kind,
            "step": step,
            "rank": self.rank,
            "slot": self.slot,
            "attempt": self.attempt,
            "pid": os.getpid(),
            "unix_s": time.time(),
        }
        with RunDir(self.run_dir).faults.open("a") as log:
            log.write(json.dumps(record) + "\n")
            log.flush()
            os.fsync(log.fileno())
        print(f"msjax.train: injected fault {fault.spec}", file=sys.stderr, flush=True)

    def before_step(self, step: int, wait_for_saves: Callable[[], None]) -> None:
        """Crash, fail as on a full disk, hang or slow down before step `step` runs, as
        injected."""
        now = time.perf_counter()
        for fault in self._pending:
            if fault.kind == "slow" and step > fault.step and self._last_step_at is not None:
                if not self._slow_noted:
                    self._record(fault, step)
                    self._slow_noted = True
                time.sleep((now - self._last_step_at) * fault.percent / 100)
        self._last_step_at = time.perf_counter()
        if self._take("crash", step):
            wait_for_saves()  # where the restart resumes does not depend on timing
            os._exit(CRASH_EXIT_CODE)
        if self._take("snapshot_bitflip", step):
            wait_for_saves()  # the snapshot of the step before is whole
            damage_memory_snapshots(self.run_dir, self.rank)
            os._exit(CRASH_EXIT_CODE)
        if self._take("memory_loss", step):
            wait_for_saves()  # the snapshot of the step before is whole, and so is its copy
            lose_memory_snapshots(self.run_dir, self.rank)
            os.kill(os.getpid(), signal.SIGKILL)
        if self._take("disk_full", step):
            raise OSError(errno.ENOSPC, f"No space left on device (injected before step {step})")
        if self._take("raise", step):
            raise InjectedError(f"injected error before step {step}")
        if self._take("hang", step):
            while True:  # alive, answering signals (SIGUSR1 dumps this frame), never progressing
                time.sleep(1.0)

    def loss(self, step: int, loss: float) -> float:
        """The loss as read back for step `step`, NaN if injected."""
        if self._take("nan", step):
            return float("nan")
        return loss

    def before_save(self, step: int, hold_write: Callable[[int], None]) -> None:
        """A save of step >= the fault's step fails as on a full disk, `times` saves in a row;
        the save of a crash_in_save step is held unfinished (the crash comes once it started)."""
        if any(fault.kind == "crash_in_save" and fault.step == step for fault in self._pending):
            hold_write(step)
        for fault in self._pending:
            if fault.kind == "save_error" and step >= fault.step:
                self._record(fault, step)
                self._fired[fault.spec] = self._fired.get(fault.spec, 0) + 1
                if self._fired[fault.spec] >= fault.times:
                    self._pending.remove(fault)
                raise OSError(errno.ENOSPC, "No space left on device (injected save_error)")

    def batch(self, step: int, batch: dict, vocab_size: int) -> dict:
        """Step `step`'s batch, with an out-of-range first token on this rank if injected.

        Only this process's shards change (every copy of the first one it holds, so replicas
        stay equal); nothing is computed across processes.
        """
        if not self._take("bad_token", step):
            return batch
        import jax
        import numpy as np

        inputs = batch["inputs"]
        shards = inputs.addressable_shards
        poisoned = []
        for shard in shards:
            rows = np.asarray(shard.data)
            if shard.index == shards[0].index:
                rows = rows.copy()
                rows.flat[0] = vocab_size
            poisoned.append(jax.device_put(rows, shard.device))
        placed = jax.make_array_from_single_device_arrays(inputs.shape, inputs.sharding, poisoned)
        return {**batch, "inputs": placed}

    def after_update(self, step: int, state: Any) -> Any:
        """The state after step `step`'s update, with bits flipped on this rank as injected (a
        replay of that step fires bitflip and opt_bitflip again until they have fired `times`
        times, stuck_bit always, on the same element)."""
        for fault in list(self._pending):
            if fault.step != step or fault.kind not in ("bitflip", "stuck_bit", "opt_bitflip"):
                continue
            firing = self._fired.get(fault.spec, 0)
            self._record(fault, step)
            self._fired[fault.spec] = firing + 1
            if fault.kind != "stuck_bit" and firing + 1 >= fault.times:
                self._pending.remove(fault)
            element = 0 if fault.kind == "stuck_bit" else firing
            part = "opt_state" if fault.kind == "opt_bitflip" else "params"
            state = _flip_one_bit(state, element, part)
        return state

    def after_save_started(self, step: int) -> None:
        """Exit while the asynchronous save of step `step` is being written, as injected."""
        if self._take("crash_in_save", step):
            os._exit(CRASH_EXIT_CODE)


def lose_memory_snapshots(run_dir: Path, process_index: int) -> None:
    """Delete every in-memory snapshot of this process's (its own and the copies it holds for a
    peer): a node whose memory was lost with it."""
    import shutil

    from msjax.checkpoint.snapshots import process_snapshots_dir, shared_memory_root

    root = shared_memory_root()
    if root is not None:
        shutil.rmtree(process_snapshots_dir(run_dir, root, process_index), ignore_errors=True)


def damage_memory_snapshots(run_dir: Path, process_index: int) -> None:
    """Flip one byte in the middle of the first shard file of every whole memory snapshot this
    process holds: host memory gone bad under the snapshots, found only by their sha256."""
    from msjax.checkpoint.snapshots import SnapshotStore, process_snapshots_dir, shared_memory_root

    root = shared_memory_root()
    if root is None:
        return
    store = SnapshotStore(process_snapshots_dir(run_dir, root, process_index))
    for step in store.complete_steps():
        shard = next(iter(sorted(store.path(step).glob("*.bin"))), None)
        if shard is None:
            continue
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))


def _flip_one_bit(state: Any, element: int, part: str = "params") -> Any:
    """state with a mantissa bit (BITFLIP_BIT) of one element of the first floating tensor of
    state.<part> flipped in its first local block on that device: the block is rebuilt there,
    every other one kept."""
    import dataclasses

    import jax
    import numpy as np

    leaves, treedef = jax.tree.flatten(getattr(state, part))
    first = next(
        index
        for index, leaf in enumerate(leaves)
        if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating) and leaf.size
    )
    array = leaves[first]
    shards = array.addressable_shards
    block = np.array(shards[0].data)  # [block shape] of the first local device
    unsigned = np.dtype(f"uint{8 * block.dtype.itemsize}")
    words = block.reshape(-1).view(unsigned)  # the parameter's bits
    words[element % words.size] ^= unsigned.type(1 << BITFLIP_BIT[block.dtype.itemsize])
    blocks = [jax.device_put(block, shards[0].device), *(shard.data for shard in shards[1:])]
    leaves[first] = jax.make_array_from_single_device_arrays(array.shape, array.sharding, blocks)
    return dataclasses.replace(state, **{part: jax.tree.unflatten(treedef, leaves)})
