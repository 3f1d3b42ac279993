"""The run's scalars as TensorBoard event files in RUN_DIR/tensorboard (`observe.tensorboard`).

A listener of the loop on process 0, beside `metrics.jsonl` (which stays the record): every
step's loss, grad norm, learning rate, step time, tokens/s, MFU and data wait, each evaluation's
loss and each save's pause, at metrics.jsonl's step numbers. Written with the `tensorboard`
package's own event writer: no TensorFlow.
"""

from __future__ import annotations

import time
from pathlib import Path

from msjax.errors import MsjaxError
from msjax.loop_events import LoopEvents, StepRecord

STEP_SCALARS = ("loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "mfu", "data_wait_s")
INSTALL_HINT = "pip install 'msjax[tensorboard]' (or tensorboard)"


def check_tensorboard_installed() -> None:
    """MsjaxError naming the package when observe.tensorboard=true cannot be honoured."""
    try:
        import tensorboard.summary.writer.event_file_writer  # noqa: F401
    except ImportError:
        raise MsjaxError(
            f"observe.tensorboard=true needs the tensorboard package; {INSTALL_HINT}"
        ) from None


class TensorBoardLog(LoopEvents):
    """Scalars of every step, evaluation and save as TensorBoard events."""

    def __init__(self, directory: Path):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        directory.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(directory))

    def _write(self, step: int, scalars: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
        self._writer.add_event(
            Event(wall_time=time.time(), step=step, summary=Summary(value=values))
        )

    def step_end(self, record: StepRecord) -> None:
        self._write(record["step"], {key: record[key] for key in STEP_SCALARS})

    def eval_end(self, step: int, loss: float) -> None:
        self._write(step, {"eval_loss": loss})

    def save_end(self, step: int, blocked_s: float | None) -> None:
        if blocked_s is not None:
            self._write(step, {"checkpoint_save_blocked_s": blocked_s})

    def run_end(self, final_step: int) -> None:
        self._writer.close()

    def run_failed(self) -> None:
        self._writer.close()
