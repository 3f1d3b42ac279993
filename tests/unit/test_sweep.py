"""The mesh sweep: a row per mesh with XLA's memory, the compiled collectives and measured speed.

The tiny config at global batch 8 is compiled once per mesh per process (`msjax.planner.aot`
caches compiles), so `tests/unit/test_plan.py` checks the memory model on these same programs.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from msjax.config import load_config
from msjax.planner.candidates import MeshShape
from msjax.planner.sweep import measure_mesh, resolve_meshes
from msjax.sweep import main

CONFIG = "configs/tiny.yaml"
OVERRIDES = ["train.global_batch=8"]
MESHES = ["1,1,1", "8,1,1", "4,2,1", "2,4,1", "2,2,2"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict], str, Path]:
    out = tmp_path_factory.mktemp("sweep")
    printed = io.StringIO()
    argv = ["--config", CONFIG, "--meshes", " ".join(MESHES), "--steps", "1", "--out", str(out)]
    with contextlib.redirect_stdout(printed):
        assert main([*argv, "--memory-gib", "1", *OVERRIDES]) == 0
    lines = (out / "sweep.jsonl").read_text().splitlines()
    rows = {record["mesh"]: record for record in map(json.loads, lines)}
    return rows, printed.getvalue(), out


def test_every_mesh_gets_a_row_sorted_by_speed_with_a_chart(sweep):
    rows, _, out = sweep
    assert sorted(rows) == sorted(MESHES)
    speeds = [record["tokens_per_s"] for record in rows.values()]
    assert all(speed > 0 for speed in speeds)
    assert speeds == sorted(speeds, reverse=True)
    for record in rows.values():
        assert record["fits"] is True
        assert record["step_time_s"] > 0
        assert all(math.isfinite(loss) for loss in record["losses"])
    pytest.importorskip("matplotlib")
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sharded_meshes_have_collectives_and_the_single_device_mesh_none(sweep):
    rows, _, _ = sweep
    assert rows["1,1,1"]["devices"] == 1
    assert rows["1,1,1"]["collective_bytes"] == 0
    assert rows["1,1,1"]["collective_executions"] == 0
    for mesh in MESHES[1:]:
        assert rows[mesh]["collective_bytes"] > 0, mesh
    # Pure data parallelism only all-reduces gradients; fsdp adds per-layer weight all-gathers.
    assert rows["8,1,1"]["collectives"]["all-gather"]["executions"] == 0
    assert rows["2,4,1"]["collectives"]["all-gather"]["executions"] > 0


def test_memory_per_device_falls_as_fsdp_grows(sweep):
    rows, _, _ = sweep
    totals = [rows[mesh]["memory"]["total_bytes"] for mesh in ("8,1,1", "4,2,1", "2,4,1")]
    assert totals[0] > totals[1] > totals[2]
    arguments = [rows[mesh]["memory"]["argument_bytes"] for mesh in ("8,1,1", "4,2,1", "2,4,1")]
    assert arguments[0] > 1.9 * arguments[1] > 3.6 * arguments[2]  # the state is split by fsdp


def test_progress_is_a_line_per_mesh_then_a_table_and_a_recommendation(sweep):
    _, printed, _ = sweep
    progress = [line for line in printed.splitlines() if line.startswith("[")]
    assert len(progress) == len(MESHES)
    assert progress[-1].startswith(f"[{len(MESHES)}/{len(MESHES)}]")
    recommended = next(line for line in printed.splitlines() if line.startswith("recommended:"))
    assert "1,1,1" not in recommended.split(",", 1)[0]  # a subset mesh is a baseline only


def test_a_mesh_over_the_memory_limit_is_marked_and_not_run():
    config = load_config(CONFIG, OVERRIDES)
    row = measure_mesh(config, MeshShape(1, 1, 1), steps=1, memory_gib=0.001)
    assert row.fits is False
    assert row.tokens_per_s is None
    assert row.memory["total_bytes"] > 0.001 * 2**30


@pytest.mark.parametrize(
    ("meshes", "overrides", "named"),
    [
        ("3,1,1", [], "uses 3 devices"),
        ("16,1,1", [], "uses 16 devices"),
        ("2,2", [], "'2,2'"),
        ("8,1,1", ["train.global_batch=4"], "train.global_batch=4"),
        ("1,1,8", ["model.num_heads=4", "model.num_kv_heads=4"], "model.num_heads=4"),
    ],
)
def test_impossible_meshes_are_rejected_up_front_with_one_line(
    meshes, overrides, named, tmp_path, capsys
):
    out = tmp_path / "never"
    argv = ["--config", CONFIG, "--meshes", f"2,2,2 {meshes}", "--out", str(out), *overrides]
    assert main(argv) == 2
    captured = capsys.readouterr()
    error_lines = captured.err.strip().splitlines()
    assert len(error_lines) == 1
    assert error_lines[0].startswith("msjax.sweep: error:")
    assert named in error_lines[0]
    assert not out.exists()
    assert "[1/" not in captured.out  # nothing was compiled


def test_auto_tries_every_factorisation_the_config_accepts():
    config = load_config(CONFIG, OVERRIDES)
    meshes = resolve_meshes("auto", config, 8)
    assert len(meshes) == 10  # all (data, fsdp, tensor) with product 8 pass for tiny
    assert {mesh.devices for mesh in meshes} == {8}
    small_heads = load_config(CONFIG, [*OVERRIDES, "model.num_heads=4", "model.num_kv_heads=4"])
    assert MeshShape(1, 1, 8) not in resolve_meshes("auto", small_heads, 8)
