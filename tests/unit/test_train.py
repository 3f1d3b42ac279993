"""The training loop end to end: what it writes, what it measures, and that it learns."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from msjax.config import config_from_dict, load_config
from msjax.observe.flops import flops_per_step
from msjax.observe.metrics import read_metrics
from msjax.resolve import resolve
from msjax.train import train

STEPS = 24


SHORT_RUN = [
    f"train.steps={STEPS}",
    "train.global_batch=16",
    "train.eval_every=12",
    "train.eval_batches=2",
    "train.peak_tflops=0.5",
    "data.max_corpus_mib=2",
    "data.seq_len=64",
    "optim.warmup_steps=4",
]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("runs") / "short"
    config = load_config(None, [*SHORT_RUN, f"run.dir={run_dir}"])
    result = train(config, progress_stream=open(os.devnull, "w"))  # noqa: SIM115
    return config, result, read_metrics(run_dir / "metrics.jsonl")


def step_records(records: list[dict]) -> list[dict]:
    return [record for record in records if "loss" in record]


def test_every_step_writes_the_metrics_a_team_watches(short_run):
    _, _, records = short_run
    steps = step_records(records)
    assert [record["step"] for record in steps] == list(range(STEPS))
    for record in steps:
        for key in ("loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "mfu"):
            assert np.isfinite(record[key]) and record[key] >= 0, (key, record)
        assert record["data_wait_s"] >= 0


def test_tokens_per_second_and_mfu_follow_from_the_step_time(short_run):
    config, _, records = short_run
    tokens_per_step = config.train.global_batch * config.data.seq_len
    devices = config.mesh.data * config.mesh.fsdp * config.mesh.tensor
    for record in step_records(records):
        assert record["tokens_per_s"] == pytest.approx(tokens_per_step / record["step_time_s"])
        expected_mfu = flops_per_step(config) / (record["step_time_s"] * devices * 0.5e12)
        assert record["mfu"] == pytest.approx(expected_mfu)


def test_the_run_records_what_its_mfu_is_reckoned_from(short_run):
    config, _, records = short_run
    basis = json.loads((Path(config.run.dir) / "mfu.json").read_text())
    assert basis["model_flops_per_step"] == flops_per_step(config)
    assert basis["tokens_per_step"] == config.train.global_batch * config.data.seq_len
    assert basis["devices"] == jax.device_count()
    assert basis["peak_tflops_per_device"] == 0.5
    assert basis["peak_source"] == "train.peak_tflops"
    for record in step_records(records):
        reckoned = basis["model_flops_per_step"] / (
            record["step_time_s"] * basis["devices"] * basis["peak_tflops_per_device"] * 1e12
        )
        assert record["mfu"] == pytest.approx(reckoned)


def test_learning_rate_warms_up_then_decays(short_run):
    _, _, records = short_run
    lrs = [record["lr"] for record in step_records(records)]
    assert lrs[0] == 0.0
    assert lrs[4] == pytest.approx(3e-3)
    assert lrs[-1] < lrs[4]
    assert all(b <= a for a, b in itertools.pairwise(lrs[4:]))


def test_loss_falls_and_validation_is_recorded(short_run):
    _, result, records = short_run
    losses = [record["loss"] for record in step_records(records)]
    assert np.mean(losses[-4:]) < losses[0] - 1.0
    evals = [record for record in records if "eval_loss" in record]
    assert [record["step"] for record in evals] == [11, STEPS - 1]
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert result.final_eval_loss == evals[1]["eval_loss"]
    assert result.final_loss == losses[-1]


def test_resolved_config_is_saved_in_the_run_dir(short_run):
    config, result, _ = short_run
    saved = config_from_dict(yaml.safe_load((result.run_dir / "config.yaml").read_text()))
    assert saved == resolve(config, jax.device_count(), jax.default_backend())
    # what resolution chose on this backend: the kernels that ran, not `auto` (XLA's on a GPU
    # too, for this float32 model: cuDNN attention takes 16-bit inputs only)
    assert (saved.model.attention_impl, saved.model.norm_impl, saved.model.loss_impl) == (
        ("xla",) * 3
    )


def test_same_seed_gives_the_same_losses_and_another_seed_does_not(short_run, tmp_path):
    _, _, records = short_run
    losses = [record["loss"] for record in step_records(records)][:6]
    rerun = [*SHORT_RUN, "train.steps=6", "train.eval_every=0"]
    for seed, same in ((0, True), (1, False)):
        run_dir = tmp_path / f"seed{seed}"
        again = load_config(None, [*rerun, f"run.seed={seed}", f"run.dir={run_dir}"])
        train(again, progress_stream=open(os.devnull, "w"))  # noqa: SIM115
        # a 6-step cosine schedule differs from the 24-step one only after warmup
        again_losses = [r["loss"] for r in step_records(read_metrics(run_dir / "metrics.jsonl"))]
        assert (again_losses[:5] == losses[:5]) is same
