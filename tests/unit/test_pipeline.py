"""Pipeline parallelism changes where layers run, never what they compute: every pipe mesh and
schedule trains like the same global batch without a pipe axis, and checkpoints move between them.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest
from mesh_runs import fixed_batches, packed_batches, small_config, train_program
from small_runs import QUICK_RUN

from msjax.config import load_config
from msjax.observe.memory import CompiledMemory, compiled_memory
from msjax.observe.metrics import read_metrics
from msjax.parallel.mesh import build_mesh
from msjax.parallel.pipeline import (
    PipelineLayout,
    run_pipeline,
    to_canonical_order,
    to_memory_order,
)
from msjax.parallel.schedules import BACKWARD, FORWARD, IDLE, one_f_one_b_pairs
from msjax.resolve import resolve
from msjax.step import build_program
from msjax.train import train

FOUR_LAYERS = {"num_layers": 4}
PARALLEL_WINDOWED = {"num_layers": 4, "parallel_block": True, "attention_window": 8}
# the embedding table takes gradients from the lookup and, through 1F1B's head, the loss
TIED_REMAT = {"num_layers": 4, "tied_embeddings": True, "remat": "full"}


def circular(microbatches: int, repeats: int = 2) -> dict:
    return {"schedule": "circular", "microbatches": microbatches, "repeats": repeats}


def gpipe(microbatches: int) -> dict:
    return {"schedule": "gpipe", "microbatches": microbatches}


def one_f_one_b(microbatches: int) -> dict:
    return {"schedule": "1f1b", "microbatches": microbatches}


def once(pipeline: dict) -> dict:
    return {**pipeline, "fsdp_gather": "once"}


# (data, fsdp, pipe, tensor, sequence_parallel), model overrides, pipeline section
CASES = {
    "pipe2-data2-tensor2-gpipe-m2": ((2, 1, 2, 2, False), FOUR_LAYERS, gpipe(2)),
    "pipe2-data2-tensor2-circular-m4": ((2, 1, 2, 2, False), FOUR_LAYERS, circular(4)),
    "pipe4-data2-gpipe-m4": ((2, 1, 4, 1, False), FOUR_LAYERS, gpipe(4)),
    # fewer microbatches than stages: two stages' streams hold none
    "pipe4-data2-gpipe-m2": ((2, 1, 4, 1, False), FOUR_LAYERS, gpipe(2)),
    "pipe4-data2-circular-m8": ((2, 1, 4, 1, False), {"num_layers": 8}, circular(8)),
    "pipe2-fsdp2-tensor2-seqpar-gpipe-m8": ((1, 2, 2, 2, True), FOUR_LAYERS, gpipe(8)),
    "pipe2-fsdp2-tensor2-seqpar-circular-m2": ((1, 2, 2, 2, True), FOUR_LAYERS, circular(2)),
    "pipe2-data2-tensor2-parallel-window-circular-m4": (
        (2, 1, 2, 2, False),
        PARALLEL_WINDOWED,
        circular(4),
    ),
    "pipe2-data2-tensor2-1f1b-m4": ((2, 1, 2, 2, False), FOUR_LAYERS, one_f_one_b(4)),
    # Qwen3's per-head query/key norm: its scales stacked with the layers, split over the stages
    "pipe2-fsdp2-tensor2-seqpar-qk-norm-1f1b-m4": (
        (1, 2, 2, 2, True),
        {"num_layers": 4, "qk_norm": True},
        one_f_one_b(4),
    ),
    "pipe4-data2-tied-remat-1f1b-m8": ((2, 1, 4, 1, False), TIED_REMAT, one_f_one_b(8)),
    "pipe2-fsdp2-tensor2-seqpar-1f1b-m4": ((1, 2, 2, 2, True), FOUR_LAYERS, one_f_one_b(4)),
    "pipe2-data2-tensor2-parallel-window-1f1b-m4": (
        (2, 1, 2, 2, False),
        PARALLEL_WINDOWED,
        one_f_one_b(4),
    ),
    # the stage's weights gathered over fsdp before the loop, each fsdp rank its own copy
    # through it (pipeline.fsdp_gather=once): the same numbers as gathering them per iteration
    "pipe2-fsdp2-tensor2-gpipe-m4-gather-once": ((1, 2, 2, 2, False), FOUR_LAYERS, once(gpipe(4))),
    "pipe2-data2-fsdp2-circular-m4-gather-once": (
        (2, 2, 2, 1, False),
        FOUR_LAYERS,
        once(circular(4)),
    ),
    "pipe2-fsdp2-tensor2-seqpar-1f1b-m4-gather-once": (
        (1, 2, 2, 2, True),
        FOUR_LAYERS,
        once(one_f_one_b(4)),
    ),
}


def config_of(mesh: tuple, model: dict, pipeline: dict | None = None):
    data, fsdp, pipe, tensor, sequence_parallel = mesh
    return small_config(
        data, fsdp, tensor, sequence_parallel, pipe=pipe, model=model, pipeline=pipeline
    )


_straight_runs: dict[str, tuple] = {}


def straight_run(model: dict) -> tuple:
    """The same model and global batch without a pipe axis (data 2 x fsdp 2 x tensor 2)."""
    key = repr(sorted(model.items()))
    if key not in _straight_runs:
        _straight_runs[key] = train_program(config_of((2, 2, 1, 2, False), model))
    return _straight_runs[key]


# compile-heavy beside their per-iteration counterparts above
SLOW_CASES = {
    "pipe2-data2-fsdp2-circular-m4-gather-once",
    "pipe2-fsdp2-tensor2-seqpar-1f1b-m4-gather-once",
    "pipe2-fsdp2-tensor2-seqpar-qk-norm-1f1b-m4",  # a straight run of its own to compile
}


@pytest.mark.parametrize(
    "case",
    [pytest.param(case, marks=[pytest.mark.slow] if case in SLOW_CASES else []) for case in CASES],
)
def test_pipelined_training_matches_the_straight_run(case: str):
    mesh, model, pipeline = CASES[case]
    expected_losses, expected_params = straight_run(model)
    losses, params = train_program(config_of(mesh, model, pipeline))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    for path, expected in jax.tree_util.tree_leaves_with_path(expected_params):
        actual = params
        for key in path:
            actual = actual[key.key]
        # relative to the array's norm: Adam turns float noise in near-zero gradients into
        # elementwise differences of ~1e-6 absolute on a few of ~17k elements
        relative_error = np.linalg.norm(actual - expected) / np.linalg.norm(expected)
        assert relative_error < 1e-5, (path, relative_error)
    # guards the comparison: the straight run learns, so a pipeline that froze would differ
    assert expected_losses[-1] < expected_losses[0] - 0.05


_packed_straight_runs: dict[int, tuple] = {}


@pytest.mark.parametrize(
    "pipeline", [gpipe(4), circular(4), one_f_one_b(4)], ids=["gpipe", "circular", "1f1b"]
)
def test_every_schedule_matches_the_straight_run_on_packed_rows_with_eos_and_padding(pipeline):
    steps = 3
    straight = config_of((2, 2, 1, 2, False), FOUR_LAYERS)
    batches = packed_batches(straight, steps)
    # the rows really differ: several documents in a row, padding, and microbatches (rows
    # i, i + 4, ...) with different positions, segments and token counts
    first = batches[0]
    assert first["segment_ids"].max() > 3 and (first["segment_ids"] == 0).any()
    by_microbatch = [first["segment_ids"][i::4] for i in range(4)]
    assert len({int((segments != 0).sum()) for segments in by_microbatch}) == 4
    assert len({first["positions"][i::4].tobytes() for i in range(4)}) == 4
    if steps not in _packed_straight_runs:
        _packed_straight_runs[steps] = train_program(straight, batches)
    expected_losses, expected_params = _packed_straight_runs[steps]
    losses, params = train_program(config_of((2, 1, 2, 2, False), FOUR_LAYERS, pipeline), batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    for path, expected in jax.tree_util.tree_leaves_with_path(expected_params):
        actual = params
        for key in path:
            actual = actual[key.key]
        relative_error = np.linalg.norm(actual - expected) / np.linalg.norm(expected)
        assert relative_error < 1e-5, (path, relative_error)


@pytest.mark.parametrize(
    ("stages", "repeats", "microbatches"), [(2, 1, 2), (4, 1, 8), (2, 2, 4), (4, 2, 4), (4, 3, 6)]
)
def test_idle_stage_iterations_counted_from_the_schedule_equal_the_bubble_formula(
    stages: int, repeats: int, microbatches: int
):
    schedule = "circular" if repeats > 1 else "gpipe"
    layout = PipelineLayout(stages, repeats, microbatches, stages * repeats, schedule)
    grid = [
        [layout.work_at(iteration, stage) for stage in range(stages)]
        for iteration in range(layout.iterations)
    ]
    idle = sum(work is None for row in grid for work in row)
    total = layout.iterations * stages
    assert idle / total == pytest.approx((stages - 1) / (repeats * microbatches + stages - 1))
    assert idle / total == pytest.approx(layout.bubble_fraction)
    # every (microbatch, repeat) passes the stages in order on consecutive iterations, and a
    # repeat starts on stage 0 only after the previous one left the last stage
    visits: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for iteration, row in enumerate(grid):
        for stage, work in enumerate(row):
            if work is not None:
                visits.setdefault(work, []).append((iteration, stage))
    assert len(visits) == repeats * microbatches
    for (microbatch, repeat), path in visits.items():
        assert [stage for _, stage in path] == list(range(stages))
        assert [iteration - path[0][0] for iteration, _ in path] == list(range(stages))
        if repeat > 0:
            previous_exit = visits[(microbatch, repeat - 1)][-1][0]
            assert path[0][0] > previous_exit


def probe_stage(chunk, x, positions, segment_ids):
    """A stage whose output tells which layers ran in which order on which microbatch: each
    layer scales, adds its weight and the microbatch's positions (an order-sensitive sum)."""
    for k in range(chunk["w"].shape[0]):
        x = 1.5 * x + chunk["w"][k] + positions[..., None]
    return x


