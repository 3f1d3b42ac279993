"""Specifications of `python -m msjax.report`: its numbers are the run directory's numbers, every
PNG is drawn from a real run, the heat map has a row per rank in mesh order, and bad input is one
line with exit 2."""

from __future__ import annotations

import io
import json
import re
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest

from msjax.observe.run_files import WARMUP_STEPS
from msjax.report import EXPERT_LOAD_PLOT, PLOTS, main
from msjax.run_dir import RunDir

STEPS = 6
TINY_RUN = [
    f"train.steps={STEPS}",
    "train.global_batch=16",
    "train.eval_every=3",
    "train.eval_batches=1",
    "train.peak_tflops=0.5",
    "data.max_corpus_mib=1",
    "data.seq_len=32",
    "model.num_layers=1",
    "checkpoint.enabled=false",
]
ROW = re.compile(r"^\s*(r\d+)\b.*\|.*\|")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A real run directory: a tiny training run, in this process."""
    from msjax.config import load_config
    from msjax.train import train

    path = tmp_path_factory.mktemp("report") / "run"
    train(load_config(None, [*TINY_RUN, f"run.dir={path}"]), progress_stream=io.StringIO())
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_summary_numbers_are_the_numbers_in_metrics_jsonl(run_dir, capsys):
    records = read_jsonl(RunDir(run_dir).metrics)
    steps = {r["step"]: r for r in records if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    steady = [steps[s]["tokens_per_s"] for s in sorted(steps)[WARMUP_STEPS:]]
    mfu = [steps[s]["mfu"] for s in sorted(steps)[WARMUP_STEPS:]]
    kept_s = sum(r["step_time_s"] for r in steps.values())
    # step 0 also waits for compilation: it counts as a typical (median) step; each step's data
    # wait counts at most its step's time (a batch's wait can fall in the step before's window)
    typical_s = statistics.median_high(steps[s]["step_time_s"] for s in sorted(steps)[1:])
    times = {s: steps[s]["step_time_s"] for s in steps} | {
        0: min(steps[0]["step_time_s"], typical_s)
    }
    data_s = sum(min(steps[s]["data_wait_s"], times[s]) for s in sorted(steps))

    code, out, _ = report(capsys, run_dir, "--no-plots")

    assert code == 0
    assert "run tiny" in out
    assert f"{len(steps)} of {STEPS} done (last step {STEPS - 1})" in out
    assert f"kept steps took {kept_s:.1f} s" in out
    assert f"median {statistics.median(steady):,.0f} tokens/s" in out
    assert f"MFU {100 * statistics.median(mfu):.3g}%" in out
    assert f"{steps[0]['loss']:.4f} (step 0) -> {steps[STEPS - 1]['loss']:.4f} (step 5)" in out
    assert f"eval loss {evals[max(evals)]:.4f} (step {max(evals)})" in out
    assert "goodput from metrics.jsonl only" in out  # not supervised: no wall-clock ratio
    assert f"of the {kept_s:.1f} s of steps and checkpoint pauses it records" in out
    assert re.search(rf"^  data\s+{data_s:.2f} s", out, re.MULTILINE)
    assert "incidents: none" in out
    assert "expert load" not in out and "hot experts" not in out  # a dense run has no experts
    assert all(len(line) <= 80 for line in out.splitlines()), out


def test_every_png_is_drawn_from_a_real_run(run_dir, tmp_path, capsys):
    import matplotlib.image

    out_dir = tmp_path / "pictures"
    code, out, _ = report(capsys, run_dir, "--out", out_dir)

    assert code == 0
    assert f"plots in {out_dir}: {', '.join(PLOTS)}" in out
    assert not (out_dir / EXPERT_LOAD_PLOT).exists()  # a dense run: no expert heat map
    for name in PLOTS:
        pixels = matplotlib.image.imread(out_dir / name)  # [height, width, rgba]
        assert pixels.shape[0] >= 200 and pixels.shape[1] >= 600, name
        colours = np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)
        assert len(colours) > 10, f"{name} is nearly one colour"


def test_text_heatmap_has_one_row_per_rank_of_the_run(run_dir, capsys):
    header = read_jsonl(RunDir(run_dir).ranks)[0]
    assert header["event"] == "ranks"

    code, out, _ = report(capsys, run_dir, "--no-plots")

    assert code == 0
    heatmap = out[out.index("per-rank work time") :]
    rows = [ROW.match(line).group(1) for line in heatmap.splitlines() if ROW.match(line)]
    assert rows == [f"r{rank['rank']}" for rank in header["ranks"]]
    assert "legend, work s per rank-step:" in heatmap
    timed_steps = [r["step"] for r in read_jsonl(RunDir(run_dir).ranks) if "work_s" in r]
    assert f"steps 0-{STEPS - 1} ({len(timed_steps)} recorded)" in heatmap


def eight_rank_timing(path: Path) -> None:
    """ranks.jsonl of a 2 x 2 x 2 mesh of one-device ranks (a layout a one-process test run
    cannot produce) listed out of mesh order, rank 5 slow from step 20 and flagged for it."""
    ranks = [
        {
            "rank": rank,
            "host": f"host{rank // 4}",
            "pid": 100 + rank,
            "devices": 1,
            "mesh": {"data": [rank % 2], "fsdp": [rank // 2 % 2], "tensor": [rank // 4]},
        }
        for rank in range(8)
    ]
    lines = [{"event": "ranks", "attempt": 0, "ranks": ranks}]
    for step in range(40):
        work_s = [0.1 + 0.001 * rank for rank in range(8)]
        work_s[5] += 0.2 if step >= 20 else 0.0
        lines.append({"step": step, "work_s": work_s, "step_time_s": [0.4] * 8})
    lines.append(
        {
            "step": 39,
            "event": "straggler",
            "rank": 5,
            "host": "host1",
            "mesh": ranks[5]["mesh"],
            "phase": "host",
            "excess_s": 0.2,
            "score": 9.3,
            "window": [20, 39],
        }
    )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_heatmap_rows_follow_the_mesh_and_the_straggler_is_named(run_dir, tmp_path, capsys):
    copy = RunDir(tmp_path / "run")
    shutil.copytree(run_dir, copy.path, ignore=shutil.ignore_patterns(copy.report.name))
    eight_rank_timing(copy.ranks)

    code, out, _ = report(capsys, copy.path)

    assert code == 0
    rows = [line for line in out.splitlines() if ROW.match(line)]
    # ranks in (data, fsdp, tensor) order; data is the outermost axis that varies
    assert [ROW.match(line).group(1) for line in rows] == [
        f"r{rank}" for rank in (0, 4, 2, 6, 1, 5, 3, 7)
    ]
    assert "rows grouped by data" in out and "data 0" in out and "data 1" in out
    slow = next(line for line in rows if line.lstrip().startswith("r5 "))
    assert slow.startswith("  r5 d1 f0 t1 |") and slow.endswith("| !")
    cells = slow[slow.index("|") + 1 : slow.rindex("|")]
    assert cells == " " * 20 + "@" * 20  # one column per step; the slow half at the top shade
    assert "rank 5 on host1 (data 1, fsdp 0, tensor 1): flagged 1 time(s), steps 20-39" in out
    assert "phase host x1" in out
    assert (copy.report / "heatmap.png").stat().st_size > 10_000


def test_a_partial_run_dir_reports_what_it_has(run_dir, tmp_path, capsys):
    copy = RunDir(tmp_path / "run")
    ignored = shutil.ignore_patterns(copy.report.name, copy.ranks.name)
    shutil.copytree(run_dir, copy.path, ignore=ignored)
    text = copy.metrics.read_text()
    copy.metrics.write_text(text[: len(text) // 2])  # a writer killed mid-line

    code, out, _ = report(capsys, copy.path)

    assert code == 0
    assert "unreadable line(s) in metrics.jsonl skipped" in out
    assert "stragglers: no ranks.jsonl" in out
    assert "skipped heatmap.png: no ranks.jsonl" in out
    assert (copy.report / "loss.png").exists()

    copy.metrics.write_text("")
    code, out, _ = report(capsys, copy.path)
    assert code == 0
    assert "no training step recorded yet" in out
    assert "skipped loss.png and throughput.png" in out


def test_the_flight_recorder_verdict_names_the_rank_that_stopped_short(run_dir, tmp_path, capsys):
    """The run's own dump as rank 0, and a rank 1 whose dumps end a step earlier: a hang."""
    from msjax.observe.flight_recorder import diagnose

    copy = RunDir(tmp_path / "run")
    shutil.copytree(run_dir, copy.path, ignore=shutil.ignore_patterns(copy.report.name))
    dump = json.loads(copy.flight_record(0).read_text())
    dump["closed"] = False
    last_begin = max(i for i, e in enumerate(dump["events"]) if e["event"] == "step_begin")
    behind = {
        **dump,
        "rank": 1,
        "events": dump["events"][: last_begin + 1],
        "alive_at": dump["alive_at"] - 5.0,
    }
    copy.flight_record(0).write_text(json.dumps(dump))
    copy.flight_record(1).write_text(json.dumps(behind))

    code, out, _ = report(capsys, copy.path, "--no-plots")

    verdict = diagnose(copy.path)
    assert code == 0 and verdict is not None and verdict.rank == 1
    assert " ".join(f"flight recorder: {verdict.summary}".split()) in " ".join(out.split())
    flat = " ".join(out.split())  # the report wraps long lines
    assert "flight recorder: rank 1 (" in flat and "went silent 5.0 s before the others" in flat
    assert "short of the point the others reached" in " ".join(out.split())


@pytest.mark.parametrize("case", ["missing", "a file", "no metrics", "undecodable metrics"])
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    target = tmp_path / "run"
    if case == "a file":
        target.write_text("not a run\n")
    elif case == "no metrics":
        target.mkdir()
        RunDir(target).config_yaml.write_text("run: {name: x}\n")
    elif case == "undecodable metrics":
        target.mkdir()
        RunDir(target).metrics.write_bytes(b"\xff\xfe\x00garbage")

    code, out, err = report(capsys, target)

    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("msjax.report: error: ")
    assert str(target) in err
