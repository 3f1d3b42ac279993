"""What the pipelines' compiled programs do beyond the layers: the stage transfers run inside
the loop, and under GPipe and circular the loss head's tokens are split over pipe, each stage
holds ceil(M / P) microbatches of the streams, and sequence parallelism splits the transfers.

Compile-only, on configs/tiny.yaml (float32) at data 2 x pipe 2 x tensor 2; the compiles are
cached per process (msjax.planner.aot), shared with test_communication_model's.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from msjax.config import load_config
from msjax.observe.collectives import program_runs
from msjax.observe.hlo_dataflow import DataFlow
from msjax.parallel.pipeline import PipelineLayout
from msjax.planner.aot import compile_step
from msjax.planner.candidates import parse_mesh
from msjax.planner.communication import ring_all_reduce_bytes

MESH = "2,1,2,2"  # data, fsdp, pipe, tensor
GPIPE = "pipeline.microbatches=4"
CIRCULAR = "pipeline.schedule=circular pipeline.repeats=2 pipeline.microbatches=4"
ONE_F_ONE_B = "pipeline.schedule=1f1b pipeline.microbatches=4"
BATCH, SEQ, EMBED, VOCAB, DATA, PIPE, TENSOR = 8, 128, 128, 264, 2, 2, 2


def compiled(overrides: str):
    config = load_config("configs/tiny.yaml", [f"train.global_batch={BATCH}", *overrides.split()])
    return compile_step(config, parse_mesh(MESH))


def pipe_bytes(sent: dict[str, float]) -> float:
    return sum(value for axes, value in sent.items() if "pipe" in axes.split("+"))


@pytest.mark.parametrize(
    "overrides", [GPIPE, CIRCULAR, ONE_F_ONE_B], ids=["gpipe", "circular", "1f1b"]
)
def test_stage_transfers_are_collective_permutes_inside_the_loop(overrides: str):
    step = compiled(overrides)
    layout = PipelineLayout.of(step.config)
    # one microbatch's activations on a device: a row of the replica's 4, float32
    stream = BATCH // DATA // layout.microbatches * SEQ * EMBED * 4
    permutes = step.collectives["collective-permute"]
    in_loop = pipe_bytes(step.sent_by_axes_in_loops)
    if layout.interleaves_backward:
        # each iteration a stage pairs with one neighbour and sends it one tensor, an output
        # on or a gradient back: the schedule table's sends per iteration, in the loop
        assert permutes.executions_in_loops >= layout.iterations
        assert layout.table.sends_per_iteration == 0.5
        assert in_loop == layout.iterations * stream * layout.table.sends_per_iteration
        return
    assert permutes.executions == permutes.executions_in_loops >= 2 * layout.iterations
    back = (PIPE - 1) / PIPE  # GPipe's last stage sends nothing on, stage 0 nothing back
    on = 1.0 if layout.repeats > 1 else back
    # each iteration forward and backward: the stage's output on, a stream column back
    assert in_loop == 2 * layout.iterations * stream * (on + back)
    assert permutes.executions >= 4 * layout.iterations
    # outside the loop no activations cross pipe: the embedding and unembedding tables'
    # gradients (tensor-split, float32) are summed over data x pipe, and the loss's scalars
    tables = 2 * (VOCAB // TENSOR) * EMBED * 4 + EMBED * 4  # and the final norm
    outside = pipe_bytes(step.sent_by_axes) - in_loop
    assert outside == pytest.approx(ring_all_reduce_bytes(tables, DATA * PIPE), abs=100)


def test_the_heads_flops_per_device_fall_by_the_pipe_size():
    # the head's share of a device's dots, isolated: the same step with 2048 more vocabulary
    extra_vocab = 2048
    small = compiled(GPIPE).flops.total
    large = compiled(f"{GPIPE} model.vocab_size={VOCAB + extra_vocab}").flops.total
    replica_tokens = BATCH // DATA * SEQ
    replicated_head = 6 * extra_vocab * EMBED * replica_tokens / TENSOR  # forward and backward
    assert large - small == pytest.approx(replicated_head / PIPE, rel=0.01)


def test_each_stage_holds_m_over_p_microbatches_of_the_pipelines_streams():
    step = compiled(GPIPE)
    layout = PipelineLayout.of(step.config)
    microbatch = BATCH // DATA // layout.microbatches
    # per device [stage, slots, microbatch, seq, embed] (or a layer scan's [stage, replica,
    # microbatch, seq, embed]): the largest buffer of microbatches the loops carry
    buffer = re.compile(rf"f32\[1,(\d+),{microbatch},{SEQ},{EMBED}\]")
    carried = {
        int(slots)
        for line in step.compiled.as_text().splitlines()
        if " while(" in line
        for slots in buffer.findall(line.split(" while(")[0])
    }
    assert max(carried) == layout.slots_per_stage == layout.microbatches // PIPE


def test_under_sequence_parallelism_each_tensor_rank_sends_its_share_of_a_stage():
    whole = pipe_bytes(compiled(GPIPE).sent_by_axes_in_loops)
    split = pipe_bytes(compiled(f"{GPIPE} mesh.sequence_parallel=true").sent_by_axes_in_loops)
    assert split == whole / TENSOR


def test_circulars_wrap_around_is_its_own_permute_that_waits_for_no_stage_run():
    # pipe 4, so the wrap-around (stage 3 to 0) differs from every stage-to-stage pair; M > P,
    # so a microbatch waits in stage 0's ring and its transfer can go an iteration later
    circular = "pipeline.schedule=circular pipeline.repeats=2 pipeline.microbatches=8"
    overrides = ["train.global_batch=16", "model.num_layers=8", *circular.split()]
    config = load_config("configs/tiny.yaml", overrides)
    step = compile_step(config, parse_mesh("2,1,4,1"))
    assert (
        step.config.pipeline.repeats == 2
        and PipelineLayout.of(step.config).table.delays_wrap_around
    )
    by_stage = np.asarray(
        [[d.id for d in row] for row in np.asarray(step.program.mesh.devices).reshape(2, 4)]
    )  # [data, pipe]
    wrap = {(int(row[3]), int(row[0])) for row in by_stage}
    on = {(int(row[s]), int(row[s + 1])) for row in by_stage for s in range(3)}
    program = program_runs(step.compiled.as_text())
    found = {}  # pairs -> the ops each such permute waits for, in the loops' bodies
    for name in program.loop_runs:
        flow = DataFlow(program.lines[name])
        for line in program.lines[name]:
            match = re.match(
                r"\s*(?:ROOT )?%?([\w.\-]+) = \S+ collective-permute(?:-start)?\(", line
            )
            if match:
                pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)[1]
                key = frozenset(
                    tuple(map(int, p.strip("{}").split(","))) for p in pairs.split("},{")
                )
                found.setdefault(key, []).append(flow.ancestor_ops(match[1]))
    # the wrap-around travels alone, made of the loop's carry only: nothing of the iteration's
    # stage runs (a fusion, a dot, the layer's loop) comes before it, so it can overlap them
    assert frozenset(wrap) in found
    assert any(
        ops <= {"parameter", "get-tuple-element", "copy", "bitcast"}
        for ops in found[frozenset(wrap)]
    )
    # the stage-to-stage transfer carries no wrap-around pair, and waits for the stage runs
    assert frozenset(on) in found
    assert all("fusion" in ops or "dot" in ops for ops in found[frozenset(on)])
