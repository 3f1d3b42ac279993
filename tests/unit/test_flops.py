"""FLOP counts and MFU: MegaScale's Table 2 from configs/megascale_175b.yaml, and the CLI."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from msjax.config import ModelConfig, load_config
from msjax.errors import MsjaxError
from msjax.flops import main
from msjax.observe.flops import (
    count_params,
    device_peak,
    flops_per_step,
    flops_per_token,
    measure_cpu_peak_tflops,
    mfu,
    peak_tflops_for_device_kind,
    peak_tflops_per_device,
)

REPO = Path(__file__).resolve().parents[2]


MEGASCALE_175B = REPO / "configs" / "megascale_175b.yaml"


A100_TFLOPS = 312.0


def megascale_mfu_percent(step_time_s: float, gpus: int, overrides: tuple[str, ...] = ()) -> float:
    config = load_config(MEGASCALE_175B, overrides)
    return 100 * mfu(flops_per_step(config), step_time_s, gpus, A100_TFLOPS)


def test_megascale_175b_at_12288_gpus_reproduces_table_2_mfu():
    assert megascale_mfu_percent(6.34, 12288) == pytest.approx(55.2, abs=1.0)  # MegaScale
    assert megascale_mfu_percent(8.57, 12288) == pytest.approx(41.2, abs=1.0)  # Megatron-LM


def test_megascale_175b_at_256_gpus_reproduces_table_2_mfu():
    overrides = ("train.global_batch=768",)
    assert megascale_mfu_percent(40.0, 256, overrides) == pytest.approx(53.0, abs=1.0)
    # The row itself is loose: 40.0 s -> 53.0% and 32.0 s -> 65.3% differ by 1.232x, not 1.25x.
    # The attention term counts only the pairs the causal mask keeps (half of seq_len^2); with
    # every pair counted this row would read 66.3%.
    assert megascale_mfu_percent(32.0, 256, overrides) == pytest.approx(65.3, abs=1.1)


def test_megascale_175b_has_175b_parameters():
    params = count_params(load_config(MEGASCALE_175B).model)
    per_layer = 12 * 12288**2  # GPT-3's 4h^2 attention + 8h^2 MLP
    assert params.matmul == 96 * per_layer + 64000 * 12288
    assert params.embedding == 64000 * 12288
    assert params.total == params.matmul + params.embedding + (2 * 96 + 1) * 12288
    assert round(params.total / 1e9, 1) == 175.5


def test_count_params_matches_every_weight_shape_of_the_model():
    model = ModelConfig(
        vocab_size=96, num_layers=3, embed_dim=40, num_heads=4, num_kv_heads=2, head_dim=12,
        mlp_dim=88,
    )  # fmt: skip
    e, h, kv, d, m, v = 40, 4, 2, 12, 88, 96
    block = [(e,), (e,), (e, h, d), (e, kv, d), (e, kv, d), (h, d, e), (e, m), (e, m), (m, e)]
    shapes = [(v, e)] + 3 * block + [(e,), (e, v)]
    matmul_shapes = [s for s in shapes if len(s) > 1 and s != (v, e)]
    params = count_params(model)
    assert params.total == sum(math.prod(s) for s in shapes)
    assert params.embedding == v * e
    assert params.matmul == sum(math.prod(s) for s in matmul_shapes)


def test_tied_embeddings_remove_vocab_times_embed_parameters_but_no_flops():
    untied = ModelConfig(vocab_size=512, embed_dim=64, tied_embeddings=False)
    tied = dataclasses.replace(untied, tied_embeddings=True)
    assert count_params(untied).total - count_params(tied).total == 512 * 64
    assert count_params(tied).matmul == count_params(untied).matmul  # the table is the projection
    assert flops_per_token(tied, 256) == flops_per_token(untied, 256)


def test_flops_per_token_is_six_times_matmul_params_plus_causal_attention():
    model = ModelConfig()
    # 128 queries see 1..128 keys under the causal mask: 129/2 on average
    attention = 12 * model.num_layers * model.num_heads * model.resolved_head_dim * 129 / 2
    assert flops_per_token(model, 128) == 6 * count_params(model).matmul + attention


def test_sliding_window_lowers_the_attention_term_exactly():
    full = ModelConfig(num_layers=4, num_heads=8, embed_dim=128)
    windowed = dataclasses.replace(full, attention_window=100)
    saved = flops_per_token(full, 1024) - flops_per_token(windowed, 1024)
    # visible pairs: 1024 * 1025 / 2 causal; 100 * 101 / 2 + 924 * 100 with a 100-key window
    pairs_saved = 1024 * 1025 / 2 - (100 * 101 / 2 + 924 * 100)
    assert saved == pytest.approx(12 * 4 * 8 * 16 * pairs_saved / 1024, rel=1e-12)


def test_window_longer_than_the_sequence_changes_nothing():
    full = ModelConfig()
    wide = dataclasses.replace(full, attention_window=4096)
    assert flops_per_token(wide, 1024) == flops_per_token(full, 1024)


def test_flops_per_step_counts_global_batch_times_seq_len_tokens():
    config = load_config(None, ["train.global_batch=16", "data.seq_len=64"])
    assert flops_per_step(config) == flops_per_token(config.model, 64) * 16 * 64


def test_mfu_rejects_a_non_positive_step_time():
    with pytest.raises(MsjaxError, match="step time"):
        mfu(1e12, 0.0, 8, 312.0)


@pytest.mark.parametrize(
    ("device_kind", "peak"),
    [
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100-SXM4-40GB", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("TPU v9 lite", None),
    ],
)
def test_peak_table_matches_jax_device_kind_strings(device_kind, peak):
    assert peak_tflops_for_device_kind(device_kind) == peak


def test_peak_of_an_unknown_accelerator_asks_for_train_peak_tflops():
    device = SimpleNamespace(platform="tpu", device_kind="TPU v9 lite")  # a kind not in the table
    with pytest.raises(MsjaxError, match=r"train\.peak_tflops"):
        peak_tflops_per_device(device)
    assert peak_tflops_per_device(device, override=123.0) == 123.0


def test_cpu_peak_is_measured_once_positive_and_finite():
    tflops = measure_cpu_peak_tflops()
    assert math.isfinite(tflops) and tflops > 0
    assert measure_cpu_peak_tflops() is tflops  # every later step's MFU reads the one measurement


def test_the_peaks_source_says_which_figure_the_mfu_is_reckoned_from():
    import jax

    cpu = jax.devices("cpu")[0]
    measured = device_peak(cpu)[1]
    assert measured.startswith("measured:"), measured
    assert f"shared by {jax.local_device_count(backend='cpu')} CPU devices" in measured
    assert device_peak(cpu, override=50.0)[1] == "train.peak_tflops"
    gpu = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    assert device_peak(gpu)[1] == "datasheet: dense bfloat16 for NVIDIA H100 80GB HBM3"


def test_cpu_peak_is_the_measured_machine_peak_shared_by_the_cpu_devices():
    import jax

    share = measure_cpu_peak_tflops() / jax.local_device_count(backend="cpu")
    assert peak_tflops_per_device(jax.devices("cpu")[0]) == share
    assert peak_tflops_per_device(jax.devices("cpu")[0], override=50.0) == 50.0


def test_cli_prints_counts_tokens_per_s_and_mfu(capsys):
    argv = ["--config", str(MEGASCALE_175B), "--devices", "12288", "--peak-tflops", "312"]
    assert main([*argv, "--step-time", "6.34"]) == 0
    out = capsys.readouterr().out
    assert "175.5B total, 786.4M embedding, 174.7B matmul" in out
    assert "tokens/s:        1.985M" in out  # the paper: 1.98M tokens/s
    assert "MFU:             55.0%" in out  # the paper: 55.2%
    assert "MFU convention:  model FLOPs = 6 x matmul params" in out


def test_cli_applies_overrides_after_options(capsys):
    argv = ["--config", str(MEGASCALE_175B), "--step-time", "32", "--devices", "256"]
    assert main([*argv, "train.global_batch=768", "--peak-tflops", "312"]) == 0
    assert "MFU:             65.4%" in capsys.readouterr().out  # the paper: 65.3%


def test_cli_without_peak_tflops_fails_with_one_line_and_exit_2(capsys):
    assert main(["--step-time", "1.0", "--devices", "8"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("msjax.flops: error: --step-time needs --peak-tflops")


def test_cli_bad_config_key_fails_with_one_line_and_exit_2(capsys):
    assert main(["model.embed_size=64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.embed_dim" in err