@pytest.mark.parametrize(
    ("schedule", "stages", "repeats", "microbatches"),
    [("gpipe", 4, 1, 6), ("gpipe", 4, 1, 2), ("circular", 2, 2, 4), ("circular", 3, 3, 5)],
)  # fmt: skip
def test_the_forward_loop_scans_the_schedule_table_and_runs_every_layer_in_order(
    schedule: str, stages: int, repeats: int, microbatches: int
):
    layout = PipelineLayout(stages, repeats, microbatches, 2 * stages * repeats, schedule)
    rng = np.random.default_rng(0)
    weights = rng.normal(size=layout.num_layers).astype(np.float32)
    x = rng.normal(size=(2 * microbatches, 3, 2)).astype(np.float32)  # [batch, seq, embed]
    # every row its own positions, so a stage that ran another microbatch's would show it
    positions = rng.integers(0, 50, size=(2 * microbatches, 3)).astype(np.int32)
    layers = {"w": to_memory_order(weights, layout)}

    def pipelined(layers, x, positions):
        return run_pipeline(probe_stage, layers, x, positions, None, layout)

    expected = x
    for weight in weights:  # the straight stack, canonical order
        expected = 1.5 * expected + weight + positions[..., None]
    np.testing.assert_allclose(jax.jit(pipelined)(layers, x, positions), expected, rtol=1e-6)
    # the loop is a scan over exactly the rows of the table that the schedule tests check
    traced = jax.make_jaxpr(pipelined)(layers, x, positions)
    (scan,) = [eqn for eqn in traced.jaxpr.eqns if eqn.primitive.name == "scan"]
    tables = [
        const
        for var, const in zip(traced.jaxpr.constvars, traced.consts, strict=True)
        if var in scan.invars
    ]
    assert any(np.array_equal(table, layout.table.actions) for table in tables)
    assert scan.params["length"] == layout.table.iterations == layout.forward_iterations


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 2), (2, 8), (4, 4), (4, 9), (3, 16)])
def test_one_f_one_b_table_runs_each_microbatch_once_each_way_within_its_stash(
    stages: int, microbatches: int
):
    # the table the traced loop executes (msjax.parallel.one_f_one_b reads it row by row)
    table = PipelineLayout(stages, 1, microbatches, num_layers=stages, schedule="1f1b").table
    forwards: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> iteration
    backwards: dict[tuple[int, int], int] = {}
    held: list[dict[int, int]] = [{} for _ in range(stages)]  # stash slot -> microbatch
    for iteration in range(table.iterations):
        pairs = set(one_f_one_b_pairs(stages, iteration % 2))
        for stage in range(stages):
            kind, microbatch, repeat, slot = table.at(iteration, stage)
            assert repeat == 0
            if kind == FORWARD:
                assert (stage, microbatch) not in forwards
                forwards[(stage, microbatch)] = iteration
                # a slot is reused only once its microbatch's backward has run
                assert (stage, held[stage].get(slot)) in backwards or slot not in held[stage]
                held[stage][slot] = microbatch
                if stage < stages - 1:  # the output goes on to the next stage
                    assert (stage, stage + 1) in pairs
            elif kind == BACKWARD:
                assert (stage, microbatch) not in backwards
                assert held[stage][slot] == microbatch
                backwards[(stage, microbatch)] = iteration
                if stage > 0:  # the input's gradient goes back to the previous stage
                    assert (stage, stage - 1) in pairs
            else:
                assert kind == IDLE
    every_pair = {(stage, m) for stage in range(stages) for m in range(microbatches)}
    assert set(forwards) == set(backwards) == every_pair
    for (stage, microbatch), iteration in forwards.items():
        if stage > 0:  # the activation arrived from the previous stage one iteration earlier
            assert forwards[(stage - 1, microbatch)] == iteration - 1
        if stage < stages - 1:  # the gradient arrived from the next stage one iteration earlier
            assert backwards[(stage + 1, microbatch)] == backwards[(stage, microbatch)] - 1
        else:  # the head turns it round: the last stage's backward follows its forward
            assert backwards[(stage, microbatch)] == iteration + 1
    assert table.iterations == 2 * (microbatches + stages - 1)
    assert table.bubble_fraction == pytest.approx((stages - 1) / (microbatches + stages - 1))
    assert table.stash_slots == min(microbatches, stages)
    shares = table.branch_shares()  # idle, forward, backward, the last stage's forward
    assert shares[1] + shares[3] == shares[2] == pytest.approx((1 - table.bubble_fraction) / 2)


