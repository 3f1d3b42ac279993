"""The run report's expert-load section and heat map: from a real tiny mixture-of-experts run,
and from metrics.jsonl files written with a known load."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from msjax.observe.expert_load import HOT_SHARE_RATIO, HOT_STEP_FRACTION, HOT_WINDOW_STEPS
from msjax.report import EXPERT_LOAD_PLOT, main
from msjax.run_dir import RunDir

STEPS = 4
TINY_MOE_RUN = [
    f"train.steps={STEPS}",
    "train.global_batch=8",
    "train.eval_every=100",
    "train.eval_batches=1",
    "data.max_corpus_mib=1",
    "data.seq_len=32",
    "checkpoint.enabled=false",
]


@pytest.fixture(scope="module")
def moe_run_dir(tmp_path_factory) -> Path:
    """A real run directory of configs/tiny_moe.yaml, trained for a few steps in this process."""
    from msjax.config import load_config
    from msjax.train import train

    path = tmp_path_factory.mktemp("moe_report") / "run"
    config = load_config("configs/tiny_moe.yaml", [*TINY_MOE_RUN, f"run.dir={path}"])
    train(config, progress_stream=io.StringIO())
    return path


def read_steps(path: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {record["step"]: record for record in records if "loss" in record}


def report(capsys, *argv: object) -> tuple[int, str]:
    code = main([str(arg) for arg in argv])
    return code, capsys.readouterr().out


def test_expert_load_section_holds_the_numbers_in_metrics_jsonl(moe_run_dir, capsys):
    steps = read_steps(RunDir(moe_run_dir).metrics)
    tokens = np.array([steps[s]["moe_tokens_per_expert"] for s in sorted(steps)])  # [steps, E]
    run_shares = tokens.sum(axis=0) / tokens.sum()
    hottest = np.argsort(-run_shares, kind="stable")[:3]
    mean_imbalance = np.mean([r["moe_mean_load_imbalance"] for r in steps.values()])
    max_imbalance = max(r["moe_max_load_imbalance"] for r in steps.values())
    dropped = [r["moe_dropped_share"] for r in steps.values()]

    code, out = report(capsys, moe_run_dir, "--no-plots")

    assert code == 0
    assert len(set(run_shares.round(6))) > 1, "an even load would not test the ordering"
    assert f"steps 0-{STEPS - 1} ({STEPS} steps), 8 experts, even share 12.5%" in out
    assert f"mean {mean_imbalance:.2f}, max {max_imbalance:.2f}" in out
    assert (
        f"dropped share: mean {100 * np.mean(dropped):.1f}%, max {100 * max(dropped):.1f}%" in out
    )
    named = ", ".join(f"expert {e} {100 * run_shares[e]:.1f}%" for e in hottest)
    assert f"hottest over the run: {named}" in " ".join(out.split()), out
    assert "hot experts: " in out
    assert all(len(line) <= 80 for line in out.splitlines()), out


def test_expert_load_heat_map_is_experts_by_steps(moe_run_dir, tmp_path, capsys):
    import matplotlib.image

    code, out = report(capsys, moe_run_dir, "--out", tmp_path)

    assert code == 0
    assert f"{EXPERT_LOAD_PLOT}" in out.split("plots in ")[1].splitlines()[0], out
    pixels = matplotlib.image.imread(tmp_path / EXPERT_LOAD_PLOT)  # [height, width, rgba]
    assert pixels.shape[1] == 1000  # figsize 10 in at 100 dpi
    assert pixels.shape[0] == round(100 * max(2.5, 0.3 * 8 + 1.5))  # a row height per expert
    colours = np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)
    assert len(colours) > 10, "the heat map is nearly one colour"


def write_metrics(path: Path, shares_by_step: list[list[float]]) -> Path:
    """A run directory whose metrics.jsonl holds training steps with these shares of 1000
    tokens per expert (the other step fields the report reads, made up but plausible)."""
    lines = []
    for step, shares in enumerate(shares_by_step):
        tokens = [1000 * share for share in shares]
        record = {
            "step": step,
            "loss": 5.0,
            "step_time_s": 0.1,
            "tokens_per_s": 1000.0,
            "data_wait_s": 0.0,
            "moe_tokens_per_expert": tokens,
            "moe_max_load_imbalance": max(tokens) / np.mean(tokens),
            "moe_mean_load_imbalance": max(tokens) / np.mean(tokens),
            "moe_dropped_share": 0.0,
        }
        lines.append(json.dumps(record))
    RunDir(path).metrics.parent.mkdir(parents=True, exist_ok=True)
    RunDir(path).metrics.write_text("\n".join(lines) + "\n")
    return path


def test_an_expert_hot_in_most_of_the_trailing_window_is_named(tmp_path, capsys):
    even = [0.25, 0.25, 0.25, 0.25]
    hot = [0.1, 0.1, 0.1, 0.7]  # expert 3 at 2.8x the even share
    window = HOT_WINDOW_STEPS
    cool_steps = round(window * (1 - HOT_STEP_FRACTION))  # just few enough to stay persistent
    shares = [hot] * 30 + [hot] * (window - cool_steps) + [even] * cool_steps
    assert HOT_SHARE_RATIO * 0.25 < 0.7
    run_dir = write_metrics(tmp_path / "run", shares)
    last = len(shares) - 1

    code, out = report(capsys, run_dir, "--no-plots")

    assert code == 0
    assert "hot experts: 1 expert(s)" in out, out
    assert (
        f"expert 3: hot in {window - cool_steps} of {window} steps "
        f"(steps {last - window + 1}-{last}), share up to 70.0% (2.80x the even share)"
    ) in " ".join(out.split()), out


def test_an_expert_hot_only_before_the_trailing_window_is_not_named(tmp_path, capsys):
    even = [0.25, 0.25, 0.25, 0.25]
    hot = [0.1, 0.1, 0.1, 0.7]
    cool_steps = round(HOT_WINDOW_STEPS * (1 - HOT_STEP_FRACTION)) + 1  # one too many
    shares = [hot] * 30 + [hot] * (HOT_WINDOW_STEPS - cool_steps) + [even] * cool_steps
    run_dir = write_metrics(tmp_path / "run", shares)

    code, out = report(capsys, run_dir, "--no-plots")

    assert code == 0
    assert "hottest over the run: expert 3" in out  # hot over the run, not persistently now
    assert f"hot experts: none (over 1.5x the even share in 80% of the last {HOT_WINDOW_STEPS}" in (
        " ".join(out.split())
    ), out
