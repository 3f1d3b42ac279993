"""Sizes are held like the layers: no function in msjax/ over 60 lines, no file over 500.

What is over a limit today is listed below with its current size; the list may only shrink.
An entry that has grown, or is no longer over its limit, fails too, so the list is edited down
as the code shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60

# `path` (a file) or `path:function` (dotted through classes and enclosing functions): its size
# in lines today. Shrink an entry's number as the code shrinks; remove it once under the limit.
ALLOWED_OVER: dict[str, int] = {}


def function_sizes(tree: ast.AST, prefix: str = "") -> dict[str, int]:
    """Each function's dotted name (through classes and enclosing functions) -> its lines,
    from the `def` line to its last line."""
    sizes: dict[str, int] = {}
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                sizes[name] = node.end_lineno - node.lineno + 1
            sizes.update(function_sizes(node, name + "."))
        else:
            sizes.update(function_sizes(node, prefix))
    return sizes


def sizes_over_limits(root: Path) -> dict[str, int]:
    """Every file under `root`/msjax over MAX_FILE_LINES and every function over
    MAX_FUNCTION_LINES, keyed `path` or `path:function` (paths relative to `root`)."""
    over: dict[str, int] = {}
    for path in sorted((root / "msjax").rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        source = path.read_text()
        file_lines = len(source.splitlines())
        if file_lines > MAX_FILE_LINES:
            over[relative] = file_lines
        for name, lines in function_sizes(ast.parse(source)).items():
            if lines > MAX_FUNCTION_LINES:
                over[f"{relative}:{name}"] = lines
    return over


def size_problems(over: dict[str, int], allowed: dict[str, int]) -> list[str]:
    """One line per breach of the limits or of the allowlist's promise to only shrink."""
    problems = []
    for place, lines in sorted(over.items()):
        limit = MAX_FUNCTION_LINES if ":" in place else MAX_FILE_LINES
        if place not in allowed:
            problems.append(f"{place}: {lines} lines, over the limit of {limit}; split it")
        elif lines > allowed[place]:
            problems.append(
                f"{place}: {lines} lines, grown past its listed {allowed[place]}; shrink it"
            )
        elif lines < allowed[place]:
            problems.append(
                f"{place}: {lines} lines, shrunk from its listed {allowed[place]}; "
                f"set its entry in ALLOWED_OVER to {lines}"
            )
    for place in sorted(set(allowed) - set(over)):
        problems.append(f"{place}: no longer over its limit; remove it from ALLOWED_OVER")
    return problems


def test_no_file_or_function_in_msjax_is_over_its_size_limit_unless_listed():
    problems = size_problems(sizes_over_limits(REPO), ALLOWED_OVER)
    assert not problems, "\n".join(problems)


def test_a_new_long_function_or_long_file_fails(tmp_path: Path):
    package = tmp_path / "msjax"
    (package / "room").mkdir(parents=True)
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (package / "grown.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}")
    (package / "room" / "wide.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    over = sizes_over_limits(tmp_path)
    assert over == {"msjax/grown.py:long": 61, "msjax/room/wide.py": 501}
    assert size_problems(over, {}) == [
        "msjax/grown.py:long: 61 lines, over the limit of 60; split it",
        "msjax/room/wide.py: 501 lines, over the limit of 500; split it",
    ]


def test_functions_are_named_through_classes_and_enclosing_functions():
    source = "class Room:\n    def method(self):\n        def inner():\n            pass\n"
    assert function_sizes(ast.parse(source)) == {"Room.method": 3, "Room.method.inner": 2}


def test_a_listed_entry_that_grew_or_shrank_or_left_fails():
    over = {"msjax/a.py": 520, "msjax/b.py:f": 70}
    allowed = {"msjax/a.py": 510, "msjax/b.py:f": 80, "msjax/c.py": 600}
    assert size_problems(over, allowed) == [
        "msjax/a.py: 520 lines, grown past its listed 510; shrink it",
        "msjax/b.py:f: 70 lines, shrunk from its listed 80; set its entry in ALLOWED_OVER to 70",
        "msjax/c.py: no longer over its limit; remove it from ALLOWED_OVER",
    ]