def test_one_f_one_b_evaluates_like_the_straight_model():
    # evaluation takes no gradient, so it runs gpipe's forward (which keeps no activations)
    straight = resolve(config_of((2, 2, 1, 2, False), FOUR_LAYERS), 8, "cpu")
    straight_program = build_program(straight, build_mesh(straight.mesh))
    params = straight_program.init_state().params
    config = resolve(config_of((2, 1, 2, 2, False), FOUR_LAYERS, one_f_one_b(4)), 8, "cpu")
    program = build_program(config, build_mesh(config.mesh))
    placed = program.state_from_params(jax.device_put(params, program.state_shardings.params))
    batch = fixed_batches(config)[0]
    expected = straight_program.eval_step(
        params, jax.device_put(batch, straight_program.batch_sharding)
    )
    loss = program.eval_step(placed.params, jax.device_put(batch, program.batch_sharding))
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-6)
    assert float(loss) > 1.0  # an untrained model's loss, not a masked-out zero


def train_step_memory(config) -> CompiledMemory:
    """XLA's memory analysis of a config's compiled train step, per device."""
    config = resolve(config, 8, "cpu")
    program = build_program(config, build_mesh(config.mesh))
    lowered = program.train_step.lower(program.abstract_state(), program.abstract_batch())
    return compiled_memory(lowered.compile())


