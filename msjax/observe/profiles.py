"""JAX profiler traces of chosen steps on every rank (`observe.profile_steps=[first, last]`).

Each rank writes its own trace into RUN_DIR/profiles/rank<r>/ (TensorBoard's profile plugin or
Perfetto read it). The trace starts at the top of step `first` and stops once step `last`'s
result is read back, so it covers the steps' device work.
"""

from __future__ import annotations

from pathlib import Path

from msjax.loop_events import LoopEvents, StepRecord


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
