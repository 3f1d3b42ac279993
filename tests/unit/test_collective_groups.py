"""Reading partitioned HLO: which devices a collective spans, in each form XLA prints groups, and
how a collective counts when XLA's CPU backend ran it differently from a GPU backend."""

from __future__ import annotations

import numpy as np

from msjax.observe.collectives import bytes_sent_by_axes, collective_ops
from msjax.observe.device_groups import axes_spanned, permute_pairs, replica_groups
from msjax.observe.hlo_dataflow import DataFlow

MESH = (2, 2, 2)  # data, fsdp, tensor: device i at np.unravel_index(i, MESH)


def test_listed_iota_and_named_mesh_groups_name_the_same_devices():
    listed = "x = f32[4] all-reduce(y), replica_groups={{0,2},{1,3},{4,6},{5,7}}, to_apply=add"
    # iota(8) as [2,2,2], fsdp moved innermost, cut into 4 groups of 2
    iota = "x = f32[4] all-reduce(y), replica_groups=[4,2]<=[2,2,2]T(0,2,1), to_apply=add"
    named = "x = f32[4] all-reduce(y), replica_groups=mesh['d'=2,'f'=2,'t'=2] {'f'}, to_apply=add"
    expected = [[0, 2], [1, 3], [4, 6], [5, 7]]
    for line in (listed, iota, named):
        groups = replica_groups(line, devices=8)
        assert sorted(map(sorted, groups)) == expected, line
        assert axes_spanned(groups[0], MESH) == (1,)  # fsdp
    everyone = replica_groups("x = f32[4] all-reduce(y), replica_groups={}, to_apply=add", 8)
    assert everyone == [list(range(8))]
    assert axes_spanned(everyone[0], MESH) == (0, 1, 2)
    assert replica_groups("x = f32[4] add(y, z)", 8) is None


def test_named_mesh_with_device_ids_follows_the_permuted_ids():
    line = (
        "x = f32[4] all-gather(y), replica_groups=mesh['a'=2,'b'=4], "
        "device_ids=([4,2]T(1,0)) {'a'}, dimensions={0}"
    )
    ids = np.arange(8).reshape(4, 2).T.reshape(2, 4)  # the device at mesh position (a, b)
    groups = replica_groups(line, devices=8)
    assert groups == [[int(ids[0, b]), int(ids[1, b])] for b in range(4)]


def test_permute_pairs_and_the_bytes_they_send():
    line = (
        "  ROOT %cp = f32[256] collective-permute(%p), "
        'source_target_pairs={{0,4},{1,5},{2,6},{3,7}}, metadata={op_name="roll"}'
    )
    hlo = "\n".join(
        ["ENTRY %main (p: f32[256]) -> f32[256] {", "  %p = f32[256] parameter(0)", line, "}"]
    )
    assert permute_pairs(line) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # half the devices send 1 KiB each, along data only: 512 bytes per device on average
    sent = bytes_sent_by_axes(collective_ops(hlo), ("data", "fsdp", "tensor"), MESH)
    assert sent == {"data": 512.0}


def test_gpu_reading_of_cpu_rewrites():
    lines = [
        "%w = bf16[8] parameter(0)",
        '%mine = f32[8] convert(%w), metadata={op_name="jit(f)/convert"}',
        "%xla = f32[8] convert(%w)",
        '%kept = f32[8] all-reduce(%mine), replica_groups={{0,1}}, metadata={op_name="a"}',
        '%narrowed = f32[8] all-reduce(%xla), replica_groups={{0,1}}, metadata={op_name="b"}',
        '%sliced = f32[8] all-reduce(%mine), replica_groups={{0,1}}, metadata={op_name="c"}',
        "%i = s32[] parameter(1)",
        "%piece = f32[4] dynamic-slice(%sliced, %i), dynamic_slice_sizes={4}",
        "%whole = f32[8] add(%kept, %kept)",
    ]
    flow = DataFlow(lines)
    assert flow.narrowing(lines[3]) == 1.0  # the model asked for float32
    assert flow.narrowing(lines[4]) == 0.5  # XLA widened a bfloat16 reduction
    assert flow.scattered_fraction(lines[5]) == 0.5  # each device keeps its half
    assert flow.scattered_fraction(lines[3]) is None  # used whole
