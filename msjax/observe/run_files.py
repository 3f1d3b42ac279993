"""A run directory read back: its config, metrics, goodput, incidents and per-rank timing.

`load_run` reads files only and never runs anything on devices. A line cut short by a killed
writer is counted, not fatal; a missing or unreadable required file is one MsjaxError.
"""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from msjax.errors import MsjaxError
from msjax.observe.plots import HeatMap, RankRow
from msjax.run_dir import RunDir
from msjax.writable import read_no_follow

WARMUP_STEPS = 2  # each attempt's first steps compile and fill caches: kept out of medians


@dataclass
class RankTimes:
    """RUN_DIR/ranks.jsonl: who the ranks are, their per-step times, the stragglers flagged."""

    rows: list[RankRow]  # as the newest header describes them
    attempts: int
    work_by_step: dict[int, list[float | None]]  # the last record of each step wins
    warmup_steps: set[int]
    stragglers: list[dict[str, Any]]

    def heatmap(self) -> HeatMap | None:
        if not self.rows or not self.work_by_step:
            return None
        flagged = {event["rank"] for event in self.stragglers if "rank" in event}
        return HeatMap.build(self.rows, self.work_by_step, self.warmup_steps, flagged)


@dataclass
class Run:
    """Everything the report reads from one run directory."""

    path: Path
    name: str
    total_steps: int | None
    records: list[dict[str, Any]]  # metrics.jsonl, in order
    steps: dict[int, dict[str, Any]]  # step -> its last training record
    warmup_steps: set[int]  # kept steps among the first WARMUP_STEPS of their attempt
    attempt_starts: list[int]  # first step of each attempt
    eval_loss: dict[int, float]
    skipped: list[int]
    goodput: dict[str, Any] | None
    incidents: list[dict[str, Any]]
    ranks: RankTimes | None
    launches: list[dict[str, Any]] = field(default_factory=list)  # launcher sessions, oldest first
    checkpoint: dict[str, Any] = field(default_factory=dict)  # the resolved config's checkpoint
    unreadable_lines: dict[str, int] = field(default_factory=dict)


def _read_text(path: Path) -> str:
    """A run dir file's text, read without following a symbolic link (msjax never does)."""
    try:
        return read_no_follow(path).decode()
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise MsjaxError(f"cannot read {path}: it is a symbolic link") from None
        raise MsjaxError(f"cannot read {path}: {error}") from None
    except UnicodeDecodeError as error:
        raise MsjaxError(f"cannot read {path}: {error}") from None


def _read_jsonl(
    path: Path, unreadable: dict[str, int], required: str | None = None
) -> list[dict[str, Any]]:
    """The JSON objects (with the `required` key) of a .jsonl file; any other line, such as one
    cut short by a killed writer, is counted, not fatal."""
    records, bad = [], 0
    for line in _read_text(path).splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(record, dict) and (required is None or required in record):
            records.append(record)
        else:
            bad += 1
    if bad:
        unreadable[path.name] = bad
    return records


def _read_config(files: RunDir) -> dict[str, Any]:
    """The resolved config the run saved (YAML, else JSON); {} if it saved none."""
    for path, parse, form in (
        (files.config_yaml, yaml.safe_load, "YAML"),
        (files.config_json, json.loads, "JSON"),
    ):
        if path.exists():
            try:
                config = parse(_read_text(path))
            except (yaml.YAMLError, ValueError) as error:
                raise MsjaxError(f"{path} is not valid {form}: {error}") from None
            return config if isinstance(config, dict) else {}
    return {}


def is_step(record: dict[str, Any]) -> bool:
    return "loss" in record and "step_time_s" in record


