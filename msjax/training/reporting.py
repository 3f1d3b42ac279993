"""A step's metrics read back and timed, and the two listeners that report them: the
`metrics.jsonl` record (process 0) and the progress line."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msjax.loop_events import LoopEvents, StepRecord
from msjax.observe.flops import mfu
from msjax.observe.metrics import MetricsWriter, ProgressLine


@dataclass(frozen=True)
class InFlight:
    """A dispatched step whose metrics are still on the devices."""

    step: int
    device_metrics: Any
    data_wait_s: float


class StepResults:
    """Reads each step's metrics after the next step is dispatched, so the host never stalls
    the devices to log, and times steps from one result to the next."""

    def __init__(
        self,
        events: LoopEvents,
        tokens_per_step: int,
        step_flops: float,
        device_count: int,
        peak_tflops: float,
        loss_as_read: Any,
    ):
        self.events = events
        self.tokens_per_step = tokens_per_step
        self.step_flops = step_flops
        self.device_count = device_count
        self.peak_tflops = peak_tflops
        self.loss_as_read = loss_as_read  # (step, loss) -> loss: where a `nan` fault strikes
        self.last: StepRecord = {}
        self._last_done = time.perf_counter()
        self._last_minor_faults = _minor_faults()

    def restart_clock(self) -> None:
        """Work between steps (evaluation, a save's pause) is not the next step's time."""
        self._last_done = time.perf_counter()
        self._last_minor_faults = _minor_faults()

    def finish(self, in_flight: InFlight | None) -> None:
        """Read the step's metrics back, time it, and report it to every listener."""
        if in_flight is None:
            return
        import jax

        fetch_started = time.perf_counter()
        values = jax.device_get(in_flight.device_metrics)
        done = time.perf_counter()
        self.events.result_fetched(in_flight.step, done - fetch_started)
        step_time_s = done - self._last_done
        self._last_done = done
        minor_faults = _minor_faults()
        minor_faults_per_step, self._last_minor_faults = (
            minor_faults - self._last_minor_faults,
            minor_faults,
        )
        self.last = {
            "step": in_flight.step,
            "loss": self.loss_as_read(in_flight.step, float(values["loss"])),
            "grad_norm": float(values["grad_norm"]),
            "lr": float(values["lr"]),
            "step_time_s": step_time_s,
            "tokens_per_s": self.tokens_per_step / step_time_s,
            "mfu": mfu(self.step_flops, step_time_s, self.device_count, self.peak_tflops),
            "data_wait_s": in_flight.data_wait_s,
            # a step's temp buffer re-faulted page by page shows here (msjax.allocator)
            "minor_faults": minor_faults_per_step,
        }
        for key, value in values.items():  # a mixture of experts' load and auxiliary losses
            if key.startswith("moe_"):
                self.last[key] = value.tolist()
        if not values.get("update_finite", True):  # the step kept the state as it was
            self.last["update_finite"] = False
        self.events.step_end(self.last)


def _minor_faults() -> int:
    """This process's minor page faults so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class MetricsLog(LoopEvents):
    """RUN_DIR/metrics.jsonl: one record per step, eval, skip, save and resume."""

    def __init__(self, path: Path):
        self.writer = MetricsWriter(path)

    def run_start(self, start_step: int, restored_from: Path | None) -> None:
        if restored_from is not None:
            self.writer.write(
                {"step": start_step, "event": "resume", "checkpoint": str(restored_from)}
            )

    def step_end(self, record: StepRecord) -> None:
        self.writer.write(record)

    def step_skipped(self, step: int) -> None:
        self.writer.write({"step": step, "event": "skipped", "reason": "non-finite loss"})

    def eval_end(self, step: int, loss: float) -> None:
        self.writer.write({"step": step, "eval_loss": loss})

    def save_end(self, step: int, blocked_s: float | None) -> None:
        if blocked_s is not None:
            self.writer.write({"step": step, "checkpoint_save_blocked_s": blocked_s})

    def memory_snapshot(
        self, step: int, stall_s: float, snapshot_bytes: int, skipped_total: int
    ) -> None:
        self.writer.write(
            {
                "step": step,
                "memory_snapshot_stall_s": stall_s,
                "memory_snapshot_bytes": snapshot_bytes,
                "memory_snapshots_skipped": skipped_total,
            }
        )

    def run_end(self, final_step: int) -> None:
        self.writer.close()


class ProgressReport(LoopEvents):
    """The live progress line and the eval results on the terminal."""

    def __init__(self, progress: ProgressLine):
        self.progress = progress

    def run_start(self, start_step: int, restored_from: Path | None) -> None:
        self.progress.start_step = start_step
        self.progress.started = time.perf_counter()

    def step_end(self, record: StepRecord) -> None:
        self.progress.update(record)

    def eval_end(self, step: int, loss: float) -> None:
        self.progress.message(f"step {step + 1}: eval loss {loss:.4f}")
