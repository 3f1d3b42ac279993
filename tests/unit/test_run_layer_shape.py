"""The run layer's shape: preparation from small named builders, one owner per decision (saves
settle their own failures), the steps as methods, and functions short enough to read."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_LAYER = [REPO / "msjax" / "train.py", *sorted((REPO / "msjax" / "training").glob("*.py"))]


def functions(path: Path) -> list[tuple[str, int]]:
    """(name, lines) of every function and method in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def test_no_function_of_the_run_layer_passes_60_lines_nor_a_file_500():
    long_functions = [
        f"{path.relative_to(REPO)}:{name} ({lines} lines)"
        for path in RUN_LAYER
        for name, lines in functions(path)
        if lines > 60
    ]
    long_files = [
        f"{path.relative_to(REPO)} ({count} lines)"
        for path in RUN_LAYER
        if (count := len(path.read_text().splitlines())) >= 500
    ]
    assert not long_functions and not long_files, (long_functions, long_files)


def test_a_run_is_prepared_by_builders_under_40_lines_each():
    prepare = REPO / "msjax" / "training" / "prepare.py"
    lengths = dict(functions(prepare))
    builders = {name: lines for name, lines in lengths.items() if name.startswith("build_")}
    assert {"build_run", "build_data", "build_state", "build_events"} <= set(builders)
    assert all(lines < 40 for lines in lengths.values()), lengths


def test_the_loop_leaves_failing_saves_to_the_save_owner():
    from msjax.training.decisions import Decider

    loop = (REPO / "msjax" / "train.py").read_text()
    assert "SavesFailing" not in loop  # CheckpointSaves.after_step ends the attempt
    decider_parameters = inspect.signature(Decider).parameters
    assert "schedule" not in decider_parameters and "saves" in decider_parameters
    decisions = (REPO / "msjax" / "training" / "decisions.py").read_text()
    assert ".schedule" not in decisions  # the save schedule is the save owner's alone


def test_drills_reach_the_loop_through_one_handle():
    loop = ast.parse((REPO / "msjax" / "train.py").read_text())
    reached = {
        node.attr
        for node in ast.walk(loop)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "resilience"
    }
    assert not reached & {"skips", "batch", "after_update", "loss"}, reached


def test_the_train_and_eval_steps_are_methods_not_fields_set_after_construction():
    from msjax import step

    fields = {field.name for field in dataclasses.fields(step.TrainProgram)}
    assert not fields & {"train_step", "eval_step"}
    build = inspect.getsource(step.build_program)
    assert "program.train_step =" not in build and "program.eval_step =" not in build
    assert inspect.isfunction(step.UpdateStep.train_step)
