"""TensorBoard events hold what metrics.jsonl holds; profiler traces cover the chosen steps."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from small_runs import QUICK_RUN
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from msjax.config import load_config
from msjax.observe.metrics import read_metrics
from msjax.observe.tensorboard import STEP_SCALARS
from msjax.report import main as report_main
from msjax.train import main as train_main
from msjax.train import train

RUN = [
    *QUICK_RUN,
    "train.steps=6",
    "train.eval_every=3",
    "train.eval_batches=1",
    "checkpoint.every_steps=3",
    "observe.tensorboard=true",
    "observe.profile_steps=[2, 3]",
]


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "observed"
    train(load_config(None, [*RUN, f"run.dir={run_dir}"]), io.StringIO())
    return run_dir


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {
        tag: {event.step: event.value for event in events.Scalars(tag)}
        for tag in events.Tags()["scalars"]
    }


def test_tensorboard_events_hold_the_values_of_metrics_jsonl(observed_run: Path):
    records = read_metrics(observed_run / "metrics.jsonl")
    written = scalars(observed_run)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(6))
    for key in STEP_SCALARS:
        expected = {r["step"]: np.float32(r[key]) for r in steps}  # events hold float32
        assert written[key] == expected, key
    evals = {r["step"]: np.float32(r["eval_loss"]) for r in records if "eval_loss" in r}
    assert written["eval_loss"] == evals and sorted(evals) == [2, 5]
    pause = "checkpoint_save_blocked_s"
    saves = {r["step"]: np.float32(r[pause]) for r in records if pause in r}
    assert written[pause] == saves and sorted(saves) == [3, 6]


def test_a_profile_of_the_chosen_steps_is_written_and_the_report_lists_it(observed_run, capsys):
    trace_files = [p for p in (observed_run / "profiles" / "rank0").rglob("*") if p.is_file()]
    assert trace_files and all(p.stat().st_size > 0 for p in trace_files)
    assert any(p.name.endswith(".xplane.pb") for p in trace_files)
    assert report_main([str(observed_run), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert f"{observed_run / 'profiles' / 'rank0'}: {len(trace_files)} file(s)" in printed


def test_no_tensorboard_or_profile_unless_asked(tmp_path: Path):
    run_dir = tmp_path / "plain"
    plain = [key for key in RUN if not key.startswith("observe.")]
    train(load_config(None, [*plain, "train.steps=2", f"run.dir={run_dir}"]), io.StringIO())
    assert (run_dir / "metrics.jsonl").exists()
    assert not (run_dir / "tensorboard").exists() and not (run_dir / "profiles").exists()


@pytest.mark.parametrize("steps", ["[3]", "[4, 2]", "[-1, 2]", "[1, 2, 3]"])
def test_a_bad_profile_range_is_one_line_exit_2_before_anything_is_written(tmp_path, capsys, steps):
    run_dir = tmp_path / "bad"
    code = train_main([f"observe.profile_steps={steps}", f"run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "observe.profile_steps" in err and "[first, last]" in err
    assert not run_dir.exists()
