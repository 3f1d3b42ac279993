"""benchmarks/gpu_suite.py in its CPU smoke form: one JSON line per part in OUTDIR/gpu.jsonl, in
order, with each part's rows, including the rows of a part killed at its time budget.

One smoke run serves every check (module fixture): its `versions` part is made to hang after its
rows (the suite's `--hang` fault) under a 30 s budget, so the suite must kill it and still keep
what it printed, then run the rest.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO

PARTS = [
    "versions",
    "ceilings",
    "attention",
    "llama_xla",
    "llama_pallas",
    "checkpoint",
    "llama_cudnn",
    "gpu_tests",
    "async_collectives",
]
HUNG_BUDGET_S = 30


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-suite")
    command = [sys.executable, "benchmarks/gpu_suite.py", "--smoke", "--out", str(out)]
    command += ["--hang", "versions", "--budget", f"versions={HUNG_BUDGET_S}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [json.loads(line) for line in (out / "gpu.jsonl").read_text().splitlines()]
    return {"out": out, "lines": lines, "parts": {line["part"]: line for line in lines}}


def rows(part: dict, kind: str) -> list[dict]:
    return [row for row in part["rows"] if row.get("kind") == kind]


def test_one_line_per_part_in_order_and_gpu_only_parts_skipped(smoke_run):
    assert [line["part"] for line in smoke_run["lines"]] == PARTS
    assert all(line["smoke"] is True for line in smoke_run["lines"])
    statuses = {name: part["status"] for name, part in smoke_run["parts"].items()}
    assert statuses == {
        "versions": "timeout",
        **dict.fromkeys(["ceilings", "attention", "llama_xla", "llama_pallas"], "ok"),
        "checkpoint": "ok",
        "llama_cudnn": "skipped",
        "gpu_tests": "skipped",
        "async_collectives": "skipped",
    }, {name: part.get("output_tail", "") for name, part in smoke_run["parts"].items()}


def test_a_part_killed_at_its_budget_keeps_the_rows_it_printed(smoke_run):
    hung = smoke_run["parts"]["versions"]
    assert hung["budget_s"] == HUNG_BUDGET_S and hung["seconds"] >= HUNG_BUDGET_S
    (versions,) = rows(hung, "versions")
    assert versions["backend"] == "cpu" and versions["packages"]["jax"]
    assert rows(hung, "nvidia_smi")  # printed after the versions, before the hang


def test_ceilings_and_attention_rows_carry_rates_and_both_backward_conventions(smoke_run):
    (matmul,) = rows(smoke_run["parts"]["ceilings"], "matmul_bf16")
    assert matmul["tflops"] == pytest.approx(2 * matmul["n"] ** 3 / matmul["ms"] / 1e9)
    attention = {
        (row["case"], row["impl"]): row
        for row in rows(smoke_run["parts"]["attention"], "attention")
    }
    # no cuDNN on CPU; XLA's reference only for the unpacked case
    assert set(attention) == {
        ("llama_1b", "pallas"),
        ("llama_1b", "xla"),
        ("llama_1b_packed", "pallas"),
    }

    def forward_flops(row: dict) -> float:
        return row["forward_tflops"] * row["forward_ms"] * 1e9

    # [1, 64, 4 heads, 2 kv heads, 16]: 2080 causal pairs; 3 packed documents (22, 21, 21): 715
    causal, packed = attention[("llama_1b", "pallas")], attention[("llama_1b_packed", "pallas")]
    assert forward_flops(causal) == pytest.approx(4 * 4 * 16 * 2080)
    assert forward_flops(packed) == pytest.approx(4 * 4 * 16 * 715)
    for row in attention.values():
        assert row["max_error"] < 3e-2, row
        assert row["forward_backward_ms"] == pytest.approx(row["forward_ms"] + row["backward_ms"])
        if row["backward_ms"] > 0:
            ratio = row["backward_tflops_2.5x"] / row["backward_tflops_2x"]
            assert ratio == pytest.approx(1.25)


def test_llama_runs_report_tokens_per_s_and_pallas_losses_match_xla_step_by_step(smoke_run):
    runs = {}
    for name in ("llama_xla", "llama_pallas"):
        (runs[name],) = rows(smoke_run["parts"][name], "llama_1b")
        assert runs[name]["tokens_per_s"] > 0 and len(runs[name]["losses"]) == 3
        assert (smoke_run["out"] / f"{name}.metrics.jsonl").exists()
    (check,) = rows(smoke_run["parts"]["llama_pallas"], "loss_vs_xla")
    differences = check["abs_difference"]
    assert set(differences) == set(runs["llama_xla"]["losses"])  # every step compared
    pallas, xla = runs["llama_pallas"]["losses"], runs["llama_xla"]["losses"]
    assert differences == {step: abs(pallas[step] - xla[step]) for step in xla}
    assert max(differences.values()) < 1e-3  # interpreted kernels against the references


def test_checkpoint_part_saves_restores_and_saves_a_whole_state_in_gb_per_s(smoke_run):
    phases = {row["phase"]: row for row in rows(smoke_run["parts"]["checkpoint"], "checkpoint")}
    assert list(phases) == ["state", "first_save", "restore", "second_save"]
    state_bytes = phases["state"]["bytes"]
    assert state_bytes > 0
    for phase in ("first_save", "restore", "second_save"):
        row = phases[phase]
        assert row["gb_per_s"] == pytest.approx(state_bytes / 1e9 / row["seconds"])
    # both saves on disk after the second: at least the state's bytes, more than the first alone
    assert phases["second_save"]["bytes_on_disk"] >= state_bytes
    assert phases["second_save"]["bytes_on_disk"] > phases["first_save"]["bytes_on_disk"]


def test_gpu_suite_rejects_an_unknown_part_with_one_line(tmp_path: Path) -> None:
    command = [sys.executable, "benchmarks/gpu_suite.py", "--smoke", "--out", str(tmp_path)]
    result = subprocess.run(
        [*command, "--parts", "attention,speed"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "unknown part 'speed'; accepted: versions, ceilings, attention" in result.stderr
    assert not (tmp_path / "gpu.jsonl").exists()