def load_run(run_dir: Path) -> Run:
    """Read a run directory; MsjaxError if it is not one or a file in it cannot be read."""
    if not run_dir.is_dir():
        raise MsjaxError(f"{run_dir} is not a directory; give a run directory (run.dir)")
    files = RunDir(run_dir)
    if not files.metrics.is_file():
        raise MsjaxError(f"{run_dir} has no {files.metrics.name}; is it a run directory (run.dir)?")
    unreadable: dict[str, int] = {}
    records = _read_jsonl(files.metrics, unreadable, required="step")
    config = _read_config(files)
    run_section = config.get("run") or {}
    train_section = config.get("train") or {}

    trained = _training_steps(records)
    goodput = None
    if files.goodput.exists():
        try:
            goodput = json.loads(_read_text(files.goodput))
        except ValueError as error:
            raise MsjaxError(f"{files.goodput} is not valid JSON: {error}") from None
    incidents = []
    if files.incidents_log.exists():
        incidents = _read_jsonl(files.incidents_log, unreadable)
    launches = []
    if files.launches.exists():
        # a launch's last record is its own (one is written on a stop request, one at the end)
        by_number = {
            record.get("launch"): record
            for record in _read_jsonl(files.launches, unreadable, required="started_unix_s")
        }
        launches = list(by_number.values())
    ranks = None
    if files.ranks.exists():
        ranks = _read_ranks(_read_jsonl(files.ranks, unreadable))
    return Run(
        path=run_dir,
        name=str(run_section.get("name") or run_dir.name),
        total_steps=train_section.get("steps"),
        records=records,
        steps=trained.steps,
        warmup_steps=trained.warmup_steps,
        attempt_starts=trained.attempt_starts,
        eval_loss=trained.eval_loss,
        skipped=trained.skipped,
        goodput=goodput,
        incidents=incidents,
        ranks=ranks,
        launches=launches,
        checkpoint=config.get("checkpoint") or {},
        unreadable_lines=unreadable,
    )


@dataclass(frozen=True)
class _TrainingSteps:
    """What the metrics records say of the training steps (the fields of Run of the same names)."""

    steps: dict[int, dict[str, Any]]
    warmup_steps: set[int]
    attempt_starts: list[int]
    eval_loss: dict[int, float]
    skipped: list[int]


def _training_steps(records: list[dict[str, Any]]) -> _TrainingSteps:
    """The kept steps, each attempt's warm-up and first step, eval losses and skipped steps."""
    # An attempt starts at a resume record, or where a step number goes back (a restart
    # without a checkpoint); its first steps are warm-up.
    steps: dict[int, dict[str, Any]] = {}
    warm_index: dict[int, bool] = {}
    attempt_starts: list[int] = []
    in_attempt, previous_step = WARMUP_STEPS, None
    eval_loss: dict[int, float] = {}
    skipped: set[int] = set()
    for record in records:
        if record.get("event") == "resume":
            in_attempt = None
        elif record.get("event") == "skipped":
            skipped.add(record["step"])
        elif "eval_loss" in record:
            eval_loss[record["step"]] = record["eval_loss"]
        elif is_step(record):
            step = record["step"]
            if in_attempt is None or previous_step is None or step <= previous_step:
                attempt_starts.append(step)
                in_attempt = 0
            steps[step] = record
            warm_index[step] = in_attempt < WARMUP_STEPS
            in_attempt, previous_step = in_attempt + 1, step
    return _TrainingSteps(
        steps=dict(sorted(steps.items())),
        warmup_steps={step for step, warm in warm_index.items() if warm},
        attempt_starts=attempt_starts,
        eval_loss=dict(sorted(eval_loss.items())),
        skipped=sorted(skipped - set(steps)),
    )


def _read_ranks(records: list[dict[str, Any]]) -> RankTimes:
    rows: list[RankRow] = []
    attempts = 0
    work_by_step: dict[int, list[float | None]] = {}
    warmup: dict[int, bool] = {}
    since_header = 0
    stragglers = []
    for record in records:
        if record.get("event") == "ranks":
            attempts += 1
            since_header = 0
            rows = [
                RankRow(int(r["rank"]), str(r.get("host", "?")), dict(r.get("mesh") or {}))
                for r in record.get("ranks", [])
                if "rank" in r
            ]
        elif record.get("event") == "straggler":
            stragglers.append(record)
        elif "step" in record and isinstance(record.get("work_s"), list):
            work_by_step[record["step"]] = record["work_s"]
            warmup[record["step"]] = since_header < WARMUP_STEPS
            since_header += 1
    if not rows and work_by_step:  # no header survived: number the ranks as the records do
        count = max(len(values) for values in work_by_step.values())
        rows = [RankRow(rank, "?", {}) for rank in range(count)]
    return RankTimes(
        rows,
        attempts,
        dict(sorted(work_by_step.items())),
        {step for step, warm in warmup.items() if warm},
        stragglers,
    )
