"""Collectives in a compiled XLA program: how many run per step, the bytes they produce, and the
bytes one device sends over each mesh axis.

Read from `compiled.as_text()` (optimised, partitioned HLO of one device). An op inside a `while`
body (the scanned layers) runs once per trip, so it is counted `known_trip_count` times. Bytes are
the sizes of each op's results; `bytes_sent_by_axes` turns them into ring bytes on the wire, per
mesh axis, from each op's device groups (the planner's estimates are in
`msjax.planner.communication`).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from msjax.observe.device_groups import axes_spanned, permute_pairs, replica_groups
from msjax.observe.hlo_dataflow import DataFlow

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}  # fmt: skip
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[(?P<dims>[\d,]*)\]")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition)=%?(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"')
_CONDITION = re.compile(r"\bcondition=%?(?P<name>[\w.\-]+)")
_S32_CONSTANT = re.compile(r"=\s*s32\[\]\s+constant\((?P<n>\d+)\)")
_LESS_THAN_ROOT = re.compile(r"^\s*ROOT\s.*\bcompare\(.*direction=LT")


@dataclass(frozen=True)
class CollectiveStats:
    """One kind of collective in one step of a compiled program."""

    kind: str
    ops: int  # instructions in the program text
    executions: int  # runs per step (an op in a loop body counts once per trip)
    result_bytes: int  # per step: sum over executions of the results' sizes
    executions_in_loops: int = 0  # of the executions, those inside a `while` body (layer scan)


def _array_bytes(shape_text: str) -> list[int]:
    sizes = []
    for match in _ARRAY.finditer(shape_text):
        dtype = match["dtype"]
        if dtype not in _DTYPE_BYTES:
            continue
        dims = [int(dim) for dim in match["dims"].split(",") if dim]
        sizes.append(math.prod(dims) * _DTYPE_BYTES[dtype])
    return sizes


def _result_bytes(shape_text: str, is_async_start: bool) -> int:
    """Bytes of an op's results; an async `-start` returns (operands..., results..., context)."""
    sizes = _array_bytes(shape_text)
    if is_async_start and shape_text.lstrip().startswith("("):
        sizes = [size for size in sizes if size > 4]  # drop u32[] / s32[] context scalars
        if len(sizes) >= 2 and len(sizes) % 2 == 0:
            sizes = sizes[len(sizes) // 2 :]
    return sum(sizes)


@dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction and how often it runs per step."""

    kind: str
    result_bytes: int  # of one execution
    executions: int
    executions_in_loops: int
    instruction: str  # its line of HLO: the device groups are read from it


@dataclass(frozen=True)
class ProgramRuns:
    """How often each computation of an HLO program runs per step, read from its call graph:
    a `while` body once per trip (XLA's `known_trip_count`, else its condition's bound; nested
    loops multiply), a fusion or call once per caller's run."""

    runs: dict[str, int]  # computation -> executions per step
    loop_runs: dict[str, int]  # of those, the executions inside a `while` body
    lines: dict[str, list[str]]  # computation -> its instruction lines


def program_runs(hlo_text: str, branch_shares: tuple[float, ...] | None = None) -> ProgramRuns:
    """The executions per step of every computation in `hlo_text` (HLO as text).

    A conditional's branches each run once per run of it (an upper bound), unless
    `branch_shares` gives, for conditionals with that many branches, the share of runs each
    branch takes on average over devices (a pipeline that branches per device: the schedule
    table knows them, msjax.parallel.schedules.ScheduleTable.branch_shares).
    """
    graph = _call_graph(hlo_text, branch_shares)
    calls = graph.calls
    runs: dict[str, int] = defaultdict(int)
    loop_runs: dict[str, int] = defaultdict(int)
    bodies = {
        callee
        for name in calls
        for callee, factor in calls[name]
        if factor != 1 and callee not in graph.branch_bodies
    }

    def visit(name: str, times: int, depth: int = 0, in_loop: bool = False) -> None:
        if depth > 64:  # HLO call graphs are acyclic; this only guards against a bad parse
            return
        runs[name] += times
        in_loop = in_loop or name in bodies
        if in_loop:
            loop_runs[name] += times
        for callee, factor in calls.get(name, ()):
            visit(callee, times * factor, depth + 1, in_loop)

    if graph.entry is not None:
        visit(graph.entry, 1)
    return ProgramRuns(dict(runs), dict(loop_runs), dict(graph.body_lines))


@dataclass(frozen=True)
class _CallGraph:
    """Which computations of an HLO program call which, and how often per run of the caller."""

    entry: str | None  # the ENTRY computation
    calls: dict[str, list[tuple[str, int]]]  # caller -> (callee, runs per run of the caller)
    body_lines: dict[str, list[str]]  # each computation's instruction lines
    branch_bodies: set[str]  # a conditional's branches: weighted, but not loop bodies


def _call_graph(hlo_text: str, branch_shares: tuple[float, ...] | None) -> _CallGraph:
    """The call graph of `hlo_text`, a while loop's body called its trip count of times."""
    computation = None
    entry = None
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    # Before XLA annotates trip counts (an HLO dump taken mid-pipeline), a scan's loop count is
    # the constant its condition compares the counter against: `i < N` with i from 0.
    bounds: dict[str, list[int]] = defaultdict(list)
    counted_by: dict[str, bool] = {}
    unannotated: list[tuple[str, str]] = []  # (computation holding the while, its condition)
    body_lines: dict[str, list[str]] = defaultdict(list)
    branch_bodies: set[str] = set()
    for line in hlo_text.splitlines():
        if not line.startswith((" ", "\t")):
            header = _HEADER.match(line)
            if header:
                computation = header["name"]
                if line.startswith("ENTRY"):
                    entry = computation
            continue
        if computation is None:
            continue
        body_lines[computation].append(line)
        constant = _S32_CONSTANT.search(line)
        if constant:
            bounds[computation].append(int(constant["n"]))
        if _LESS_THAN_ROOT.match(line):
            counted_by[computation] = True
        trips = _TRIP_COUNT.search(line)
        factor = int(trips["n"]) if trips and " while(" in line else 1
        condition = _CONDITION.search(line) if " while(" in line and not trips else None
        for callee in _CALLEE.finditer(line):
            if condition and callee["name"] != condition["name"]:
                unannotated.append((computation, condition["name"]))
                calls[computation].append((callee["name"], -len(unannotated)))
            else:
                calls[computation].append((callee["name"], factor))
        branches = _BRANCHES.search(line)
        if branches:
            names = [name.strip().lstrip("%") for name in branches["names"].split(",")]
            shares = branch_shares if branch_shares and len(branch_shares) == len(names) else None
            for index, name in enumerate(names):
                calls[computation].append((name, shares[index] if shares else 1))
                branch_bodies.add(name)

    def loop_trips(marker: int) -> int:
        _, condition = unannotated[-marker - 1]
        constants = bounds.get(condition, [])
        return constants[0] if counted_by.get(condition) and len(constants) == 1 else 1

    for name in calls:
        calls[name] = [
            (callee, loop_trips(factor) if factor < 0 else factor) for callee, factor in calls[name]
        ]
    return _CallGraph(entry, calls, body_lines, branch_bodies)


def collective_ops(
    hlo_text: str, branch_shares: tuple[float, ...] | None = None
) -> list[CollectiveOp]:
    """Every collective instruction of a program, with its executions per step."""
    program = program_runs(hlo_text, branch_shares)  # see program_runs
    body_lines, runs, loop_runs = program.lines, program.runs, program.loop_runs
    found: dict[str, list[tuple[str, int, str]]] = defaultdict(list)  # computation -> ops
    for computation, lines in body_lines.items():
        for line in lines:
            op = _INSTRUCTION.match(line)
            if op:
                size = _result_bytes(op["shape"], op["start"] is not None)
                found[computation].append((op["op"], size, line))
    ops = []
    flows: dict[str, DataFlow] = {}
    for name, collectives in found.items():
        for kind, size, line in collectives:
            if name not in flows:
                flows[name] = DataFlow(body_lines[name])
            flow = flows[name]
            size = round(size * flow.narrowing(line))
            if kind == "all-reduce":
                scattered = flow.scattered_fraction(line)
                kind, size = (
                    ("reduce-scatter", round(size * scattered)) if scattered else (kind, size)
                )
            ops.append(CollectiveOp(kind, size, runs.get(name, 0), loop_runs.get(name, 0), line))
    return ops


# Bytes one member of a group of g sends per byte of an op's result, with ring algorithms: an
# all-reduce is a reduce-scatter and an all-gather of the whole result; a reduce-scatter's result
# is one of the g pieces of its input.
_RING_SEND_PER_RESULT_BYTE = {
    "all-reduce": lambda g: 2.0 * (g - 1) / g,
    "all-gather": lambda g: (g - 1) / g,
    "all-to-all": lambda g: (g - 1) / g,
    "reduce-scatter": lambda g: float(g - 1),
}


def bytes_sent_by_axes(
    ops: list[CollectiveOp],
    axis_names: tuple[str, ...],
    mesh_shape: tuple[int, ...],
    within_loops: bool = False,
) -> dict[str, float]:
    """Bytes one device sends per step (averaged over devices) in a program's collectives
    (collective_ops), keyed by the mesh axes each runs over ("tensor", "data+fsdp", ...; axes in
    mesh order); with within_loops, only what collectives inside loops send.

    Ring algorithms as in `msjax.planner.communication`; a collective permute sends its result
    from every device whose target is another device. Raises ValueError on a collective whose
    devices cannot be read, so nothing goes uncounted.
    """
    devices = int(np.prod(mesh_shape))
    sent: dict[str, float] = defaultdict(float)
    for op in ops:
        if op.kind == "collective-permute":
            pairs = permute_pairs(op.instruction)
            if pairs is None:
                raise ValueError(f"no source-target pairs in {op.instruction.strip()[:200]}")
            moving = [(source, target) for source, target in pairs if source != target]
            spanned = sorted({axis for pair in moving for axis in axes_spanned(pair, mesh_shape)})
            per_device = len(moving) / devices * op.result_bytes
        else:
            groups = replica_groups(op.instruction, devices)
            if groups is None:
                raise ValueError(f"no replica groups in {op.instruction.strip()[:200]}")
            spanned = list(axes_spanned(groups[0], mesh_shape))
            per_device = _RING_SEND_PER_RESULT_BYTE[op.kind](len(groups[0])) * op.result_bytes
        if per_device and spanned:
            executions = op.executions_in_loops if within_loops else op.executions
            sent["+".join(axis_names[axis] for axis in spanned)] += executions * per_device
    return dict(sent)


def count_collectives(ops: list[CollectiveOp]) -> dict[str, CollectiveStats]:
    """Per kind in KINDS (all present, zero when absent): ops, executions and bytes per step of
    a program's collectives (collective_ops)."""
    counts: dict[str, int] = defaultdict(int)
    executions: dict[str, int] = defaultdict(int)
    result_bytes: dict[str, int] = defaultdict(int)
    in_loops: dict[str, int] = defaultdict(int)
    for op in ops:
        counts[op.kind] += 1
        executions[op.kind] += op.executions
        result_bytes[op.kind] += op.executions * op.result_bytes
        in_loops[op.kind] += op.executions_in_loops
    return {
        kind: CollectiveStats(
            kind, counts[kind], executions[kind], result_bytes[kind], in_loops[kind]
        )
        for kind in KINDS
    }
