"""Which devices a collective in partitioned HLO runs between: its replica groups (in any of the
three forms XLA prints) or a collective permute's source-target pairs, as logical device ids.

A logical id is a device's position in the program's device assignment, which for a jitted
program over a mesh is the mesh's devices in row-major order: id i sits at
`np.unravel_index(i, mesh_shape)`.
"""

from __future__ import annotations

import re

import numpy as np

# {{0,1},{2,3}}: groups listed; {} is one group of every device
_LISTED = re.compile(r"replica_groups=\{(?P<groups>(?:\{[\d,]*\},?)*)\}")
# [groups,size]<=[dims]T(perm): iota(devices) reshaped to dims, transposed, cut into groups
_IOTA = re.compile(
    r"replica_groups=\[(?P<count>\d+),(?P<size>\d+)\]<=\[(?P<dims>[\d,]+)\]"
    r"(?:T\((?P<perm>[\d,]+)\))?"
)
# mesh['a'=2,'b'=4], device_ids=([dims]T(perm)) {'b'}: groups run along the named mesh axes
_NAMED_MESH = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\(\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?\))?"
    r"\s*\{(?P<over>[^}]*)\}"
)
_NAMED_AXIS = re.compile(r"'(?P<name>[^']+)'=(?P<size>\d+)")
_PAIRS = re.compile(r"source_target_pairs=\{(?P<pairs>(?:\{\d+,\d+\},?)*)\}")
_GROUP = re.compile(r"\{(?P<ids>[\d,]*)\}")


def _numbers(text: str) -> list[int]:
    return [int(number) for number in text.split(",") if number]


def _permuted_iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return (ids.transpose(perm) if perm else ids).reshape(-1)


def replica_groups(instruction: str, devices: int) -> list[list[int]] | None:
    """The device groups of a collective's HLO line, or None when the line names none."""
    listed = _LISTED.search(instruction)
    if listed:
        groups = [_numbers(group["ids"]) for group in _GROUP.finditer(listed["groups"])]
        return groups or [list(range(devices))]
    iota = _IOTA.search(instruction)
    if iota:
        perm = _numbers(iota["perm"]) if iota["perm"] else None
        ids = _permuted_iota(_numbers(iota["dims"]), perm)
        return ids.reshape(int(iota["count"]), int(iota["size"])).tolist()
    named = _NAMED_MESH.search(instruction)
    if named:
        axes = [(axis["name"], int(axis["size"])) for axis in _NAMED_AXIS.finditer(named["axes"])]
        sizes = [size for _, size in axes]
        if named["dims"]:
            perm = _numbers(named["perm"]) if named["perm"] else None
            ids = _permuted_iota(_numbers(named["dims"]), perm).reshape(sizes)
        else:
            ids = np.arange(int(np.prod(sizes))).reshape(sizes)
        over = {name.strip().strip("'") for name in named["over"].split(",") if name.strip()}
        inside = [index for index, (name, _) in enumerate(axes) if name in over]
        outside = [index for index in range(len(axes)) if index not in inside]
        group_size = int(np.prod([sizes[index] for index in inside]))
        return ids.transpose(outside + inside).reshape(-1, group_size).tolist()
    return None


def permute_pairs(instruction: str) -> list[tuple[int, int]] | None:
    """A collective permute's (source, target) pairs, or None when the line has none."""
    found = _PAIRS.search(instruction)
    if not found:
        return None
    pairs = (_numbers(pair["ids"]) for pair in _GROUP.finditer(found["pairs"]))
    return [(source, target) for source, target in pairs]


def axes_spanned(ids: list[int], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The mesh dimensions along which the devices `ids` differ (their coordinates vary)."""
    coordinates = np.stack(np.unravel_index(np.asarray(ids), mesh_shape))
    return tuple(int(d) for d in np.flatnonzero((coordinates != coordinates[:, :1]).any(axis=1)))
