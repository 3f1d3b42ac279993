"""The listeners that observe each rank's loop: per-rank timing (rank_timing.py) and the flight
recorder (flight_recorder.py) as one listener (`LoopObserver`), and JAX profiler traces of chosen
steps (`ProfileCapture`, `observe.profile_steps=[first, last]`).

Each rank writes its own trace into RUN_DIR/profiles/rank<r>/ (TensorBoard's profile plugin or
Perfetto read it). The trace starts at the top of step `first` and stops once step `last`'s
result is read back, so it covers the steps' device work.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from msjax.config import ObserveConfig
from msjax.loop_events import LoopEvents, StepRecord
from msjax.observe.flight_recorder import FlightRecorder
from msjax.observe.rank_timing import RankTiming, mesh_coordinates


class LoopObserver(LoopEvents):
    """Per-rank timing and flight recording for one process's loop; each may be off by config.

    A loop that fails records `failed` and dumps the flight record; a normal end closes it after
    the last save.
    """

    def __init__(
        self,
        observe: ObserveConfig,
        run_dir: Path,
        mesh: Any,
        attempt: int,
        message: Callable[[str], None],
    ):
        import jax

        rank = jax.process_index()
        coordinates = mesh_coordinates(mesh, rank)  # where the timing and the records place it
        self.timing = None
        if observe.rank_timing:
            self.timing = RankTiming(
                observe, run_dir, mesh, coordinates, rank, jax.process_count(), attempt, message
            )
        self.recorder = None
        if observe.flight_recorder_events:
            self.recorder = FlightRecorder(
                run_dir, rank, attempt, observe.flight_recorder_events, coordinates
            )
        self._closed = False

    def compiled(self, compiled_step: Any) -> None:
        """Ranks that compiled different programs hang at their first collective: record which."""
        if self.recorder is not None:
            text = compiled_step.as_text() or ""
            fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
            self.recorder.record("compiled", fingerprint=fingerprint)

    def record(self, event: str, step: int | None = None, **fields: Any) -> None:
        if self.recorder is not None:
            self.recorder.record(event, step, **fields)

    def step_begin(self, step: int) -> None:
        if self.timing is not None:
            self.timing.step_begin(step)
        self.record("step_begin", step)

    def batch_ready(self, step: int, data_wait_s: float) -> None:
        if self.timing is not None:
            self.timing.data_ready(data_wait_s)

    def step_dispatched(self, step: int) -> None:
        self.record("step_dispatched", step)

    def result_fetched(self, step: int, waited_s: float) -> None:
        """The result of `step` arrived after waiting waited_s (for every rank's share of it)."""
        if self.timing is not None:
            self.timing.result_waited(waited_s)
        self.record("step_end", step)

    def eval_begin(self, step: int) -> None:
        self.record("eval_begin", step)

    def eval_end(self, step: int, loss: float) -> None:
        self.record("eval_end", step)

    def save_begin(self, step: int) -> None:
        self.record("checkpoint_begin", step)

    def save_end(self, step: int, blocked_s: float | None) -> None:
        self.record("checkpoint_end", step)

    def run_end(self, final_step: int) -> None:
        self.close(final_step)

    def run_failed(self) -> None:
        self.close(event="failed")

    def close(self, final_step: int | None = None, event: str = "finished") -> None:
        if self._closed:
            return
        self._closed = True
        if self.recorder is not None:
            self.recorder.close(event, final_step)
        if self.timing is not None:
            self.timing.close()


class ProfileCapture(LoopEvents):
    """Starts and stops the JAX profiler around a range of steps."""

    def __init__(self, directory: Path, first: int, last: int):
        self.directory = directory
        self.first, self.last = first, last
        self.tracing = False

    def step_begin(self, step: int) -> None:
        if step == self.first and not self.tracing:
            import jax

            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.tracing = True

    def step_end(self, record: StepRecord) -> None:
        if record["step"] >= self.last:
            self._stop()

    def step_skipped(self, step: int) -> None:
        if step >= self.last:
            self._stop()

    def run_end(self, final_step: int) -> None:
        self._stop()  # the run ended (or resumed past `first`) before `last`

    def run_failed(self) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.tracing:
            import jax

            jax.profiler.stop_trace()
            self.tracing = False