@pytest.mark.parametrize("remat", ["none", "full"])
def test_one_f_one_b_step_needs_less_memory_than_gpipe_at_equal_microbatches_and_remat(
    remat: str,
):
    # activations dominate: 128 tokens a row, 2 layers per stage
    model = {"num_layers": 4, "mlp_dim": 256, "remat": remat}
    memory = {}
    for schedule in ("gpipe", "1f1b"):
        config = config_of((4, 1, 2, 1, False), model, {"schedule": schedule, "microbatches": 8})
        config = dataclasses.replace(
            config,
            data=dataclasses.replace(config.data, seq_len=128),
            train=dataclasses.replace(config.train, global_batch=64),
        )
        memory[schedule] = train_step_memory(config)
    layout = PipelineLayout(2, 1, 8, 4, schedule="1f1b")
    ratio = memory["1f1b"].temp_bytes / memory["gpipe"].temp_bytes
    print(
        f"remat {remat}, temporaries per device: gpipe {memory['gpipe'].temp_bytes / 2**20:.1f} "
        f"MiB, 1f1b {memory['1f1b'].temp_bytes / 2**20:.1f} MiB, ratio {ratio:.2f}"
    )
    # GPipe under autodiff keeps what every iteration's stage run saved: M + P - 1 runs' worth.
    # 1F1B keeps what stash_slots runs saved (2 here), and while one backward runs, that run's
    # working buffers: under half of GPipe's 9 units without remat (0.44 measured). Under full
    # remat a run saves only its layers' inputs, and the buffers both share dominate: with
    # GPipe's streams held M / P per stage the two are level (1.03 measured).
    bound = (layout.stash_slots + 2.5) / layout.forward_iterations if remat == "none" else 1.1
    assert ratio < bound
    assert memory["1f1b"].argument_bytes == memory["gpipe"].argument_bytes


