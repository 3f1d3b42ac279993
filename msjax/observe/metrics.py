"""Per-step records in `RUN_DIR/metrics.jsonl` and the live progress line on the terminal."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import IO, Any

from msjax.writable import AppendLog


class MetricsWriter:
    """Appends one JSON object per line, each whole or not at all, so a crash loses at most one
    record; a full disk drops records with one warning (msjax.writable.AppendLog)."""

    def __init__(self, path: Path):
        self.path = path
        self._file = AppendLog(path)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(_plain(record), allow_nan=True) + "\n")

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file, in order."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class ProgressLine:
    """A compact live line on a terminal; elsewhere (CI, files) one line every few seconds."""

    def __init__(
        self,
        total_steps: int,
        stream: IO[str] | None = None,
        every_s: float = 10.0,
        start_step: int = 0,
    ):
        self.total_steps = total_steps
        self.start_step = start_step
        self.stream = stream if stream is not None else sys.stdout
        self.live = self.stream.isatty()
        self.every_s = every_s
        self.started = time.perf_counter()
        self._last_print = -math.inf
        self._open_line = False

    def update(self, record: dict[str, Any]) -> None:
        step = record["step"] + 1
        elapsed = time.perf_counter() - self.started
        done = step - self.start_step
        eta_s = elapsed / done * (self.total_steps - step) if done > 0 else 0.0
        text = (
            f"step {step}/{self.total_steps}  loss {record['loss']:.3f}  "
            f"{record['tokens_per_s']:,.0f} tok/s  mfu {100 * record['mfu']:.1f}%  "
            f"eta {_clock(eta_s)}"
        )
        now = time.perf_counter()
        if self.live:
            self.stream.write("\r\033[K" + text)
            self._open_line = True
        elif now - self._last_print >= self.every_s or step == self.total_steps:
            self.stream.write(text + "\n")
            self._last_print = now
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (eval results, notices) that does not break the live line."""
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False
        self.stream.flush()


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _plain(record: dict[str, Any]) -> dict[str, Any]:
    """Numbers as Python floats/ints so json can write them."""
    plain = {}
    for key, value in record.items():
        if hasattr(value, "item"):
            value = value.item()
        plain[key] = value
    return plain
