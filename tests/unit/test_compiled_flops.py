"""The compiled step's dot FLOPs (msjax.observe.compiled_flops) against the planner's compute model
(msjax.planner.compute): compiled FLOPs / model FLOPs per mesh, schedule and remat policy.

Programs compile on the eight simulated devices, cached per process with the other planner tests.
"""

from __future__ import annotations

import json

import jax
import pytest

from msjax.config import load_config
from msjax.observe.compiled_flops import compiled_flops
from msjax.observe.flops import flops_per_step
from msjax.plan import main as plan_main
from msjax.planner.aot import compile_step
from msjax.planner.candidates import parse_mesh
from msjax.planner.compute import estimate_compute
from msjax.sweep import main as sweep_main

# A step whose outer loop runs 3 times (XLA's annotation) around an inner loop whose trip count
# only its condition says (i < 4), beside a dot in a fusion outside both loops and a
# convolution in the outer body. Operands of the inner dot are printed bare (no shapes).
NESTED_LOOPS_HLO = """\
HloModule jit_train_step, entry_computation_layout={(f32[8,32]{1,0})->f32[8,16]{1,0}}

%inner_cond (p: (s32[], f32[8,32])) -> pred[] {
  %p = (s32[], f32[8,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%inner_body (p: (s32[], f32[8,32])) -> (s32[], f32[8,32]) {
  %p = (s32[], f32[8,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,32]{1,0} get-tuple-element(%p), index=1
  %w = f32[32,32]{1,0} constant({...})
  %y = f32[8,32]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,32]{1,0}) tuple(%next, %y)
}

%outer_cond (p: (s32[], f32[8,32])) -> pred[] {
  %p = (s32[], f32[8,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (p: (s32[], f32[8,32])) -> (s32[], f32[8,32]) {
  %p = (s32[], f32[8,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,32]{1,0} get-tuple-element(%p), index=1
  %zero = s32[] constant(0)
  %start = (s32[], f32[8,32]{1,0}) tuple(%zero, %x)
  %loop = (s32[], f32[8,32]{1,0}) while(%start), condition=%inner_cond, body=%inner_body
  %y = f32[8,32]{1,0} get-tuple-element(%loop), index=1
  %image = f32[2,6,6,4]{3,2,1,0} reshape(f32[8,32]{1,0} %y)
  %kernel = f32[3,3,4,5]{3,2,1,0} constant({...})
  %conv = f32[2,4,4,5]{3,2,1,0} convolution(f32[2,6,6,4]{3,2,1,0} %image, f32[3,3,4,5]{3,2,1,0} %kernel), window={size=3x3}, dim_labels=b01f_01io->b01f
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,32]{1,0}) tuple(%next, %y)
}

%fused_projection (a: f32[8,32], b: f32[32,16]) -> f32[8,16] {
  %a = f32[8,32]{1,0} parameter(0)
  %b = f32[32,16]{1,0} parameter(1)
  ROOT %d = f32[8,16]{1,0} dot(f32[8,32]{1,0} %a, f32[32,16]{1,0} %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[8,32]) -> f32[8,16] {
  %x = f32[8,32]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %start = (s32[], f32[8,32]{1,0}) tuple(%zero, %x)
  %loop = (s32[], f32[8,32]{1,0}) while(%start), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[8,32]{1,0} get-tuple-element(%loop), index=1
  %w = f32[32,16]{1,0} constant({...})
  ROOT %out = f32[8,16]{1,0} fusion(%y, %w), kind=kOutput, calls=%fused_projection
}
"""  # noqa: E501 (HLO lines as XLA prints them)


def test_dot_and_convolution_flops_multiply_through_nested_loops():
    inner_dot = 2 * 8 * 32 * 32  # 2 x output [8, 32] x contracting 32
    convolution = 2 * (2 * 4 * 4 * 5) * (3 * 3 * 4)  # 2 x output x kernel per output feature
    fused_dot = 2 * 8 * 16 * 32
    counted = compiled_flops(NESTED_LOOPS_HLO)
    assert counted.instructions == 3
    assert counted.in_loops == 3 * 4 * inner_dot + 3 * convolution
    assert counted.total == 3 * 4 * inner_dot + 3 * convolution + fused_dot


def test_a_batched_dot_counts_its_batch_dims_once():
    line = (
        "  %s = f32[2,4,8,8]{3,2,1,0} dot(f32[2,4,8,16]{3,2,1,0} %q, f32[2,4,8,16]{3,2,1,0} %k), "
        "lhs_batch_dims={0,1}, lhs_contracting_dims={3}, rhs_batch_dims={0,1}, "
        "rhs_contracting_dims={3}"
    )
    text = f"ENTRY %main () -> f32[2,4,8,8] {{\n{line}\n}}\n"
    assert compiled_flops(text).total == 2 * (2 * 4 * 8 * 8) * 16


def test_a_gpu_cublas_gemm_counts_as_the_dot_it_replaces():
    gemm = (
        "  %gemm = (f32[512,384]{1,0}, s8[4194304]{0}) custom-call(f32[512,128]{1,0} %x, "
        'f32[128,384]{1,0} %w), custom_call_target="__cublas$gemm", backend_config={'
        '"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{'
        '"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],'
        '"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}'
    )
    other = '  %norm = f32[512,128]{1,0} custom-call(%x), custom_call_target="rms_norm"'
    text = f"ENTRY %main () -> f32[512,384] {{\n{gemm}\n{other}\n}}\n"
    counted = compiled_flops(text)
    assert (counted.total, counted.instructions) == (2 * 512 * 384 * 128, 1)


CIRCULAR = "pipeline.schedule=circular pipeline.repeats=2"