def test_memory_order_puts_each_stages_layers_in_its_own_block_and_converts_back():
    layout = PipelineLayout(stages=2, repeats=2, microbatches=4, num_layers=8, schedule="circular")
    order = layout.memory_order()
    # device 0 holds virtual stages 0 and 2 (layers 0-1, 4-5), device 1 stages 1 and 3
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    stacked = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    in_memory = to_memory_order(stacked, layout)
    np.testing.assert_array_equal(np.asarray(in_memory)[2], stacked[4])
    np.testing.assert_array_equal(to_canonical_order(in_memory, layout), stacked)
    gpipe_layout = PipelineLayout(stages=4, repeats=1, microbatches=4, num_layers=8)
    assert gpipe_layout.memory_order().tolist() == list(range(8))


def test_each_device_holds_only_its_stages_layers():
    config = resolve(config_of((2, 1, 2, 2, False), FOUR_LAYERS, circular(4)), 8, "cpu")
    program = build_program(config, build_mesh(config.mesh))
    gate = program.init_state().params["layers"]["mlp"]["gate"]  # [layers, embed, mlp]
    assert {shard.data.shape for shard in gate.addressable_shards} == {(2, 64, 64)}


LAYOUT = ["mesh.fsdp=1", "mesh.tensor=1"]


def resumed_losses(tmp_path, first: list[str], second: list[str]) -> list[float]:
    run_dir = tmp_path / "run"
    common = [*QUICK_RUN, "model.num_layers=4", "checkpoint.every_steps=2", f"run.dir={run_dir}"]
    with open(os.devnull, "w") as quiet:
        train(load_config(None, [*common, "train.steps=2", *first]), progress_stream=quiet)
        train(load_config(None, [*common, "train.steps=4", *second]), progress_stream=quiet)
    return [
        record["loss"] for record in read_metrics(run_dir / "metrics.jsonl") if "loss" in record
    ]


@pytest.fixture(scope="module")
def straight_losses(tmp_path_factory) -> list[float]:
    straight = [*LAYOUT, "mesh.data=8"]
    return resumed_losses(tmp_path_factory.mktemp("straight"), straight, straight)


