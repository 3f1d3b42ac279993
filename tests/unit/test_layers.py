"""Imports point one way: a module imports only its own layer and those below, and no modules
import each other in a circle, inside a layer either (DESIGN.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Module name prefixes per layer, from the bottom; the longest matching prefix decides.
LAYERS: dict[int, tuple[str, ...]] = {
    0: (
        "msjax",
        "msjax.config",
        "msjax.config_file",
        "msjax.config_checks",
        "msjax.errors",
        "msjax.cli",
    ),
    1: ("pallas_kernels",),
    2: ("msjax.parallel",),
    3: ("msjax.ops",),
    4: ("msjax.models",),
    5: ("msjax.step", "msjax.state_layout", "msjax.optim"),
    6: (
        "msjax.data",
        "msjax.checkpoint",
        "msjax.observe",
        "msjax.resilience",
        "msjax.run_dir",
        "msjax.run_lock",
        "msjax.distributed",
    ),
    7: ("msjax.train", "msjax.training"),
    8: (
        "msjax.planner",
        "msjax.plan",
        "msjax.sweep",
        "msjax.report",
        "msjax.flops",
        "msjax.launch",
        "msjax.doctor",
        "msjax.hf",
        "msjax.generate",
    ),
}
# Modules of layer 0 besides the config itself: the resolution and the batch's field names.
LAYERS[0] += ("msjax.resolve", "msjax.batch")


def layer_of(module: str) -> int | None:
    """The layer of an msjax or pallas_kernels module (None for anything else)."""
    best, best_length = None, -1
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > best_length:
                best, best_length = layer, len(prefix)
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, at any depth (functions included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.is_relative_to(REPO) else path.stem
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            # `from msjax import ops` imports the submodule msjax.ops
            found += [
                (node.lineno, f"{module}.{alias.name}")
                for alias in node.names
                if _is_module(f"{module}.{alias.name}")
            ]
    return found


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def source_files() -> list[Path]:
    return sorted([*(REPO / "msjax").rglob("*.py"), *(REPO / "pallas_kernels").rglob("*.py")])


def upward_imports(files: dict[str, Path] | None = None) -> list[str]:
    """Problems found in files (module name -> path; default: every msjax and kernel module)."""
    if files is None:
        files = {module_name(path): path for path in source_files()}
    problems = []
    for importer, path in files.items():
        own = layer_of(importer)
        if own is None:
            problems.append(f"{importer}: in no layer; add it to LAYERS")
            continue
        for line, module in imported_modules(path):
            target = layer_of(module)
            if target is not None and target > own and not _is_package_of(module, importer):
                problems.append(f"{importer}:{line}: layer {own} imports {module} (layer {target})")
    return problems


def import_graph(files: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module -> the modules of `files` it imports when it runs, at any depth (functions
    included); an import of a name from a module counts as an import of that module. Imports for
    type checkers alone (`if TYPE_CHECKING:`) load nothing, so they make no circle."""
    if files is None:
        files = {module_name(path): path for path in source_files()}
    graph: dict[str, set[str]] = {module: set() for module in files}
    for importer, path in files.items():
        type_only = _type_checking_lines(path)
        for line, module in imported_modules(path):
            if line in type_only:
                continue
            while module and module not in files:  # `from a.b import name`: the module a.b
                module = module.rpartition(".")[0]
            if module and module != importer:
                graph[importer].add(module)
    return graph


def _type_checking_lines(path: Path) -> set[int]:
    """The lines of the file's `if TYPE_CHECKING:` blocks."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        test = node.test if isinstance(node, ast.If) else None
        name = getattr(test, "id", None) or getattr(test, "attr", None)
        if name == "TYPE_CHECKING":
            for statement in node.body:
                lines.update(range(statement.lineno, (statement.end_lineno or 0) + 1))
    return lines


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of the graph: each strongly connected component of two modules or more,
    sorted (Tarjan's algorithm, iterative so that a deep graph cannot overflow the stack)."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = lowlink[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    lowlink[parent] = min(lowlink[parent], lowlink[node])
                if lowlink[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
            elif target not in index:
                index[target] = lowlink[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(sorted(graph.get(target, ())))))
            elif target in on_stack:
                lowlink[node] = min(lowlink[node], index[target])
    return sorted(circles)


def _is_package_of(module: str, importer: str) -> bool:
    """`from msjax import x` names the package msjax itself (layer 0) on the way to x."""
    return importer.startswith(module + ".") and module in ("msjax",)


def test_every_module_imports_only_its_own_layer_and_below():
    problems = upward_imports()
    assert not problems, "upward imports:\n" + "\n".join(problems)


def test_no_modules_import_each_other_in_a_circle():
    circles = import_circles(import_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_check_names_every_module_of_a_circle(tmp_path):
    """A control: three modules of one layer in a circle, one through an import inside a
    function and one through a name imported from a module; a fourth imported by them, which
    imports one of them back only for type checkers."""
    probes = {
        "msjax.launch.probe_a": "from msjax.launch.probe_b import run\n",
        "msjax.launch.probe_b": "def run():\n    import msjax.launch.probe_c\n",
        "msjax.launch.probe_c": "import msjax.launch.probe_a\nimport msjax.launch.probe_d\n",
        "msjax.launch.probe_d": "from typing import TYPE_CHECKING\n\n"
        "if TYPE_CHECKING:\n    from msjax.launch.probe_c import x\n",
    }
    files = {}
    for module, text in probes.items():
        files[module] = tmp_path / f"{module}.py"
        files[module].write_text(text)
    graph = import_graph(files)
    assert graph["msjax.launch.probe_b"] == {"msjax.launch.probe_c"}
    assert graph["msjax.launch.probe_d"] == set()
    assert import_circles(graph) == [
        ["msjax.launch.probe_a", "msjax.launch.probe_b", "msjax.launch.probe_c"]
    ]
    assert upward_imports(files) == []  # one layer: only the circle check sees it


def test_import_circles_reads_each_strongly_connected_component():
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}, "e": {"a"}, "f": set()}
    assert import_circles(graph) == [["a", "b"], ["c", "d"]]


def test_kernels_import_nothing_of_msjax():
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in sorted((REPO / "pallas_kernels").rglob("*.py"))
        for line, module in imported_modules(path)
        if module == "msjax" or module.startswith("msjax.")
    ]
    assert not offenders, offenders


@pytest.mark.parametrize(
    ("module", "layer"),
    [("msjax.config", 0), ("pallas_kernels.rms_norm", 1), ("msjax.train", 7), ("msjax.x", 0)],
)
def test_layer_of_reads_the_longest_prefix(module, layer):
    assert layer_of(module) == layer


def test_the_check_catches_upward_and_unplaced_imports(tmp_path):
    """A control: an ops module importing the trainer, a kernel importing a model, a stray."""
    probes = {
        "msjax.ops.probe": "import os\n\ndef f():\n    from msjax.train import train\n",
        "pallas_kernels.probe": "from msjax import models\n",
        "stray.probe": "import msjax\n",
    }
    files = {}
    for module, text in probes.items():
        files[module] = tmp_path / f"{module}.py"
        files[module].write_text(text)
    problems = upward_imports(files)
    assert "msjax.ops.probe:4: layer 3 imports msjax.train (layer 7)" in problems
    assert "pallas_kernels.probe:1: layer 1 imports msjax.models (layer 4)" in problems
    assert "stray.probe: in no layer; add it to LAYERS" in problems
    assert len(problems) == 3
