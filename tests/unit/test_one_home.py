"""Each fact a run depends on is written down in one module and imported everywhere else."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMPLS = {"xla", "pallas", "cudnn", "triton"}
RUN_DIR_NAMES = {
    "config.yaml",
    "config.json",
    "job_config.yaml",
    "data.json",
    "xla_flags.json",
    "mfu.json",
    "metrics.jsonl",
    "ranks.jsonl",
    "goodput.json",
    "skipped_steps.json",
    "faults.jsonl",
    "incidents.jsonl",
    "checkpoints",
    "heartbeats",
    "flight",
    "incidents",
    "logs",
    "compile_cache",
    "health",
    "slot_faults.jsonl",
    "bad_slots.json",
}


def modules() -> dict[str, ast.AST]:
    return {
        str(path.relative_to(REPO)): ast.parse(path.read_text())
        for path in sorted((REPO / "msjax").rglob("*.py"))
    }


def string_constants(tree: ast.AST) -> list[str]:
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def string_sequences(tree: ast.AST) -> list[tuple[str, ...]]:
    """Tuple, list and set literals made only of strings (Literal[...] subscripts included)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts:
            values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if len(values) == len(node.elts) and all(isinstance(v, str) for v in values):
                found.append(tuple(values))
    return found


def where(predicate) -> list[str]:
    return [path for path, tree in modules().items() if predicate(tree)]


def test_the_batch_fields_are_listed_in_one_module():
    fields = ("inputs", "targets", "positions", "segment_ids")
    assert where(lambda tree: fields in string_sequences(tree)) == ["msjax/batch.py"]


def test_the_kernel_choices_are_listed_in_one_module():
    def lists_kernels(tree: ast.AST) -> bool:
        return any(len(IMPLS & set(values)) >= 2 for values in string_sequences(tree))

    # the config's Literal types (the MoE section's own in moe_config.py); resolve.py names the
    # two without an interpreter
    assert where(lists_kernels) == ["msjax/config.py", "msjax/moe_config.py", "msjax/resolve.py"]
    resolve_sequences = string_sequences(modules()["msjax/resolve.py"])
    assert [v for v in resolve_sequences if IMPLS & set(v)] == [("cudnn", "triton")]


@pytest.mark.parametrize(
    ("fact", "home"),
    [
        ("jax_num_cpu_devices", "msjax/parallel/mesh.py"),  # simulated CPU devices
        ("%Y%m%d-%H%M%S", "msjax/resolve.py"),  # run-dir names by time
        ("runs", "msjax/resolve.py"),  # the folder of default run dirs
    ],
)
def test_a_setting_is_spelled_in_one_module(fact, home):
    assert where(lambda tree: fact in string_constants(tree)) == [home]


def path_names(tree: ast.AST) -> set[str]:
    """File names anywhere, and folder names where a path is joined (`path / "checkpoints"`)."""
    files = {name for name in string_constants(tree) if "." in name}
    joined = {
        side.value
        for node in ast.walk(tree)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
        for side in (node.left, node.right)
        if isinstance(side, ast.Constant) and isinstance(side.value, str)
    }
    return files | joined


def test_run_directory_names_appear_only_in_run_dir():
    spelled = {path: sorted(RUN_DIR_NAMES & path_names(tree)) for path, tree in modules().items()}
    elsewhere = {path: names for path, names in spelled.items() if names}
    # A Hugging Face directory's own config.json, not the run directory's
    assert elsewhere.pop("msjax/llama_config.py", None) == ["config.json"]
    assert list(elsewhere) == ["msjax/run_dir.py"], elsewhere
    assert elsewhere["msjax/run_dir.py"] == sorted(RUN_DIR_NAMES)


def test_the_state_layout_is_derived_in_the_state_layout_module_only():
    def derives_optimizer_state(tree: ast.AST) -> bool:
        return any(
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "eval_shape"
            and any(getattr(arg, "attr", None) == "init" for arg in node.args)
            for node in ast.walk(tree)
        )

    assert where(derives_optimizer_state) == ["msjax/state_layout.py"]


def test_a_rank_s_heartbeat_is_made_in_one_place_of_the_run():
    """prepare.py makes the rank's one heartbeat; the data phase and the loop's resilience
    listener share it (a second one would write the same file with its own phase and clock)."""
    made_in = sorted(
        name
        for name, tree in modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "Heartbeat"
    )
    # resilience/worker.py's is the stack-dump handler from a worker's first line, before the run
    # is prepared; it never beats
    assert made_in == ["msjax/resilience/worker.py", "msjax/training/prepare.py"]