@pytest.mark.slow
@pytest.mark.parametrize(
    "second",
    [
        ["mesh.pipe=1", "mesh.data=8"],
        ["mesh.pipe=4", "mesh.data=2", "pipeline.microbatches=4"],
        ["mesh.pipe=2", "mesh.data=4", "pipeline.schedule=gpipe", "pipeline.microbatches=2"],
        ["mesh.pipe=2", "mesh.data=4", "pipeline.schedule=1f1b", "pipeline.microbatches=2"],
    ],
    ids=["pipe1", "pipe4-gpipe", "pipe2-gpipe", "pipe2-1f1b"],
)
def test_checkpoint_saved_under_one_pipeline_resumes_under_another(
    tmp_path, straight_losses, second
):
    circular_pipe2 = [
        *LAYOUT,
        "mesh.pipe=2",
        "mesh.data=4",
        "pipeline.schedule=circular",
        "pipeline.repeats=2",
        "pipeline.microbatches=2",
    ]
    resumed = resumed_losses(tmp_path, circular_pipe2, [*LAYOUT, *second])
    assert len(resumed) == len(straight_losses) == 4  # two steps, then two more after a resume
    np.testing.assert_allclose(resumed, straight_losses, rtol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["mesh.pipe=4", "mesh.data=2", "model.num_layers=6"], "model.num_layers=6"),
        (
            ["mesh.pipe=2", "mesh.data=4", "pipeline.schedule=circular", "pipeline.repeats=2"],
            "mesh.pipe x pipeline.repeats",
        ),
        (
            [
                "mesh.pipe=4",
                "mesh.data=2",
                "model.num_layers=8",
                "pipeline.schedule=circular",
                "pipeline.repeats=2",
                "pipeline.microbatches=2",
            ],
            "pipeline.microbatches=2 must be at least mesh.pipe=4",
        ),
        (["mesh.pipe=2", "mesh.data=4", "pipeline.microbatches=3"], "pipeline.microbatches=3"),
        (["mesh.pipe=2", "mesh.data=4", "pipeline.repeats=2"], "pipeline.schedule=circular"),
        (["mesh.pipe=2", "mesh.data=4", "pipeline.microbatches=0"], "pipeline.microbatches=0"),
        (
            [
                "mesh.pipe=4",
                "mesh.data=2",
                "model.num_layers=4",
                "pipeline.schedule=1f1b",
                "pipeline.microbatches=2",
            ],
            "pipeline.microbatches=2 must be at least mesh.pipe=4 for the 1f1b schedule",
        ),
        (
            ["mesh.pipe=2", "mesh.data=4", "pipeline.schedule=1f1b", "pipeline.repeats=2"],
            "pipeline.schedule=circular",
        ),
        (
            ["mesh.pipe=2", "mesh.data=4", "pipeline.schedule=1f1b", "pipeline.microbatches=3"],
            "pipeline.microbatches=3",
        ),
        (["mesh.pipe=2", "mesh.data=4", "pipeline.schedule=zigzag"], "gpipe, circular, 1f1b"),
        (["mesh.pipe=2", "mesh.data=4", "pipeline.fsdp_gather=twice"], "per_iteration, once"),
    ],
    ids=[
        "layers",
        "virtual-stages",
        "circular-microbatches",
        "batch",
        "repeats-gpipe",
        "zero",
        "1f1b-microbatches",
        "1f1b-repeats",
        "1f1b-batch",
        "unknown-schedule",
        "unknown-fsdp-gather",
    ],
)
def test_impossible_pipelines_are_one_line_and_write_nothing(tmp_path, capsys, overrides, named):
    from test_config import assert_one_line_user_error, run_main

    run_dir = tmp_path / "run"
    base = [*QUICK_RUN, "mesh.fsdp=1", "mesh.tensor=1", "train.steps=1", f"run.dir={run_dir}"]
    assert_one_line_user_error(*run_main(capsys, *base, *overrides), named)
    assert not run_dir.exists()
    assert list(tmp_path.iterdir()) == []


def test_parameters_given_in_canonical_order_are_placed_for_the_pipeline():
    # what an imported (Hugging Face) model does: canonical parameters into a circular layout
    straight = resolve(config_of((2, 2, 1, 2, False), FOUR_LAYERS), 8, "cpu")
    params = build_program(straight, build_mesh(straight.mesh)).init_state().params
    config = resolve(config_of((2, 1, 2, 2, False), FOUR_LAYERS, circular(4)), 8, "cpu")
    program = build_program(config, build_mesh(config.mesh))
    placed = program.state_from_params(jax.device_put(params, program.state_shardings.params))
    query = np.asarray(params["layers"]["attention"]["query"])
    in_memory = np.asarray(placed.params["layers"]["attention"]["query"])
    np.testing.assert_array_equal(in_memory[1], query[2])  # device 0 holds layers 0 and 2
    back = jax.tree.map(np.asarray, program.to_canonical(placed).params)
    jax.tree.map(np.testing.assert_array_equal, back, jax.tree.map(np.asarray, params))
