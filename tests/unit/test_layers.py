"""Imports point one way: a module imports only its own layer and those below (DESIGN.md)."""

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


def _is_package_of(module: str, importer: str) -> bool:
    """`from msjax import x` names the package msjax itself (layer 0) on the way to x."""
    return importer.startswith(module + ".") and module in ("msjax",)


def test_every_module_imports_only_its_own_layer_and_below():
    problems = upward_imports()
    assert not problems, "upward imports:\n" + "\n".join(problems)


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
