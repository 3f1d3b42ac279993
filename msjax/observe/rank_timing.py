"""Per-rank step timing: every rank's own work per step, without the time it waits for others.

Every rank in a synchronous job finishes each step together (the collectives wait for the
slowest), so per-rank step times all look alike. Each rank therefore splits its loop's time:
waiting for the step's result (others' fault as much as its own) is set apart, and what remains is
its own work -- waiting for its batch, other host work (dispatch, logging, anything injected), and
stalls (a thread that notices when the process did not run: SIGSTOP, an overloaded core). Records
go to process 0 through JAX's coordination service (host-side only: nothing enters the device
queue) and into RUN_DIR/ranks.jsonl, where stragglers are scored window by window.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from msjax.config import ObserveConfig
from msjax.observe.stragglers import StragglerDetector
from msjax.run_dir import RunDir
from msjax.writable import AppendLog

KEY_PREFIX = "msjax/rank_timing"
_FIELDS = ("work_s", "data_wait_s", "stall_s", "result_wait_s", "step_time_s")


class StallSampler:
    """A daemon thread that sleeps in short ticks and adds up how late it wakes: time in which
    the process (or at least this thread) could not run."""

    def __init__(self, tick_s: float = 0.01, tolerance_s: float = 0.005):
        self.tick_s = tick_s
        self.tolerance_s = tolerance_s
        self._lost_s = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="msjax-stall-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            before = time.monotonic()
            time.sleep(self.tick_s)
            late_s = time.monotonic() - before - self.tick_s
            if late_s > self.tolerance_s:
                with self._lock:
                    self._lost_s += late_s

    def take(self) -> float:
        """Seconds lost since the last take."""
        with self._lock:
            lost, self._lost_s = self._lost_s, 0.0
        return lost

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


def mesh_coordinates(mesh: Any, process_index: int) -> dict[str, list[int]]:
    """The indices along each mesh axis that this process's devices occupy."""
    coordinates: dict[str, set[int]] = {name: set() for name in mesh.axis_names}
    for index in np.ndindex(mesh.devices.shape):
        if mesh.devices[index].process_index == process_index:
            for name, position in zip(mesh.axis_names, index, strict=True):
                coordinates[name].add(int(position))
    if mesh.shape.get("expert", 0) == 1:  # named as a mesh without expert parallelism always was
        del coordinates["expert"]
    return {name: sorted(positions) for name, positions in coordinates.items()}


def describe_place(mesh: dict[str, list[int]]) -> str:
    """`data 0, fsdp 0, pipe 1, tensor 0-1`: a rank's mesh coordinates for people; a rank on
    one pipe index is named by its pipeline stage, so a slow or stuck stage is seen as one."""
    parts = []
    for axis, positions in mesh.items():
        at = _span(positions)
        if axis == "pipe" and len(positions) == 1 and len(mesh) > 1:
            parts.append(f"pipeline stage {at}")
        else:
            parts.append(f"{axis} {at}")
    return ", ".join(parts)


def _span(positions: list[int]) -> str:
    if (
        positions
        and positions == list(range(positions[0], positions[-1] + 1))
        and len(positions) > 1
    ):
        return f"{positions[0]}-{positions[-1]}"
    return ",".join(map(str, positions))


def _coordination_client() -> Any:
    """JAX's coordination-service client in a multi-process job, else None."""
    from jax._src import distributed

    return distributed.global_state.client


