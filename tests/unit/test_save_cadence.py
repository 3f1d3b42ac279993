"""Specifications of the save cadence: Young's interval sqrt(2 x save cost x MTBF) and the share
of time lost, by hand; and `python -m msjax.report`'s section of it on a real run, whose numbers
are those its metrics.jsonl gives."""

from __future__ import annotations

import io
import json
import math
import statistics
from pathlib import Path

import pytest

from msjax.checkpoint.snapshots import shared_memory_root
from msjax.observe.run_files import WARMUP_STEPS
from msjax.planner.save_cadence import advise, interval_steps, lost_share, optimal_interval_s
from msjax.report import main
from msjax.run_dir import RunDir

STEPS = 6
EVERY = 2
SAVING_RUN = [
    f"train.steps={STEPS}",
    "train.global_batch=16",
    "train.eval_every=0",
    "data.max_corpus_mib=1",
    "data.seq_len=32",
    "model.num_layers=1",
    "checkpoint.enabled=true",
    f"checkpoint.every_steps={EVERY}",
]
DAY_S = 24 * 3600.0


def test_young_interval_is_the_square_root_of_twice_cost_times_mtbf():
    assert optimal_interval_s(10.0, DAY_S) == pytest.approx(1314.534, abs=1e-3)
    assert optimal_interval_s(0.5, 3600.0) == pytest.approx(60.0)
    assert interval_steps(1314.534, 2.0) == 657
    assert interval_steps(0.1, 2.0) == 1  # never less than every step


def test_lost_share_is_saves_plus_half_an_interval_of_rework_and_least_at_young():
    # 10 s per save every 1000 s: 1% saving; 1000 s / (2 x 86400 s) rework
    assert lost_share(10.0, 1000.0, DAY_S) == pytest.approx(0.01 + 1000.0 / 172800.0)
    best = optimal_interval_s(10.0, DAY_S)
    assert lost_share(10.0, best, DAY_S) == pytest.approx(math.sqrt(2 * 10.0 / DAY_S))
    assert lost_share(10.0, best, DAY_S) < lost_share(10.0, 0.9 * best, DAY_S)
    assert lost_share(10.0, best, DAY_S) < lost_share(10.0, 1.1 * best, DAY_S)


def test_advice_takes_the_median_cost_and_rates_the_configured_interval():
    advice = advise([8.0, 10.0, 30.0], step_time_s=2.0, mtbf_s=DAY_S, configured_steps=100)
    assert advice is not None
    assert advice.save_cost_s == 10.0 and advice.saves == 3
    assert advice.recommended_steps == 657
    assert advice.recommended_lost_share == pytest.approx(10.0 / 1314.0 + 1314.0 / 172800.0)
    assert advice.configured_lost_share == pytest.approx(10.0 / 200.0 + 200.0 / 172800.0)
    assert advise([], 2.0, DAY_S) is None


@pytest.fixture(scope="module")
def saving_run(tmp_path_factory) -> Path:
    """A real tiny run that saves a checkpoint every EVERY steps (and, where the node has
    shared memory, takes in-memory snapshots as often), in this process."""
    from msjax.config import load_config
    from msjax.train import train

    path = tmp_path_factory.mktemp("cadence") / "run"
    snapshots = [f"checkpoint.memory_every_steps={EVERY}"] if shared_memory_root() else []
    overrides = [*SAVING_RUN, *snapshots, f"run.dir={path}"]
    train(load_config(None, overrides), progress_stream=io.StringIO())
    return path


def expected_text(costs_s: list[float], step_s: float, mtbf_s: float, key: str) -> str:
    """The report's words for saves of `costs_s`, computed here by hand."""
    cost_s = statistics.median(costs_s)
    optimum_s = math.sqrt(2 * cost_s * mtbf_s)
    steps = max(1, round(optimum_s / step_s))

    def share(interval_s: float) -> str:
        return f"{100 * (cost_s / interval_s + interval_s / (2 * mtbf_s)):.3g}%"

    noun = "snapshot" if key == "memory_every_steps" else "save"
    counted = f"{len(costs_s)} {noun}{'' if len(costs_s) == 1 else 's'}"
    return (
        f"median pause {cost_s:.4g} s over {counted}: optimum {optimum_s:.1f} s, "
        f"so checkpoint.{key}={steps}; lost to saves and rework {share(steps * step_s)} "
        f"(configured {EVERY}: {share(EVERY * step_s)})"
    )


@pytest.mark.parametrize("mtbf_hours", [None, 2.5])
def test_report_recommends_intervals_from_the_run_s_measured_costs(saving_run, mtbf_hours, capsys):
    records = [json.loads(line) for line in RunDir(saving_run).metrics.read_text().splitlines()]
    steps = {r["step"]: r for r in records if "loss" in r}
    step_s = statistics.median(steps[s]["step_time_s"] for s in sorted(steps)[WARMUP_STEPS:])
    saves_s = [r["checkpoint_save_blocked_s"] for r in records if "checkpoint_save_blocked_s" in r]
    snapshots_s = [r["memory_snapshot_stall_s"] for r in records if r.get("memory_snapshot_bytes")]
    assert len(saves_s) >= STEPS // EVERY  # every EVERY steps (and the end)
    mtbf_s = 3600.0 * (24.0 if mtbf_hours is None else mtbf_hours)

    argv = [str(saving_run), "--no-plots"]
    argv += [] if mtbf_hours is None else ["--mtbf-hours", str(mtbf_hours)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    flat = " ".join(out[out.index("save cadence") :].split())  # the report wraps long lines

    if mtbf_hours is None:
        assert "MTBF 24 h, assumed (--mtbf-hours)" in flat
    else:
        assert "MTBF 2.5 h (--mtbf-hours)" in flat and "assumed" not in flat.split("step time")[0]
    assert f"step time median {step_s:.4g} s over {STEPS - WARMUP_STEPS} steps" in flat
    assert f"checkpoint {expected_text(saves_s, step_s, mtbf_s, 'every_steps')}" in flat
    if snapshots_s:
        assert f"memory {expected_text(snapshots_s, step_s, mtbf_s, 'memory_every_steps')}" in flat
    assert all(len(line) <= 80 for line in out.splitlines()), out


def test_a_run_without_saves_says_there_is_nothing_to_recommend_from(tmp_path, capsys):
    from msjax.config import load_config
    from msjax.train import train

    path = tmp_path / "run"
    overrides = [*SAVING_RUN, "train.steps=3", "checkpoint.enabled=false", f"run.dir={path}"]
    train(load_config(None, overrides), progress_stream=io.StringIO())

    assert main([str(path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    cadence = [line for line in out.splitlines() if "save cadence" in line]
    assert cadence == [
        "save cadence: no checkpoint save or memory snapshot recorded, nothing to go by"
    ]


@pytest.mark.parametrize("hours", ["0", "-3", "inf", "nan"])
def test_a_failure_rate_that_is_not_positive_is_one_line_and_exit_2(saving_run, hours, capsys):
    assert main([str(saving_run), "--no-plots", "--mtbf-hours", hours]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("msjax.report: error: --mtbf-hours=")
