"""One HLO computation's data flow, read so that its collectives count as a GPU backend runs them:
one that XLA's CPU backend widened from bfloat16 counts at its narrow width, and an all-reduce
whose every use keeps one device's slice counts as the reduce-scatter a GPU backend makes of it.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from msjax.observe.device_groups import replica_groups

# `%name = shape op(operands), attributes`; a shape may be a tuple with spaces inside
_DEFINITION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s+"
    r"(?P<op>[a-z][a-z0-9\-]*)\((?P<operands>[^)]*)\)"
)
_OPERAND = re.compile(r"%(?P<name>[\w.\-]+)")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_NARROW_FLOATS = {"bf16": 2, "f16": 2}
_WIDE_BYTES = 4
# ops that pass values on unchanged but for layout or width: followed when tracing a value
_PASS_THROUGH = {"bitcast", "copy", "reshape", "transpose"}


class _Instruction:
    def __init__(self, match: re.Match[str], line: str) -> None:
        self.name = match["name"]
        self.op = match["op"]
        self.operands = [found["name"] for found in _OPERAND.finditer(match["operands"])]
        array = _ARRAY.search(match["shape"])
        self.dtype = array["dtype"] if array else ""
        dims = array["dims"] if array else ""
        self.elements = math.prod(int(dim) for dim in dims.split(",") if dim)
        self.from_source = "op_name=" in line  # XLA's own rewrites carry no source op name


class DataFlow:
    """The definitions and uses of one computation's instructions (a list of its HLO lines)."""

    def __init__(self, lines: list[str]) -> None:
        self._defined: dict[str, _Instruction] = {}
        self._users: dict[str, list[str]] = defaultdict(list)
        for line in lines:
            match = _DEFINITION.match(line)
            if not match:
                continue
            instruction = _Instruction(match, line)
            self._defined[instruction.name] = instruction
            for operand in instruction.operands:
                self._users[operand].append(instruction.name)

    def ancestor_ops(self, name: str) -> set[str]:
        """The ops of every instruction of this computation that `name`'s value is made from
        (its operands, theirs, ...): what it waits for within one run of the computation."""
        ops: set[str] = set()
        seen: set[str] = set()
        pending = list(self._defined[name].operands) if name in self._defined else []
        while pending:
            operand = pending.pop()
            if operand in seen or operand not in self._defined:
                continue
            seen.add(operand)
            ops.add(self._defined[operand].op)
            pending.extend(self._defined[operand].operands)
        return ops

    def narrowing(self, line: str) -> float:
        """The width a collective had before XLA's CPU backend widened it, over its width now: 1,
        or 1/2 for a float32 collective of values converted from bfloat16 by XLA (a convert
        with no source op; a convert the model asked for keeps the wide width)."""
        match = _DEFINITION.match(line)
        if not match:
            return 1.0
        collective = _Instruction(match, line)
        if collective.dtype != "f32" or not collective.operands:
            return 1.0
        source = self._defined.get(collective.operands[0])
        while source and source.op in _PASS_THROUGH and len(source.operands) == 1:
            source = self._defined.get(source.operands[0])
        if source is None or source.op != "convert" or source.from_source:
            return 1.0
        original = self._defined.get(source.operands[0]) if source.operands else None
        narrow = _NARROW_FLOATS.get(original.dtype if original else "")
        return narrow / _WIDE_BYTES if narrow else 1.0

    def scattered_fraction(self, line: str) -> float | None:
        """For an all-reduce whose every use (through copies, converts and reshapes) is a
        dynamic-slice keeping 1/g of it, g its group size: 1/g. XLA's GPU backend rewrites that
        pattern into a reduce-scatter; its CPU backend keeps the all-reduce. None otherwise."""
        match = _DEFINITION.match(line)
        groups = replica_groups(line, devices=1)
        if not match or not groups or len(groups[0]) < 2:
            return None
        group, elements = len(groups[0]), _Instruction(match, line).elements
        pending, kept = [match["name"]], set()
        while pending:
            users = [self._defined[name] for name in self._users.get(pending.pop(), [])]
            if not users:
                return None
            for user in users:
                if user.op in _PASS_THROUGH | {"convert"} and len(user.operands) == 1:
                    pending.append(user.name)
                elif user.op == "dynamic-slice":
                    kept.add(user.elements)
                else:
                    return None
        return 1 / group if kept == {elements // group} and elements % group == 0 else None