# name: (data,fsdp,tensor or data,fsdp,pipe,tensor, overrides) on configs/tiny.yaml (float32)
MESHES = {
    "one-device": ("1,1,1", ""),
    "data2-fsdp2-tensor2": ("2,2,2", ""),
    "fsdp8": ("1,8,1", ""),
    "pipe2-data2-tensor2-gpipe-m4": ("2,1,2,2", "pipeline.microbatches=4"),
    "pipe2-data2-tensor2-circular-m4": ("2,1,2,2", f"{CIRCULAR} pipeline.microbatches=4"),
    "pipe2-data2-tensor2-1f1b-m4": ("2,1,2,2", "pipeline.schedule=1f1b pipeline.microbatches=4"),
    # one layer per stage: no layer scan inside the stage
    "pipe4-tensor2-1f1b-m8": ("1,1,4,2", "pipeline.schedule=1f1b pipeline.microbatches=8"),
    "pipe2-fsdp2-tensor2-gpipe-m2": ("1,2,2,2", "pipeline.microbatches=2"),
}


SLOW_MESHES = ("pipe4-tensor2-1f1b-m8", "pipe2-fsdp2-tensor2-gpipe-m2")  # ~15 s per compile


def _planned_and_compiled(name: str, remat: str):
    mesh_text, overrides = MESHES[name]
    config = load_config(
        "configs/tiny.yaml", ["train.global_batch=8", f"model.remat={remat}", *overrides.split()]
    )
    mesh = parse_mesh(mesh_text)
    planned = estimate_compute(config, mesh, jax.default_backend())
    step = compile_step(config, mesh)
    return planned, step.flops.total * mesh.devices / flops_per_step(step.config)


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.slow] if name in SLOW_MESHES else [])
        for name in MESHES
    ],
)
def test_planned_flops_ratio_is_within_5_percent_of_the_compiled_step(name, remat):
    planned, compiled_ratio = _planned_and_compiled(name, remat)
    assert planned.ratio == pytest.approx(compiled_ratio, rel=0.05)


def test_full_remat_recomputes_and_1f1b_does_one_forward_and_one_backward():
    """Full remat recomputes each layer's forward but its last projection; 1F1B runs each stage
    once forward and once backward per microbatch (its idle stages branch to nothing, and the
    last stage alone runs the head), so its work is the straight step's; gpipe's pipe ranks
    compute on zeros in the bubble and each run 1 / P of the head."""
    straight_none, compiled_none = _planned_and_compiled("one-device", "none")
    _, compiled_full = _planned_and_compiled("one-device", "full")
    assert 1.2 < compiled_full / compiled_none < 4 / 3
    gpipe, compiled_gpipe = _planned_and_compiled("pipe2-data2-tensor2-gpipe-m4", "none")
    _, compiled_1f1b = _planned_and_compiled("pipe2-data2-tensor2-1f1b-m4", "none")
    assert compiled_1f1b == pytest.approx(compiled_none, rel=0.01)
    assert compiled_1f1b < compiled_gpipe / 1.2
    # the head's tokens split over the devices with a pipe as without one (the compiled
    # figure: tests/unit/test_pipeline_work.py)
    assert gpipe.head_flops * 8 == pytest.approx(straight_none.head_flops, rel=1e-9)


def test_the_sweep_reports_compiled_over_model_flops_beside_the_plan(tmp_path, capsys):
    argv = ["--config", "configs/tiny.yaml", "--meshes", "1,1,1", "--steps", "1"]
    assert sweep_main([*argv, "--out", str(tmp_path), "train.global_batch=8"]) == 0
    (record,) = map(json.loads, (tmp_path / "sweep.jsonl").read_text().splitlines())
    planned, compiled_ratio = _planned_and_compiled("one-device", "none")
    assert record["work_ratio"] == pytest.approx(compiled_ratio, rel=1e-9)
    assert record["planned_work_ratio"] == pytest.approx(planned.ratio, rel=1e-9)
    # float32 XLA attention computes every [seq, seq] score: more than the model's causal half
    assert 1.05 < record["work_ratio"] < 1.10
    assert f"compiled/model FLOPs {compiled_ratio:.3f} (plan {planned.ratio:.3f})" in (
        capsys.readouterr().out
    )


def test_the_plans_xla_check_reports_compiled_over_model_flops(capsys):
    argv = ["--config", "configs/tiny.yaml", "--devices", "1", "--xla", "train.global_batch=8"]
    assert plan_main(argv) == 0
    printed = capsys.readouterr().out
    planned, compiled_ratio = _planned_and_compiled("one-device", "none")
    assert f"compiled/model FLOPs {compiled_ratio:.3f} (plan {planned.ratio:.3f})" in printed
    (row,) = [line for line in printed.splitlines() if line.strip().startswith("1,1,1")]
    work, xla_work = (float(value) for value in row.split("|")[0].split()[-2:])
    assert (work, xla_work) == (round(planned.ratio, 2), round(compiled_ratio, 2))


def test_planned_flops_of_remats_that_keep_the_matmuls_are_within_5_percent():
    """At seq 512 the attention is a large share of the work; "dots" runs its two matmuls again
    in the backward, "attention" keeps attention's output, so only the scores' matmul runs again."""
    compiled = {}
    for remat in ("dots", "attention"):
        config = load_config(
            "configs/tiny.yaml",
            ["train.global_batch=4", "data.seq_len=512", f"model.remat={remat}"],
        )
        mesh = parse_mesh("1,1,1")
        planned = estimate_compute(config, mesh, jax.default_backend())
        step = compile_step(config, mesh)
        compiled[remat] = step.flops.total / flops_per_step(step.config)
        assert planned.ratio == pytest.approx(compiled[remat], rel=0.05)
    assert compiled["attention"] < compiled["dots"] - 0.03  # 1.11 against 1.16
