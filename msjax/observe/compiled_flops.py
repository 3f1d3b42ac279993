"""The matmul work of a compiled XLA program: dot and convolution FLOPs one device runs per step.

Read from partitioned HLO text as `msjax.observe.collectives` reads it: an instruction inside a
`while` body counts once per trip (nested loops multiply), one inside a fusion once per run of it.
A GPU's cuBLAS gemm custom calls count as the dots they replace; other kernels' work is not seen.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from msjax.observe.collectives import program_runs

_DOT_OR_CONVOLUTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\S+)\s+"
    r"(?P<op>dot|convolution)\((?P<operands>[^)]*)\)"
)
_DEFINED_SHAPE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\S+)\s")
_ARRAY_DIMS = re.compile(r"^[a-z]+\d*(?:e\d+m\d+(?:fn)?)?\[(?P<dims>[\d,]*)\]")
_OPERAND = re.compile(
    r"(?:(?P<shape>[a-z]+\d*[\w]*\[[\d,]*\])(?:\{[^}]*\})?\s+)?%(?P<name>[\w.\-]+)"
)
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{(?P<dims>[\d,]*)\}")
# XLA's GPU backend rewrites a dot into a cuBLAS call: (result, workspace) = custom-call(lhs, rhs,
# ...), its dimension numbers in the backend config
_GEMM_CALL = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s+custom-call\((?P<operands>[^)]*)\)"
    r".*custom_call_target=\"__cublas\$(?:gemm|lt\$matmul)"
)
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[(?P<dims>[^\]]*)\]')
_FIRST_ARRAY = re.compile(r"[a-z]+\d*(?:e\d+m\d+(?:fn)?)?\[[\d,]*\]")
_DIM_LABELS = re.compile(r"dim_labels=(?P<lhs>\w+)_(?P<rhs>\w+)->(?P<out>\w+)")


def _dims(shape: str) -> list[int] | None:
    match = _ARRAY_DIMS.match(shape)
    return None if match is None else [int(dim) for dim in match["dims"].split(",") if dim]


def _operand_dims(operands: str, shapes: dict[str, str]) -> list[list[int] | None]:
    """Each operand's dims: printed beside it, or read from the line that defines it."""
    found = []
    for operand in _OPERAND.finditer(operands):
        shape = operand["shape"] or shapes.get(operand["name"], "")
        found.append(_dims(shape))
    return found


def instruction_flops(line: str, shapes: dict[str, str]) -> int:
    """FLOPs of one dot or convolution line (0 for any other line).

    A dot: 2 x the output's elements (batch dims are among them) x the contracting dims' product.
    A convolution: 2 x the output's elements x the kernel's elements per output feature.
    `shapes` maps the computation's instruction names to their shapes, for operands printed bare.
    """
    match = _DOT_OR_CONVOLUTION.match(line)
    if not match:
        return _gemm_call_flops(line, shapes)
    output = _dims(match["shape"])
    operands = _operand_dims(match["operands"], shapes)
    if output is None or len(operands) != 2 or None in operands:
        raise ValueError(f"cannot read the shapes of {line.strip()[:200]}")
    lhs, rhs = operands
    if match["op"] == "dot":
        contracting = _LHS_CONTRACTING.search(line)
        dims = [int(d) for d in contracting["dims"].split(",") if d] if contracting else []
        per_output = math.prod(lhs[d] for d in dims)  # type: ignore[index]
    else:
        labels = _DIM_LABELS.search(line)
        kernel = math.prod(rhs)  # type: ignore[arg-type]
        out_features = rhs[labels["rhs"].index("o")] if labels else 1  # type: ignore[index]
        per_output = kernel // out_features
    return 2 * math.prod(output) * per_output


def _gemm_call_flops(line: str, shapes: dict[str, str]) -> int:
    """FLOPs of a cuBLAS gemm custom call, as of the dot it stands for (0 for other lines)."""
    match = _GEMM_CALL.match(line)
    if not match:
        return 0
    result = _FIRST_ARRAY.search(match["shape"])
    operands = _operand_dims(match["operands"], shapes)
    contracting = _GEMM_CONTRACTING.search(line)
    if result is None or not operands or operands[0] is None or contracting is None:
        raise ValueError(f"cannot read the shapes of {line.strip()[:200]}")
    lhs = operands[0]
    dims = [int(dim.strip().strip('"')) for dim in contracting["dims"].split(",") if dim.strip()]
    return 2 * math.prod(_dims(result[0]) or []) * math.prod(lhs[dim] for dim in dims)


@dataclass(frozen=True)
class CompiledFlops:
    """Dot and convolution FLOPs one device runs in one step of a compiled program."""

    total: float
    in_loops: float  # of the total, what runs inside `while` bodies (layer scans, pipelines)
    instructions: int  # dot and convolution instructions in the program text


def compiled_flops(hlo_text: str, branch_shares: tuple[float, ...] | None = None) -> CompiledFlops:
    """Per device and step: every dot and convolution, times its computation's executions
    (a conditional's branches weighted by `branch_shares`, as in `program_runs`)."""
    program = program_runs(hlo_text, branch_shares)
    total = in_loops = 0.0
    instructions = 0
    for computation, lines in program.lines.items():
        runs = program.runs.get(computation, 0)
        shapes: dict[str, str] = {}
        for line in lines:
            defined = _DEFINED_SHAPE.match(line)
            if defined:
                shapes[defined["name"]] = defined["shape"]
        for line in lines:
            flops = instruction_flops(line, shapes)
            if flops:
                instructions += 1
                total += runs * flops
                in_loops += program.loop_runs.get(computation, 0) * flops
    return CompiledFlops(total, in_loops, instructions)
