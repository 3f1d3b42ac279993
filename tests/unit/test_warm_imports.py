"""A warm standby (msjax.launch.spare) has imported, before a restart hands it a rank, every
module msjax.train imports only when it is called: none of them counts in the restart's time."""

from __future__ import annotations

import ast
from pathlib import Path

from msjax.launch.spare import WARM_IMPORTS

TRAIN = Path(__file__).resolve().parents[2] / "msjax" / "train.py"


def imports_inside_functions(path: Path) -> set[str]:
    """The modules imported in the bodies of path's functions (not at its top level)."""
    found: set[str] = set()
    for function in ast.walk(ast.parse(path.read_text())):
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
    return found


def test_a_standby_has_imported_what_the_trainer_imports_when_called():
    lazy = imports_inside_functions(TRAIN)
    assert "msjax.training.prepare" in lazy  # what the check is about is there to check
    assert lazy - set(WARM_IMPORTS) == set()
