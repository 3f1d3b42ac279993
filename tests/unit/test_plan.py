"""The dry run: the analytical memory model against XLA, the 175B plan, the Table 2 prediction.

XLA's side compiles on the eight simulated devices; the tiny programs are the ones
`tests/unit/test_sweep.py` runs (compiles are cached per process, so each is built once).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import pytest
from jax.sharding import AbstractMesh, AxisType

from msjax.config import ModelConfig, load_config
from msjax.parallel.mesh import MESH_AXES
from msjax.plan import main
from msjax.planner.aot import compile_step
from msjax.planner.candidates import MeshShape, config_for_mesh, parse_mesh, valid_meshes
from msjax.planner.communication import estimate_communication
from msjax.planner.planning import estimate_memory
from msjax.planner.prediction import (
    MEGASCALE_TABLE2,
    Hardware,
    compare_with_table2,
    predict_mesh_step,
)
from msjax.step import build_program

TINY = load_config("configs/tiny.yaml", ["train.global_batch=8"])
SMALL = load_config("configs/small.yaml", ["train.global_batch=8"])
MEGASCALE = load_config("configs/megascale_175b.yaml")
TINY_MESHES = ["1,1,1", "8,1,1", "4,2,1", "2,4,1", "2,2,2"]  # as in test_sweep
SMALL_MESHES = ["8,1,1", "2,4,1", "2,2,2", "1,2,4"]  # 12 heads: no tensor 8


def _model_over_xla(config, mesh_text: str) -> float:
    mesh = parse_mesh(mesh_text)
    xla = compile_step(config, mesh).memory
    assert xla is not None and xla.total_bytes > 0
    return estimate_memory(config, mesh, platform="cpu").total_bytes / xla.total_bytes


@pytest.mark.parametrize("mesh", TINY_MESHES)
def test_memory_model_is_within_10_percent_of_xla_for_tiny(mesh):
    assert _model_over_xla(TINY, mesh) == pytest.approx(1.0, abs=0.10)


@pytest.mark.parametrize("mesh", SMALL_MESHES)
def test_memory_model_is_within_10_percent_of_xla_for_small(mesh):
    assert _model_over_xla(SMALL, mesh) == pytest.approx(1.0, abs=0.10)


CIRCULAR = "pipeline.schedule=circular pipeline.repeats=2"
ONE_F_ONE_B = "pipeline.schedule=1f1b"
# name: (config file, data,fsdp,pipe,tensor, overrides): every schedule, one to four
# microbatches, every remat policy, with data, tensor or fsdp beside the pipe axis
PIPE_CASES = {
    "tiny-pipe2-data4-gpipe-m1": ("tiny", "4,1,2,1", "pipeline.microbatches=1"),
    "tiny-pipe2-tensor2-gpipe-m2-dots": (
        "tiny",
        "2,1,2,2",
        "pipeline.microbatches=2 model.remat=dots",
    ),
    "tiny-pipe2-tensor2-circular-m4": ("tiny", "2,1,2,2", f"{CIRCULAR} pipeline.microbatches=4"),
    "tiny-pipe2-fsdp2-tensor2-gpipe-m2": ("tiny", "1,2,2,2", "pipeline.microbatches=2"),
    # the stage's weights gathered over fsdp once, before the loop (see GATHER_ONCE_CASES)
    "tiny-pipe2-fsdp2-tensor2-gpipe-m2-gather-once": (
        "tiny",
        "1,2,2,2",
        "pipeline.microbatches=2 pipeline.fsdp_gather=once",
    ),
    "tiny-pipe2-fsdp2-tensor2-circular-m4-full": (
        "tiny",
        "1,2,2,2",
        f"{CIRCULAR} pipeline.microbatches=4 model.remat=full",
    ),
    "tiny-pipe4-data2-gpipe-m2": ("tiny", "2,1,4,1", "pipeline.microbatches=2"),
    "tiny-pipe2-data2-tensor2-1f1b-m4": (
        "tiny",
        "2,1,2,2",
        f"{ONE_F_ONE_B} pipeline.microbatches=4",
    ),
    "tiny-pipe4-data2-1f1b-m4-full": (
        "tiny",
        "2,1,4,1",
        f"{ONE_F_ONE_B} pipeline.microbatches=4 model.remat=full",
    ),
    "small-pipe2-data2-tensor2-1f1b-m4": (
        "small",
        "2,1,2,2",
        f"{ONE_F_ONE_B} pipeline.microbatches=4",
    ),
    "small-pipe2-tensor2-circular-m4-full": (
        "small",
        "2,1,2,2",
        f"{CIRCULAR} pipeline.microbatches=4 model.remat=full",
    ),
}


# Held out: none of the model's coefficients was fitted to these: large vocabularies, bfloat16,
# fsdp beside 1F1B, sequence parallelism and data with fsdp beside the pipe axis. Same overrides
# as tests/unit/test_communication_model.py's HELD_OUT, so each program compiles once per process.
HELD_OUT_PIPE_CASES = {
    "tiny-vocab32k-pipe2-data2-tensor2-gpipe-m4": (
        "tiny",
        "2,1,2,2",
        "pipeline.microbatches=4 model.vocab_size=32768",
    ),
    "tiny-vocab128k-pipe2-data2-tensor2-1f1b-m4": (
        "tiny",
        "2,1,2,2",
        f"{ONE_F_ONE_B} pipeline.microbatches=4 model.vocab_size=131072",
    ),
    "tiny-bf16-pipe2-fsdp2-tensor2-gpipe-m2": (
        "tiny",
        "1,2,2,2",
        "pipeline.microbatches=2 model.compute_dtype=bfloat16",
    ),
    "tiny-pipe2-fsdp2-tensor2-1f1b-m4": (
        "tiny",
        "1,2,2,2",
        f"{ONE_F_ONE_B} pipeline.microbatches=4",
    ),
    "tiny-pipe2-data2-tensor2-seqpar-gpipe-m4": (
        "tiny",
        "2,1,2,2",
        "pipeline.microbatches=4 mesh.sequence_parallel=true",
    ),
    "tiny-pipe2-data2-fsdp2-gpipe-m2": ("tiny", "2,2,2,1", "pipeline.microbatches=2"),
}
# pipeline.fsdp_gather=once: the stage's float32 weights whole through the loop (the schedules'
# gathered_weight_copies were counted on these; the same programs as test_communication_model's
# FSDP_GATHERS). Planned with the weights as per iteration, these two read 0.82 and 0.86 of XLA.
# The gpipe case is in PIPE_CASES.
GATHER_ONCE_CASES = {
    "tiny-pipe2-fsdp2-tensor2-circular-m4-full-gather-once": (
        "tiny",
        "1,2,2,2",
        f"{CIRCULAR} pipeline.microbatches=4 model.remat=full pipeline.fsdp_gather=once",
    ),
    "tiny-pipe2-fsdp2-tensor2-1f1b-m4-gather-once": (
        "tiny",
        "1,2,2,2",
        f"{ONE_F_ONE_B} pipeline.microbatches=4 pipeline.fsdp_gather=once",
    ),
}
HELD_OUT_MEMORY_XFAIL = {
    "tiny-bf16-pipe2-fsdp2-tensor2-gpipe-m2": (
        "planned 22.65 MB, XLA 33.30 MB (0.68): XLA's CPU backend keeps the bfloat16 step's "
        "buffers as wide as float32's (the float32 step: 33.59 MB; off the pipe, data 2 x "
        "fsdp 2 x tensor 2: bfloat16 21.60 MB, float32 21.04 MB), so the planned narrow "
        "activations are a GPU's, not this compile's"
    ),
}


def _held_out_memory_params():
    for case in HELD_OUT_PIPE_CASES:
        marks = [pytest.mark.slow]
        if case in HELD_OUT_MEMORY_XFAIL:
            marks.append(pytest.mark.xfail(strict=True, reason=HELD_OUT_MEMORY_XFAIL[case]))
        yield pytest.param(case, marks=marks, id=case)


@pytest.mark.parametrize("case", list(PIPE_CASES))
def test_memory_model_is_within_10_percent_of_xla_on_pipe_meshes(case):
    name, mesh, overrides = PIPE_CASES[case]
    config = load_config(f"configs/{name}.yaml", ["train.global_batch=8", *overrides.split()])
    assert _model_over_xla(config, mesh) == pytest.approx(1.0, abs=0.10)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(GATHER_ONCE_CASES))
def test_memory_model_is_within_10_percent_of_xla_with_the_stages_weights_gathered_once(case):
    name, mesh, overrides = GATHER_ONCE_CASES[case]
    config = load_config(f"configs/{name}.yaml", ["train.global_batch=8", *overrides.split()])
    assert _model_over_xla(config, mesh) == pytest.approx(1.0, abs=0.10)


@pytest.mark.parametrize("case", _held_out_memory_params())
def test_memory_model_is_within_10_percent_of_xla_on_held_out_pipe_meshes(case):
    name, mesh, overrides = HELD_OUT_PIPE_CASES[case]
    config = load_config(f"configs/{name}.yaml", ["train.global_batch=8", *overrides.split()])
    assert _model_over_xla(config, mesh) == pytest.approx(1.0, abs=0.10)


def test_state_bytes_equal_jax_shardings_for_175b_on_an_abstract_12288_device_mesh():
    mesh = MeshShape(192, 8, 8)
    config = config_for_mesh(MEGASCALE, mesh)
    sizes = tuple(mesh.sizes()[axis] for axis in MESH_AXES)
    abstract = AbstractMesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    state = build_program(config, abstract).abstract_state()  # no devices needed
    jax_bytes = sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(state)
    )
    assert estimate_memory(MEGASCALE, mesh).state_bytes == jax_bytes
    assert jax_bytes == pytest.approx(175e9 * 12 / 64, rel=0.02)  # float32 params + 2 moments


def test_175b_plan_prices_the_papers_shape_and_lowers_without_devices(capsys):
    argv = ["--config", "configs/megascale_175b.yaml", "--devices", "12288", "--memory-gib", "80"]
    # the fused loss named: `auto` on GPU runs XLA's loss (logits held) until device figures
    # show the Pallas loss at least as fast
    argv.append("model.loss_impl=pallas")
    assert main([*argv, "--top", "5", "--lower"]) == 0
    printed = capsys.readouterr().out
    # the paper's layout: data 192 x pipe 8 x tensor 8. The pipeline loop's float32 copy of a
    # device's 12 layers of weights (10 GiB) takes it past the 10% headroom the recommendation
    # keeps, though it fits (the head and the pipeline's streams hold 1/8 of its tokens)
    own = next(line for line in printed.splitlines() if line.strip().startswith("192,1,8,8*"))
    state, total = float(own.split()[1]), float(own.split()[5])
    assert 32 < state < 33 and 72 < total < 78 and " yes " in own
    recommended = next(line for line in printed.splitlines() if line.startswith("recommended"))
    assert " x pipe " in recommended  # a pipelined mesh: fsdp across nodes gathers too much
    lowered = next(line for line in printed.splitlines() if line.startswith("lowered"))
    assert "abstract 12288-device mesh" in lowered
    put, model = re.findall(r"([0-9.]+) GiB", lowered)[:2]
    assert put == model and 25 < float(put) < 40  # JAX's shardings agree with the model


def test_175b_memory_falls_as_fsdp_grows():
    totals = [
        estimate_memory(MEGASCALE, MeshShape(12288 // (8 * fsdp), fsdp, 8)).total_bytes
        for fsdp in (8, 16, 32, 64)
    ]
    assert totals == sorted(totals, reverse=True)
    assert totals[0] < 80 * 2**30


def test_flash_attention_on_gpus_keeps_no_score_matrices():
    if "attention_impl" not in {field.name for field in dataclasses.fields(ModelConfig)}:
        pytest.skip("this msjax has no attention kernels")
    mesh = MeshShape(2, 2, 2)
    flash = dataclasses.replace(
        TINY, model=dataclasses.replace(TINY.model, attention_impl="pallas")
    )
    reference = estimate_memory(TINY, mesh, platform="cpu")
    kernel = estimate_memory(flash, mesh, platform="gpu")
    batch, heads, seq = 8 // 4, 8 // 2, 128  # per device on data 2 x fsdp 2 x tensor 2
    scores = TINY.model.num_layers * 2 * batch * heads * seq * seq * 4  # scores and softmax
    assert reference.activations_bytes - kernel.activations_bytes > 0.95 * scores
    xla_model = dataclasses.replace(TINY.model, attention_impl="xla", loss_impl="xla")
    forced = dataclasses.replace(TINY, model=xla_model)
    assert estimate_memory(forced, mesh, platform="gpu") == reference


def test_the_fused_loss_on_gpus_keeps_no_logits():
    mesh = MeshShape(2, 2, 2)
    big_vocab = dataclasses.replace(TINY.model, vocab_size=32768, attention_impl="xla")
    xla = dataclasses.replace(TINY, model=dataclasses.replace(big_vocab, loss_impl="xla"))
    fused = dataclasses.replace(TINY, model=dataclasses.replace(big_vocab, loss_impl="pallas"))
    batch, seq, vocab = 8 // 4, 128, 32768 // 2  # per device on data 2 x fsdp 2 x tensor 2
    logits = batch * seq * vocab * 4  # one float32 [batch, seq, vocab] buffer
    reference, kernel = estimate_memory(xla, mesh, "gpu"), estimate_memory(fused, mesh, "gpu")
    assert reference.activations_bytes - kernel.activations_bytes > 0.95 * logits
    assert reference.working_bytes - kernel.working_bytes > 1.4 * logits  # 2 buffers - 1 chunk
    auto = dataclasses.replace(TINY, model=big_vocab)  # loss_impl auto: XLA's loss on GPU too
    assert estimate_memory(auto, mesh, "gpu") == reference


def test_communication_volume_follows_the_axes():
    tiny = estimate_communication(TINY, MeshShape(1, 1, 1))
    assert tiny.total_bytes == 0
    data_only = estimate_communication(TINY, MeshShape(8, 1, 1))
    assert data_only.data_bytes > 0 and data_only.fsdp_bytes == data_only.tensor_bytes == 0
    mixed = estimate_communication(TINY, MeshShape(2, 2, 2))
    assert mixed.pipe_bytes == 0
    assert min(mixed.tensor_bytes, mixed.fsdp_bytes, mixed.data_bytes) > 0
    two_microbatches = load_config(
        "configs/tiny.yaml", ["train.global_batch=8", "pipeline.microbatches=2"]
    )
    pipelined = estimate_communication(two_microbatches, MeshShape(2, 2, 1, pipe=2))
    assert pipelined.tensor_bytes == 0 and min(pipelined.fsdp_bytes, pipelined.data_bytes) > 0
    # 3 iterations (M + P - 1) of one-sequence microbatches, forward and backward: each stage's
    # output on (stage 1 sends nothing on) and a column of the stage-held streams back (stage 0
    # sends nothing back), so one microbatch per device each way; then, once, the gradients of
    # the tables outside the layer stack (embedding, unembedding, final norm; float32, split
    # over fsdp 2) summed as XLA compiles it: the whole tables reduce-scattered over data x fsdp
    # x pipe (8 devices), then a device's fsdp shard all-gathered over data x pipe (4 devices)
    model = two_microbatches.model
    stream = two_microbatches.data.seq_len * model.embed_dim * 4  # float32
    tables = (2 * model.vocab_size * model.embed_dim + model.embed_dim) * 4 / 2
    table_grads = (8 - 1) / 8 * 2 * tables + (4 - 1) / 4 * tables
    assert pipelined.pipe_bytes == 2 * 3 * stream + table_grads


def test_pipeline_bubble_is_priced_in_the_prediction():
    hardware = Hardware()
    few = predict_mesh_step(MEGASCALE, MeshShape(4, 1, 8, pipe=8), hardware)
    config = load_config("configs/megascale_175b.yaml", ["pipeline.repeats=1"])
    gpipe = predict_mesh_step(config, MeshShape(4, 1, 8, pipe=8), hardware)
    # circular: (P-1)/(R M) of the compute idle; gpipe R = 1, six times the bubble
    assert few.bubble_s == pytest.approx(few.compute_s * 7 / (6 * 32))
    assert gpipe.bubble_s == pytest.approx(6 * few.bubble_s)
    # 1F1B: P - 1 idle forward-backward pairs per stage, as gpipe's P - 1 idle forwards and
    # backwards, and no recompute under remat none
    overrides = ["pipeline.repeats=1", "pipeline.schedule=1f1b", "model.remat=none"]
    one_f_one_b = load_config("configs/megascale_175b.yaml", overrides)
    interleaved = predict_mesh_step(one_f_one_b, MeshShape(4, 1, 8, pipe=8), hardware)
    plain = predict_mesh_step(
        load_config("configs/megascale_175b.yaml", ["pipeline.repeats=1", "model.remat=none"]),
        MeshShape(4, 1, 8, pipe=8),
        hardware,
    )
    assert interleaved.compute_s == pytest.approx(plain.compute_s)
    assert interleaved.bubble_s == pytest.approx(interleaved.compute_s * 7 / 32)


def test_prediction_sits_beside_megascale_table2(capsys):
    comparisons = compare_with_table2(MEGASCALE, Hardware())
    assert [c.row.gpus for c in comparisons] == [row.gpus for row in MEGASCALE_TABLE2]
    for comparison in comparisons:
        paper = comparison.paper_layout
        assert paper.serial_s >= paper.overlapped_s > 0
        assert 0.3 < paper.mfu(paper.serial_s) <= paper.mfu(paper.overlapped_s) < 0.7
    first_four = [c.paper_layout.serial_s for c in comparisons[:4]]  # batch 768, more GPUs
    assert first_four == sorted(first_four, reverse=True)
    assert main(["--config", "configs/megascale_175b.yaml", "--predict"]) == 0
    printed = capsys.readouterr().out
    assert "12288   6144 |   8.6s  41.2%   6.3s  55.2%" in printed
    assert "agreement:" in printed


def test_candidate_meshes_pass_the_config_checks():
    meshes = valid_meshes(TINY, 8)
    assert MeshShape(2, 2, 2) in meshes and MeshShape(1, 1, 8) in meshes
    assert all(mesh.devices == 8 for mesh in meshes)
    assert MeshShape(1, 1, 8) not in valid_meshes(SMALL, 8)  # 12 heads do not split 8 ways


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--devices", "7"], "no mesh of 7 devices"),
        (["--devices", "128", "--xla"], "drop --xla"),
        (["--devices", "8", "--memory-gib", "0"], "--memory-gib=0"),
        ([], "--devices is required"),
    ],
)
def test_impossible_plans_are_rejected_with_one_line(argv, named, capsys):
    assert main(["--config", "configs/tiny.yaml", *argv]) == 2
    error_lines = capsys.readouterr().err.strip().splitlines()
    assert len(error_lines) == 1
    assert error_lines[0].startswith("msjax.plan: error:")
    assert named in error_lines[0]


def test_four_numbers_name_a_pipe_mesh_and_three_mean_pipe_one():
    assert parse_mesh("2,1,2,2") == MeshShape(2, 1, 2, pipe=2)
    assert str(parse_mesh("2,1,2,2")) == "2,1,2,2" and str(parse_mesh("2,2,2")) == "2,2,2"
    assert parse_mesh("2,2,2").pipe == 1
    pipelined = load_config(
        "configs/tiny.yaml", ["train.global_batch=8", "mesh.pipe=2", "pipeline.microbatches=2"]
    )
    meshes = valid_meshes(pipelined, 8, "cpu")
    assert any(mesh.pipe == 2 for mesh in meshes)  # auto tries pipe sizes when asked for one
    assert all(mesh.pipe == 1 for mesh in valid_meshes(TINY, 8, "cpu"))


def test_moe_plans_propose_expert_meshes_and_mark_the_configs_own(capsys):
    mixtral = load_config("configs/mixtral_8x7b.yaml")
    meshes = valid_meshes(mixtral, 64)
    experts = {mesh.expert for mesh in meshes}
    assert experts == {1, 2, 4, 8}  # each divides the 8 experts and the 64 devices
    assert all(mesh.devices == 64 for mesh in meshes)
    assert {mesh.expert for mesh in valid_meshes(TINY, 8)} == {1}  # a dense model: none
    argv = ["--config", "configs/mixtral_8x7b.yaml", "--devices", "64", "--memory-gib", "80"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.strip().startswith("mesh d,f,t"))
    assert header.split()[2] == "expert" and header.count("expert") == 2  # size and bytes
    # the config's own mesh: data -1 (2) x fsdp 16 x expert 2, the one the plan recommends
    own = next(line for line in lines if line.strip().startswith("2,16,1*"))
    assert own.split()[1] == "2"
    exchanged = float(own.split("|")[1].split()[2])  # GiB over expert per step
    assert exchanged > 0
    recommended = [line for line in lines if line.startswith("recommended: ")]
    assert (
        recommended == [recommended[0]] and "2,16,1 (data 2 x fsdp 16 x expert 2" in recommended[0]
    )


# Expert-parallel MoE: configs/tiny_moe.yaml with one dense and one MoE layer (8 experts, top-2)
TINY_MOE = load_config(
    "configs/tiny_moe.yaml", ["train.global_batch=8", "model.num_layers=2", "mesh.tensor=1"]
)
EXPERT_MESHES = {
    "data4-expert2": MeshShape(data=4, fsdp=1, tensor=1, expert=2),
    "data2-expert4": MeshShape(data=2, fsdp=1, tensor=1, expert=4),
    "data2-fsdp2-expert2": MeshShape(data=2, fsdp=2, tensor=1, expert=2),
}


@pytest.mark.parametrize(
    "name",
    # the fast tier compiles the mesh with fsdp beside expert; the others run with the slow tests
    [
        n if n == "data2-fsdp2-expert2" else pytest.param(n, marks=pytest.mark.slow)
        for n in EXPERT_MESHES
    ],
)
def test_memory_model_is_within_10_percent_of_xla_on_expert_meshes(name):
    """The experts, their gradients and moments split over `expert`; the exchange's dense
    buffers kept by each MoE layer for its backward pass."""
    mesh = EXPERT_MESHES[name]
    xla = compile_step(TINY_MOE, mesh).memory
    assert xla is not None
    planned = estimate_memory(TINY_MOE, mesh, platform="cpu")
    assert planned.total_bytes / xla.total_bytes == pytest.approx(1.0, abs=0.10)
