"""Checkpoints under SIGKILL mid-save: a real `python -m msjax.train` process saving every step,
killed twice, resumes from the newest committed step and finishes."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from checkpoint_fault_helpers import (
    COMMIT_MARKER,
    SAVE_EVERY_STEP,
    SMALL_RUN,
    TMP_MARKER,
    committed_on_disk,
    steps_after_last_resume,
    unfinished_on_disk,
)
from checkpoint_fault_helpers import start_run as start_run  # a fixture, re-exported for pytest

from msjax.observe.metrics import read_metrics

pytestmark = pytest.mark.slow

# --- SIGKILL during an asynchronous save --------------------------------------------------------


@dataclass(frozen=True)
class KilledRound:
    """What one SIGKILL left on disk, and what the next run of the command printed."""

    newest_committed: int
    unfinished: list[str]
    next_output: str


@dataclass(frozen=True)
class KilledRuns:
    checkpoints: Path
    rounds: list[KilledRound]
    final_exit_code: int
    final_steps: int
    records: list[dict[str, Any]]


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory: pytest.TempPathFactory, start_run) -> KilledRuns:
    """A run saving every step, SIGKILLed twice: once while a save is being written (an Orbax
    tmp dir already holds _CHECKPOINT_METADATA), once just after a save was finalized; then
    run to the end."""
    run_dir = tmp_path_factory.mktemp("sigkill") / "run"
    checkpoints = run_dir / "checkpoints"
    overrides = [*SMALL_RUN, *SAVE_EVERY_STEP]

    def newest() -> int:
        return max(committed_on_disk(checkpoints), default=-1)

    def save_under_way() -> bool:
        # Orbax writes _CHECKPOINT_METADATA into its tmp dir first, then the arrays, then renames
        return any(
            TMP_MARKER in entry.name and (entry / COMMIT_MARKER).exists()
            for entry in checkpoints.iterdir()
        )

    run = start_run(run_dir, overrides)
    run.wait_for(lambda: newest() >= 4 and save_under_way(), "4 saves and one under way")
    run.stop(signal.SIGKILL)
    after_kill = [(newest(), unfinished_on_disk(checkpoints))]

    run = start_run(run_dir, overrides)
    resumed_at = after_kill[0][0]
    run.wait_for(lambda: newest() >= resumed_at + 2, "2 saves after resuming")
    run.stop(signal.SIGKILL)
    outputs = [run.output]
    after_kill.append((newest(), unfinished_on_disk(checkpoints)))

    final_steps = after_kill[1][0] + 2
    run = start_run(run_dir, [*overrides, f"train.steps={final_steps}"])
    final_exit_code = run.finish().exit_code
    outputs.append(run.output)
    return KilledRuns(
        checkpoints=checkpoints,
        rounds=[
            KilledRound(step, unfinished, output)
            for (step, unfinished), output in zip(after_kill, outputs, strict=True)
        ],
        final_exit_code=final_exit_code,
        final_steps=final_steps,
        records=read_metrics(run_dir / "metrics.jsonl"),
    )


def test_rerun_after_sigkill_resumes_from_the_newest_committed_step(killed_runs):
    assert killed_runs.rounds[0].newest_committed >= 4
    for round_ in killed_runs.rounds:
        step = round_.newest_committed
        checkpoint = killed_runs.checkpoints / str(step)
        assert f"resumed from {checkpoint} (step {step})" in round_.next_output


def test_rerun_after_sigkill_mid_save_warns_about_each_unfinished_step(killed_runs):
    # the first kill waited for a save in flight, so it almost surely left one behind
    assert any(round_.unfinished for round_ in killed_runs.rounds)
    for round_ in killed_runs.rounds:
        for name in round_.unfinished:
            assert f"skipped checkpoint {killed_runs.checkpoints / name}" in round_.next_output, (
                f"{name} was left unfinished by SIGKILL, but the rerun did not say it skipped "
                f"it:\n{round_.next_output}"
            )


def test_run_killed_twice_mid_save_still_finishes_with_every_step_trained_and_saved(killed_runs):
    runs = killed_runs
    output = runs.rounds[-1].next_output
    assert runs.final_exit_code == 0, output
    assert "checkpoint save at step" not in output
    assert runs.final_steps in committed_on_disk(runs.checkpoints)
    resumed_from = runs.rounds[-1].newest_committed
    final_part = [record["step"] for record in steps_after_last_resume(runs.records)]
    assert final_part == list(range(resumed_from, runs.final_steps))
