"""Every script in benchmarks/ runs its `--smoke` form and prints the measurements it promises.

Each run is a real subprocess; its printed numbers are read back and held to what they claim: both
sides measured (positive, finite) and the ratio line equal to their quotient.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import REPO, job_env

BENCHMARKS = REPO / "benchmarks"
# imported by the scripts, not run
HELPER_MODULES = {
    "attention_timing.py",
    "gpu_parts.py",  # gpu_suite.py's parts, run by it in their own processes
    "kernel_timing.py",
    "smoke.py",
    "supervised_job.py",
    "train_timing.py",
}
NUMBER = r"([-\d,.]+|nan|inf)"
JAX_CACHE = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_")  # conftest.py sets these


@dataclass(frozen=True)
class Smoke:
    script: str
    args: tuple[str, ...] = ("--smoke",)
    slow: bool = False


SMOKES = [
    Smoke("agreement_overhead.py"),
    Smoke("checkpoint_overhead.py"),
    Smoke("compute_check.py"),
    Smoke("corruption_guard.py"),
    Smoke("cpu_levers.py", slow=True),
    Smoke("data_throughput.py", slow=True),
    Smoke("fault_drill.py", slow=True),
    Smoke("generate.py"),
    # its other parts: tests/jobs/test_gpu_suite.py; {tmp} is the test's own directory
    Smoke("gpu_suite.py", ("--smoke", "--parts", "ceilings", "--out", "{tmp}/suite")),
    Smoke("kernels_gpu.py"),
    Smoke("memory_snapshots.py", ("--smoke", "--every", "1,2"), slow=True),
    Smoke("moe.py"),
    Smoke("observe_overhead.py"),
    Smoke("pipeline.py", slow=True),
    Smoke("recovery.py", slow=True),
    Smoke("step_overhead.py"),
]


def number(pattern: str, text: str) -> float:
    """The first capture of pattern in text, as a float (thousands commas dropped)."""
    match = re.search(pattern.replace("{N}", NUMBER), text)
    assert match, f"no line matches {pattern!r} in:\n{text}"
    return float(match[1].replace(",", ""))


def positive(*values: float) -> bool:
    return all(math.isfinite(value) and value > 0 for value in values)


def assert_ratio(
    ratio: float, ours: float, baseline: float, ratio_digits: int, operand_digits: int
) -> None:
    """ratio == ours / baseline, all three as printed (rounded to their decimals)."""
    assert positive(ratio, ours, baseline), (ratio, ours, baseline)
    operand_half, ratio_half = 0.5 * 10**-operand_digits, 0.5 * 10**-ratio_digits
    rounding = ratio * (operand_half / ours + operand_half / baseline) + ratio_half
    assert abs(ratio - ours / baseline) <= 1.01 * rounding + 1e-3 * ratio, (ratio, ours, baseline)


def check_agreement_overhead(out: str, _: Path) -> None:
    without = number(r"without a vote: {N} ms/step", out)
    for label in ("in step", "behind", "as msjax.train"):
        voted = number(label + r": {N} ms/step", out)
        assert_ratio(
            number(label + r": [\d.]+ ms/step \(\+?-?[\d.]+ ms, ratio {N}\)", out),
            voted,
            without,
            3,
            2,
        )
    assert "median of 2 chunks of 5 steps each" in out  # the smoke form's, not the full run's
    # one write and one read a round, and a delete every other round (two processes): 2.5,
    # where each rank's own read of every key made it 4
    per_round = number(r"behind {N} / [\d.]+", out)
    assert 2.0 <= per_round <= 3.0, out
    rounds = number(r"msjax.train's rounds: {N} in 10 steps", out)
    assert 1 <= rounds <= 10, out


def check_checkpoint_overhead(out: str, _: Path) -> None:
    without = number(r"no checkpoints\s+{N} tokens/s", out)
    with_saves = number(r"a save every 5 steps \(async\)\s+{N} tokens/s", out)
    assert_ratio(number(r"ratio \(with saves / without\)\s+{N}", out), with_saves, without, 3, 1)
    assert number(r"\({N} saves\)", out) >= 1  # a save fell inside the measured steps
    assert positive(
        number(r"save, start to finalized on disk\s+{N} MB/s", out),
        number(r"restore onto the mesh\s+{N} MB/s", out),
        number(r"state size\s+{N} MB", out),
    )
    assert "(smoke: tiny model)" in out


def check_corruption_guard(out: str, _: Path) -> None:
    bare = number(r"step time, no guard\s+{N} ms", out)
    guarded = number(r"step time, a check every 4 steps\s+{N} ms", out)
    assert_ratio(number(r"ratio \(guard / no guard\)\s+{N}", out), guarded, bare, 3, 2)
    assert positive(number(r"one check on its own\s+{N} ms", out))
    moved = number(r"bytes one check moves\s+{N} bytes per device", out)
    tensors = number(r"an all-gather of {N} tensors x 2 devices x 8 bytes", out)
    assert moved == tensors * 2 * 8  # a few integers per tensor, never the parameters
    assert moved < number(r"parameter bytes it reads in place\s+{N} bytes", out) / 100
    assert "(smoke: tiny model)" in out


def check_data_throughput(out: str, _: Path) -> None:
    delivered = [
        number(r"pipeline, 0 Grain workers\s+{N} tokens/s", out),
        number(r"pipeline, 2 Grain workers\s+{N} tokens/s", out),
    ]
    consumed = number(r"train step \(batches on device\)\s+{N} tokens/s", out)
    assert_ratio(
        number(r"headroom \(pipeline / step\)\s+{N} x", out), max(delivered), consumed, 1, 0
    )
    share_percent = number(r"{N}% of step time waiting for data", out)
    assert math.isfinite(share_percent) and 0 <= share_percent < 100
    assert "(smoke: tiny model)" in out


def check_generate(out: str, _: Path) -> None:
    cached = number(r"kv cache \(msjax.generate\)\s+{N} tokens/s", out)
    recomputed = number(r"full forward per token\s+{N} tokens/s", out)
    assert_ratio(number(r"ratio kv cache / full forward: {N}x", out), cached, recomputed, 1, 1)
    assert "same tokens: True" in out
    assert "prompt 8 tokens, 4 new tokens" in out


def check_gpu_suite(out: str, run_dir: Path) -> None:
    (line,) = [json.loads(text) for text in (run_dir / "suite" / "gpu.jsonl").open()]
    assert line["part"] == "ceilings" and line["status"] == "ok", line
    rates = {row["kind"]: row for row in line["rows"] if row["kind"] != "started"}
    assert positive(rates["matmul_bf16"]["tflops"], rates["copy"]["gb_per_s"])
    assert "ceilings: ok" in out


def check_kernels_gpu(out: str, _: Path) -> None:
    # each check row ends: error, tolerance, ok, ms
    rows = {}
    for line in out.splitlines():
        match = re.search(r"\s(\S+)\s+(\S+) (yes|no)\s+(\S+)$", line)
        if match and line.split()[0] in KERNELS:
            rows.setdefault(line.split()[0], []).append(match.groups())
    assert set(rows) == KERNELS, out
    for error, tolerance, ok, ms in (row for kernel in rows.values() for row in kernel):
        assert ok == "yes" and 0 <= float(error) <= float(tolerance) and positive(float(ms))
    assert "smoke form" in out


KERNELS = {"flash_attention", "rms_norm", "add_rms_norm", "cross_entropy"}


def check_memory_snapshots(out: str, _: Path) -> None:
    without = number(r"\| no snapshots \(memory_every_steps=0\) \| {N} ms", out)
    for cadence, every in (("every step", 1), ("every 2 steps", 2)):  # the smoke's --every 1,2
        row = rf"\| a snapshot {cadence} \(memory_every_steps={every}\) \| "
        mean = number(row + "{N} ms", out)
        ratio = number(rf"snapshot {cadence} / none, mean step time: {{N}}", out)
        assert_ratio(ratio, mean, without, 3, 2)
        assert number(row + r"[\d.]+ ms \| [\d.]+ ms \| {N} \|", out) >= 1  # snapshots taken
    assert positive(number(r"per-snapshot bytes: {N}", out))
    # the smoke form's two 1-process jobs, each checked by the script to have restored as named
    rows = re.findall(
        r"\n\| (own snapshot|buddy's copy|disk) \| crash \| ([\d.]+) s \| ([\d,]+) \| (\d+) \|", out
    )
    assert [row[0] for row in rows] == ["own snapshot", "disk"], out
    (own_s, own_bytes, own_lost), (disk_s, disk_bytes, _) = (row[1:] for row in rows)
    assert positive(float(own_bytes.replace(",", "")), float(disk_bytes.replace(",", "")))
    assert int(own_lost) <= 1  # a snapshot every step
    ratio = number(r"memory / disk restore seconds \(own snapshot\): {N}", out)
    assert_ratio(ratio, float(own_s), float(disk_s), 3, 3)
    assert number(r"\(3\) steps lost per fault: with snapshots {N}", out) == int(own_lost)
    # the own-snapshot restart's split, mark by mark, from the spawn to the first step
    assert positive(number(r"\| spawn \| main \| {N} \|", out))
    assert number(r"\| first_step_dispatched \| first_step_done \| {N} \|", out) >= 0
    assert "(smoke: tiny model)" in out and "1 process x 2 CPU devices" in out


MOE_MESHES = ("1 device", "data 2 x fsdp 4", "data 2 x expert 4")


def check_moe(out: str, _: Path) -> None:
    for mesh in MOE_MESHES:
        # MoE (ragged_dot), blocks, blocks / MoE, dense, MoE / dense, blocks / dense
        row = re.search(rf"\n{mesh} +((?:[\d,.]+ +){{5}}[\d,.]+)", out)
        assert row, out
        moe, blocks, blocks_ratio, dense, moe_ratio, blocks_dense = (
            float(value.replace(",", "")) for value in row[1].split()
        )
        assert_ratio(blocks_ratio, blocks, moe, 3, 1)
        assert_ratio(moe_ratio, moe, dense, 3, 1)
        assert_ratio(blocks_dense, blocks, dense, 3, 1)
    # the expert mesh's dense figure is the dense model's on data 2 x fsdp 4
    dense_column = r"\s+[\d,.]+\s+[\d,.]+\s+[\d.]+\s+{N}"
    assert number(r"\ndata 2 x expert 4" + dense_column, out) == number(
        r"\ndata 2 x fsdp 4" + dense_column, out
    )
    # the smoke model: 1 dense layer of 128 and 1 MoE layer of 2 + 1 experts of 32
    assert "dense: mlp_dim 112 = (1 x 128 + 1 x 3 x 32) / 2" in out
    assert "(goal <= 1.10)" in out
    for model in ("moe", "blocks", "dense"):
        columns = [float(value) for value in re.search(rf"\n{model} +(\d.*)", out)[1].split()]
        model_gflop, xla_gflop, xla_ratio, dots_gflop, dots_ratio, planned_cpu, _ = columns
        assert_ratio(xla_ratio, xla_gflop, model_gflop, 3, 4)
        assert_ratio(dots_ratio, dots_gflop, model_gflop, 3, 4)
        # at least the model's work, and what the planner predicts for this CPU step
        assert 1.0 <= dots_ratio == pytest.approx(planned_cpu, rel=0.05)
    # one MoE layer: its tokens out and back, forward and backward
    assert number(r"all-to-all ops \d+, runs per step {N}", out) >= 4
    result_bytes = number(r"result bytes per device\s+{N}", out)
    expert_bytes = number(r"sent over expert per device\s+{N} bytes", out)
    assert 0 < expert_bytes <= result_bytes
    assert expert_bytes <= number(r"sent over all axes per device\s+{N} bytes", out)
    dense_ms = number(r"dense reference \(masked\)\s+[\d.e+-]+\s+{N}", out)
    for impl in (r"jax.lax.ragged_dot", r"pallas \(interpreted\)"):
        error, ms, ratio = (
            float(value) for value in re.search(rf"\n{impl}\s+(\S+)\s+(\S+)\s+(\S+)", out).groups()
        )
        assert 0 <= error <= 1e-4
        assert_ratio(ratio, ms, dense_ms, 3, 3)
    assert "(smoke: tiny model)" in out


def check_observe_overhead(out: str, _: Path) -> None:
    off = number(r"flight recorder off\s+{N} tokens/s", out)
    on = number(r"flight recorder on\s+{N} tokens/s", out)
    assert_ratio(number(r"ratio \(on / off\)\s+{N}", out), on, off, 3, 0)
    # one round in the smoke form: its own ratio is the best-of ratio
    assert number(r"median of the rounds own ratios\s+{N}", out) == pytest.approx(
        number(r"ratio \(on / off\)\s+{N}", out), abs=2e-3
    )
    assert "(smoke: tiny model)" in out


SMOKE_SCHEDULES = ("pipe 2 1f1b M=4", "pipe 2 gpipe M=4")  # the equal-remat comparison's pair


def check_pipeline(out: str, _: Path) -> None:
    rows = {
        label: line.split()[-9:]
        for line in out.splitlines()
        for label in ("pipe 1 (baseline)", "pipe 2 gpipe M=4", "pipe 2 1f1b M=4")
        if line.startswith(label)
    }
    assert len(rows) == 3, out  # the smoke form's three layouts and only those
    assert len([line for line in out.splitlines() if line.startswith("pipe ")]) == 4
    for work, planned_work, in_loop, outside, *_ in rows.values():
        # compiled / model FLOPs, and the plan's; pipe bytes only where there is a pipe
        assert 1 <= float(work) == pytest.approx(float(planned_work), rel=0.05)
        assert float(in_loop) >= 0 and float(outside) >= 0
    assert float(rows["pipe 1 (baseline)"][2]) == float(rows["pipe 1 (baseline)"][3]) == 0
    assert float(rows["pipe 2 gpipe M=4"][2]) > 0
    work_1f1b, work_gpipe = (float(rows[label][0]) for label in SMOKE_SCHEDULES)
    rows = {label: row[4:] for label, row in rows.items()}
    for bubble, tokens_per_s, speed_ratio, gib, memory_ratio in rows.values():
        assert positive(float(tokens_per_s.replace(",", "")), float(gib), float(memory_ratio))
        assert positive(float(speed_ratio)) and bubble.endswith("%")
    assert rows["pipe 1 (baseline)"][2] == "1.00" and rows["pipe 1 (baseline)"][4] == "1.00"
    # both memories against pipe 1's, two decimals each: their quotient within rounding
    one_f_one_b, gpipe = float(rows["pipe 2 1f1b M=4"][4]), float(rows["pipe 2 gpipe M=4"][4])
    memory_ratio = number(r"remat none: 1f1b needs {N}x gpipe's XLA memory", out)
    assert positive(memory_ratio)
    assert memory_ratio == pytest.approx(one_f_one_b / gpipe, rel=0.03)
    # the same comparison of compiled work, against the two rows' work columns
    assert number(r"{N}x its compiled work", out) == pytest.approx(
        work_1f1b / work_gpipe, abs=0.01 + 0.01 * work_1f1b / work_gpipe
    )


def check_recovery(out: str, _: Path) -> None:
    measures = ("hang: detection latency", "hang: restart to first step", "wall time")
    for measure in (*measures, "effective training time ratio"):
        match = re.search(
            rf"\| {measure} \| ([\d.]+)(?: s)? \| ([\d.]+)(?: s)? \| ([\d.]+)x \|", out
        )
        assert match, f"no row {measure!r} in:\n{out}"
        with_cache, without, ratio = (float(value) for value in match.groups())
        assert_ratio(ratio, without, with_cache, 2, 2)
    assert number(r"\| effective training time ratio \| {N}", out) <= 1.0
    assert "8 steps" in out and "step deadline 4 s" in out


def check_fault_drill(out: str, _: Path) -> None:
    # the smoke form's one crash, drawn between the saves of steps 4 and 8, and no clean run
    fault_step = int(number(r"a checkpoint every 4; faults: crash@step=([567]),rank=1\n", out))
    assert re.search(r"\| incidents \| - \| 1 \| 1 \|", out), out
    walls = re.findall(r"\| wall time \| - \| ([\d.]+) s \| ([\d.]+) s \|", out)
    assert walls and positive(*(float(wall) for wall in walls[0])), out
    for ratio in re.findall(r"\| effective training time \| - \| ([\d.]+) \| ([\d.]+) \|", out)[0]:
        assert 0.0 < float(ratio) <= 1.0
    assert "12 steps, a checkpoint every 4" in out
    # restored from the disk save of step 4 without snapshots, from memory with them
    crashes = re.findall(
        r"\| 1 \| crash \| 1 \| [\d.]+ s \| [\d.]+ s \|.* \| (\w+) \| (\d+) \|", out
    )
    assert [source for source, _ in crashes] == ["disk", "memory"], out
    lost_without, lost_with = (int(lost) for _, lost in crashes)
    assert lost_without == fault_step - 4 and lost_with <= 1, out
    lost = number(r"\| steps lost per fault \| - \| {N} \|", out)
    assert (lost, number(r"\| steps lost per fault \| - \| [\d.]+ \| {N} \|", out)) == (
        lost_without,
        lost_with,
    )
    summary = "steps lost per fault: {:.2f} without memory snapshots, {:.2f} with them"
    assert summary.format(lost_without, lost_with) in out, out
    with_ett = number(r"memory snapshots / without: {N}", out)
    without_ett = number(r"memory snapshots / without: [\d.]+ / {N}", out)
    row = number(r"\| effective training time \| - \| {N} \|", out)
    assert (without_ett, with_ett) == (
        row,
        number(r"\| effective training time \| - \| [\d.]+ \| {N} \|", out),
    )
    ratio = number(r"memory snapshots / without: [\d.]+ / [\d.]+ = {N}", out)
    assert_ratio(ratio, with_ett, without_ett, 3, 4)


def check_step_overhead(out: str, _: Path) -> None:
    bare = number(r"bare loop over the compiled step\s+{N} tokens/s", out)
    full = number(r"msjax.train loop\s+{N} tokens/s", out)
    assert_ratio(number(r"ratio \(train loop / bare loop\)\s+{N}", out), full, bare, 3, 1)
    assert positive(number(r"CPU MFU of the train loop\s+{N} %", out))
    assert "(smoke: tiny model)" in out


def check_compute_check(out: str, _: Path) -> None:
    bare = number(r"step time, no check\s+{N} ms", out)
    checked = number(r"step time, a check every 4 steps\s+{N} ms", out)
    assert_ratio(number(r"ratio \(check / no check\)\s+{N}", out), checked, bare, 3, 2)
    one = number(r"one check on its own\s+{N} ms", out)
    amortized = number(r"amortized: {N} x the step time", out)
    assert positive(one) and abs(amortized - (1 + one / (4 * bare))) <= 2e-4 + 1e-3 * one / bare
    assert "(smoke: tiny model)" in out


def check_cpu_levers(out: str, _: Path) -> None:
    on = number(r"all on\s+{N}", out)
    off = number(r"all off\s+{N}", out)
    assert_ratio(number(r"all off\s+[\d,.]+\s+{N}", out), on, off, 3, 1)
    assert "(smoke: tiny model)" in out


CHECKS = {
    "agreement_overhead.py": check_agreement_overhead,
    "checkpoint_overhead.py": check_checkpoint_overhead,
    "compute_check.py": check_compute_check,
    "corruption_guard.py": check_corruption_guard,
    "cpu_levers.py": check_cpu_levers,
    "data_throughput.py": check_data_throughput,
    "fault_drill.py": check_fault_drill,
    "generate.py": check_generate,
    "gpu_suite.py": check_gpu_suite,
    "kernels_gpu.py": check_kernels_gpu,
    "memory_snapshots.py": check_memory_snapshots,
    "moe.py": check_moe,
    "observe_overhead.py": check_observe_overhead,
    "pipeline.py": check_pipeline,
    "recovery.py": check_recovery,
    "step_overhead.py": check_step_overhead,
}


def test_every_benchmark_script_has_a_smoke_run() -> None:
    scripts = {path.name for path in BENCHMARKS.glob("*.py")} - HELPER_MODULES
    assert scripts == {smoke.script for smoke in SMOKES} == set(CHECKS)
    without = [name for name in sorted(scripts) if "--smoke" not in (BENCHMARKS / name).read_text()]
    assert without == []  # each documents and takes --smoke


@pytest.mark.parametrize(
    "smoke",
    [
        pytest.param(smoke, id=smoke.script, marks=[pytest.mark.slow] if smoke.slow else [])
        for smoke in SMOKES
    ],
)
def test_benchmark_smoke_form_runs_and_prints_its_measurements(
    smoke: Smoke, tmp_path: Path
) -> None:
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in smoke.args]
    # as a user's machine runs them: without conftest.py's compilation cache for the tests' jobs
    # (recovery.py's job without caches would load from it)
    env = {name: value for name, value in job_env().items() if not name.startswith(JAX_CACHE)}
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / smoke.script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    CHECKS[smoke.script](result.stdout, tmp_path)