class RankTiming:
    """The loop's per-rank clock. Call step_begin, data_ready and (from the result fetch)
    result_waited for each step; every window of steps is published and, on process 0,
    gathered, written to ranks.jsonl and scored for stragglers."""

    def __init__(
        self,
        config: ObserveConfig,
        run_dir: Path,
        mesh: Any,
        coordinates: dict[str, list[int]],
        process_index: int,
        process_count: int,
        attempt: int,
        message: Callable[[str], None],
    ):
        """coordinates: this process's place in the mesh (mesh_coordinates)."""
        self.window_steps = config.straggler_window_steps
        self.rank = process_index
        self.ranks = process_count
        self.attempt = attempt
        self._message = message
        self._client = _coordination_client() if process_count > 1 else None
        self._local: dict[str, Any] = {}  # one process: the "service" is this dict
        self._sampler = StallSampler()
        self._records: list[dict[str, Any]] = []
        self._window = 0
        self._pending_windows: list[int] = []
        self._current: dict[str, Any] | None = None
        self._identity = {
            "rank": process_index,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "devices": int(sum(d.process_index == process_index for d in mesh.devices.flat)),
            "mesh": coordinates,
        }
        self._publish("identity", self._identity)
        self._writer = None
        if process_index == 0:
            self._detector = StragglerDetector(
                config.straggler_min_excess, config.straggler_min_score, config.straggler_windows
            )
            self._writer = AppendLog(RunDir(run_dir).ranks)  # a full disk drops records
            self._identities: list[dict[str, Any]] | None = None

    # ---- the loop's calls ---------------------------------------------------------------------

    def step_begin(self, step: int) -> None:
        """The top of the loop for `step`: closes the previous step's record."""
        now = time.perf_counter()
        if self._current is not None:
            self._close_step(now)
        self._sampler.take()  # stalls before this step belong to no step
        self._current = {"step": step, "began": now, "data_wait_s": 0.0, "result_wait_s": 0.0}

    def data_ready(self, data_wait_s: float) -> None:
        if self._current is not None:
            self._current["data_wait_s"] += data_wait_s

    def result_waited(self, seconds: float) -> None:
        """Time blocked fetching a step's result: waiting for every rank, not own work."""
        if self._current is not None:
            self._current["result_wait_s"] += seconds

    def close(self) -> None:
        """Publish what is left, gather it on process 0 (waiting briefly for late ranks)."""
        if self._current is not None:
            self._close_step(time.perf_counter())
            self._current = None
        if self._records:
            self._publish_window()
        if self._writer is not None:
            self._gather_pending(wait_s=10.0)
            self._writer.close()
        self._sampler.close()

    # ---- per rank ------------------------------------------------------------------------------

    def _close_step(self, now: float) -> None:
        current = self._current
        step_time_s = now - current["began"]
        stall_s = min(self._sampler.take(), step_time_s)  # a late tick may span two steps
        host_s = max(step_time_s - current["result_wait_s"] - current["data_wait_s"], 0.0)
        self._records.append(
            {
                "step": current["step"],
                "work_s": current["data_wait_s"] + host_s + stall_s,
                "data_wait_s": current["data_wait_s"],
                "stall_s": stall_s,
                "result_wait_s": current["result_wait_s"],
                "step_time_s": step_time_s,
            }
        )
        if len(self._records) >= self.window_steps:
            self._publish_window()

    def _publish_window(self) -> None:
        self._publish(f"window/{self._window}", self._records)
        if self._writer is not None:
            self._pending_windows.append(self._window)
            self._gather_pending(wait_s=0.0)
        self._records = []
        self._window += 1

    def _key(self, name: str, rank: int) -> str:
        return f"{KEY_PREFIX}/{self.attempt}/{name}/{rank}"

    def _publish(self, name: str, value: Any) -> None:
        if self._client is None:
            self._local[name] = value
        else:
            self._client.key_value_set(self._key(name, self.rank), json.dumps(value))

    def _fetch(self, name: str, rank: int, wait_s: float) -> Any | None:
        """Rank `rank`'s value of `name`, or None if it has not arrived (within wait_s)."""
        if self._client is None:
            return self._local.get(name)
        key = self._key(name, rank)
        try:
            if wait_s > 0:
                text = self._client.blocking_key_value_get(key, int(wait_s * 1000))
            else:
                text = self._client.key_value_try_get(key)
        except Exception:  # not there yet: the coordination service reports it as an error
            return None
        return json.loads(text)

    # ---- process 0 -----------------------------------------------------------------------------

    def _gather_pending(self, wait_s: float) -> None:
        if self._identities is None:
            identities = [self._fetch("identity", rank, wait_s) for rank in range(self.ranks)]
            if any(identity is None for identity in identities):
                return
            self._identities = identities
            self._write({"event": "ranks", "attempt": self.attempt, "ranks": identities})
        while self._pending_windows:
            window = self._pending_windows[0]
            name = f"window/{window}"
            per_rank = [self._fetch(name, rank, wait_s) for rank in range(self.ranks)]
            if any(records is None for records in per_rank):
                return  # a rank is behind; its window arrives with a later one
            self._pending_windows.pop(0)
            self._forget(name)
            self._take_window(per_rank)

    def _forget(self, name: str) -> None:
        if self._client is None:
            self._local.pop(name, None)
            return
        for rank in range(self.ranks):
            with contextlib.suppress(Exception):  # already gone: nothing to free
                self._client.key_value_delete(self._key(name, rank))

    def _take_window(self, per_rank: list[list[dict[str, Any]]]) -> None:
        steps = sorted(set.intersection(*({r["step"] for r in records} for records in per_rank)))
        if not steps:
            return
        by_rank = [{r["step"]: r for r in records} for records in per_rank]
        table = {
            field: np.array([[rank[step][field] for step in steps] for rank in by_rank])
            for field in _FIELDS
        }  # each [ranks, steps]
        for column, step in enumerate(steps):
            self._write({"step": step, **{f: table[f][:, column].tolist() for f in _FIELDS}})
        parts = {
            "data": table["data_wait_s"],
            "stalled": table["stall_s"],
            "host": table["work_s"] - table["data_wait_s"] - table["stall_s"],
        }
        for event in self._detector.update(steps, parts, table["step_time_s"]):
            identity = self._identities[event.rank]
            record = {
                "step": event.last_step,
                "event": "straggler",
                "rank": event.rank,
                "host": identity["host"],
                "mesh": identity["mesh"],
                "phase": event.phase,
                "excess_s": event.excess_s,
                "score": event.score,
                "window": [event.first_step, event.last_step],
            }
            self._write(record)
            place = describe_place(record["mesh"])
            self._message(
                f"straggler: rank {event.rank} on {identity['host']} ({place}) is "
                f"{event.excess_s * 1e3:.0f} ms a step slower in its own work ({event.phase}) "
                f"over steps {event.first_step}-{event.last_step}"
            )

    def _write(self, record: dict[str, Any]) -> None:
        self._writer.write(json.dumps(record) + "\n")
