"""Make the reference pages in docs/reference/ from the code: config keys, exit codes, commands,
pipeline schedules.

Run `python docs/make_reference.py` after changing a config field, an exit code, a fault kind or
a command's arguments; `python docs/make_reference.py --check` says which pages are stale.
A config key's meaning is the comment written with its field in msjax/config.py: the comment
lines directly above the field, then the comment at the end of its line.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import io
import os
import sys
import tokenize
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: msjax from this checkout
    sys.path.insert(0, str(REPO))

REGENERATE = "python docs/make_reference.py"
GENERATED_NOTE = f"<!-- Made from the code by `{REGENERATE}`; edit the code, not this page. -->"

# Every command msjax has, as (the command people type, the module holding its main(), the
# arguments before --help: a subcommand). Each module with an ArgumentParser is here
# (tests/unit/test_docs.py checks it).
COMMANDS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("python -m msjax.train", "msjax.train", ()),
    ("python -m msjax.launch", "msjax.launch.__main__", ()),
    ("python -m msjax.doctor", "msjax.doctor", ()),
    ("python -m msjax.checkpoint", "msjax.checkpoint.__main__", ()),
    ("python -m msjax.checkpoint list", "msjax.checkpoint.__main__", ("list",)),
    ("python -m msjax.checkpoint inspect", "msjax.checkpoint.__main__", ("inspect",)),
    ("python -m msjax.report", "msjax.report", ()),
    ("python -m msjax.plan", "msjax.planner.plan", ()),
    ("python -m msjax.sweep", "msjax.planner.sweep", ()),
    ("python -m msjax.flops", "msjax.flops", ()),
    ("python -m msjax.hf", "msjax.hf.__main__", ()),
    ("python -m msjax.hf export", "msjax.hf.__main__", ("export",)),
    ("python -m msjax.generate", "msjax.generate", ()),
    ("python -m msjax.launch.spare", "msjax.launch.spare", ()),
    ("python -m msjax.resilience.self_checks", "msjax.resilience.self_checks", ()),
)
# Modules whose ArgumentParser serves a command whose main() is elsewhere: module -> that main's
PARSER_HOMES = {"msjax.launch.job_options": "msjax.launch.__main__"}
HELP_COLUMNS = "100"  # argparse wraps --help to the terminal; the page is made at one width


# ---- config keys -------------------------------------------------------------------------


def field_comments(source: str, class_name: str) -> dict[str, str]:
    """Each field of class_name in source -> the comment lines above it joined with its own."""
    comments_by_line: dict[int, str] = {}
    code_lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments_by_line[token.start[0]] = token.string.lstrip("#").strip()
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(token.start[0])
    tree = ast.parse(source)
    found = next(
        node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name
    )
    meanings = {}
    for node in found.body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above = []
        line = node.lineno - 1
        while line in comments_by_line and line not in code_lines:
            above.insert(0, comments_by_line[line])
            line -= 1
        own = comments_by_line.get(node.end_lineno or node.lineno, "")
        meanings[node.target.id] = " ".join(part for part in [*above, own] if part)
    return meanings


def type_text(annotation: Any) -> str:
    """A config annotation as a reader would say it: `a` | `b`, int or null, list of int."""
    origin = get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{choice}`" for choice in get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        options = [option for option in get_args(annotation) if option is not type(None)]
        text = " or ".join(type_text(option) for option in options)
        return f"{text} or null" if len(options) < len(get_args(annotation)) else text
    if dataclasses.is_dataclass(annotation):
        return "section"
    if origin is tuple:
        item = get_args(annotation)[0]
        name = "source" if dataclasses.is_dataclass(item) else type_text(item)
        return f"list of {name}"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: dataclasses.Field) -> str:
    """A field's default as it would be written in a YAML config."""
    has_default = field.default is not dataclasses.MISSING
    value = field.default if has_default else field.default_factory()  # type: ignore[misc]
    if value is None:
        return "`null`"
    if dataclasses.is_dataclass(value):  # a section inside a section: its own table follows
        return "below"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        items = [
            item.path if dataclasses.is_dataclass(item) else str(item)  # a source: its path
            for item in value
        ]
        return f"`[{', '.join(items)}]`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _section_table(prefix: str, section_type: type, meanings: dict[str, str]) -> list[str]:
    hints = typing.get_type_hints(section_type)
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for field in dataclasses.fields(section_type):
        key = f"`{prefix}{field.name}`"
        meaning = _cell(meanings.get(field.name, ""))
        rows.append(
            f"| {key} | {type_text(hints[field.name])} | {default_text(field)} | {meaning} |"
        )
    return rows


def config_reference() -> str:
    """docs/reference/config.md: every key of every section with its type, default, meaning."""
    from msjax import config

    source = Path(config.__file__).read_text(encoding="utf-8")
    lines = [
        "# Config keys",
        "",
        GENERATED_NOTE,
        "",
        "Every key msjax reads, by section, from the config dataclasses in `msjax/config.py` (one",
        "home per key and default). Set a key in a YAML file (`--config FILE`) or on the command",
        "line as `section.key=value`; `null` in YAML (or on the command line) is Python's None.",
        "How configs are loaded and checked: [training and data](../training-and-data.md).",
        "",
    ]
    hints = typing.get_type_hints(config.Config)
    for section in dataclasses.fields(config.Config):
        section_type = hints[section.name]
        lines += [f"## `{section.name}`", "", (section_type.__doc__ or "").strip(), ""]
        home = Path(sys.modules[section_type.__module__].__file__).read_text(encoding="utf-8")
        meanings = field_comments(home, section_type.__name__)
        lines += _section_table(f"{section.name}.", section_type, meanings)
        lines.append("")
        if section.name == "model":
            lines += _moe_section()
        if section.name == "data":
            source_type = config.SourceConfig
            lines += [
                "### Each entry of `data.sources`",
                "",
                (source_type.__doc__ or "").strip(),
                "A plain path is an entry with that `path` and the other keys at their defaults.",
                "",
            ]
            source_meanings = field_comments(source, source_type.__name__)
            lines += _section_table("data.sources[].", source_type, source_meanings)
            lines.append("")
    return "\n".join(lines)


def _moe_section() -> list[str]:
    """The `model.moe` table, from the comments in msjax/moe_config.py."""
    from msjax import moe_config

    source = Path(moe_config.__file__).read_text(encoding="utf-8")
    meanings = field_comments(source, "MoeConfig")
    lines = ["### `model.moe`", "", (moe_config.MoeConfig.__doc__ or "").strip(), ""]
    lines += _section_table("model.moe.", moe_config.MoeConfig, meanings)
    return [*lines, ""]


def config_keys_without_meaning() -> list[str]:
    """Keys whose field in msjax/config.py carries no comment (tests/unit/test_docs.py: none)."""
    from msjax import config

    hints = typing.get_type_hints(config.Config)
    missing = []
    sections = [(s.name, hints[s.name]) for s in dataclasses.fields(config.Config)]
    sections.append(("data.sources[]", config.SourceConfig))
    sections.append(("model.moe", config.MoeConfig))
    for prefix, section_type in sections:
        home = sys.modules[section_type.__module__].__file__
        meanings = field_comments(Path(home).read_text(encoding="utf-8"), section_type.__name__)
        for field in dataclasses.fields(section_type):
            if not meanings.get(field.name):
                missing.append(f"{prefix}.{field.name}")
    return missing


# ---- exit codes and fault kinds ----------------------------------------------------------


def constant_comments(source: str) -> dict[str, str]:
    """Module constants -> their comment: the end of their line and the comment lines after it."""
    lines = source.splitlines()
    comments: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0]
        if not isinstance(target, ast.Name) or not isinstance(node.value, ast.Constant):
            continue
        text = lines[node.lineno - 1]
        parts = [text.partition("#")[2].strip()] if "#" in text else []
        following = node.lineno  # the next line, 0-based
        while following < len(lines) and lines[following].startswith("# "):
            parts.append(lines[following][2:].strip())
            following += 1
        comments[target.id] = " ".join(parts)
    return comments


def exit_codes_reference() -> str:
    """docs/reference/exit-codes.md: every exit code, then every kind of fault."""
    from msjax.resilience import exit_codes, fault_kinds

    source = Path(exit_codes.__file__).read_text(encoding="utf-8")
    comments = constant_comments(source)
    codes = [
        (name, value)
        for name, value in vars(exit_codes).items()
        if name.isupper() and isinstance(value, int)
    ]
    lines = [
        "# Exit codes and fault kinds",
        "",
        GENERATED_NOTE,
        "",
        "Every exit code of `msjax.train`, `msjax.launch` and the other commands, from",
        "`msjax/resilience/exit_codes.py`; retryable codes are worth a fresh job elsewhere, fatal",
        "ones fail the same way again. What a scheduler should do with each, and how the",
        "supervisor reaches it: [recovery](../recovery.md#exit-codes).",
        "",
        "| code | name | retry | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for name, value in sorted(codes, key=lambda item: item[1]):
        if value in exit_codes.RETRYABLE:
            retry = "retryable"
        elif value in exit_codes.FATAL:
            retry = "fatal"
        else:
            retry = ""
        lines.append(f"| {value} | `{name}` | {retry} | {_cell(comments.get(name, ''))} |")
    lines += [
        "",
        "## Fault kinds",
        "",
        "Each kind of fault is one row of `KINDS` in `msjax/resilience/fault_kinds.py`: the",
        "exceptions a worker raises for it, the exit code it leaves with, the cause its incident",
        "names and what the supervisor does (`msjax.launch.policy.decide` applies the restart",
        "budget and the limits around it). The first row whose exceptions match a worker's error",
        "decides; a row without exceptions is one the supervisor alone sees (or reads from an",
        "exit code). `names slot`: the rank it names is the cause, so its slot's faults in a row",
        "count towards `resilience.max_faults_per_slot`.",
        "",
        "| kind | cause | action | exit code | exceptions | names slot |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kind in fault_kinds.KINDS:
        code = kind.exit_code if kind.exit_code is not None else kind.stop_code
        code_text = "" if code is None else str(code)
        if kind.exit_code is None and kind.stop_code is not None:
            code_text += " (the launcher's)"
        exceptions = ", ".join(f"`{error.__name__}`" for error in kind.exceptions)
        lines.append(
            f"| `{kind.name}` | `{kind.cause}` | `{kind.action}` | {code_text} | {exceptions} "
            f"| {'yes' if kind.names_slot else 'no'} |"
        )
    lines += [
        "",
        "Actions: "
        + ", ".join(f"`{action}`" for action in fault_kinds.ACTIONS)
        + ". An exit code no row has is read as a `crash`.",
        "",
    ]
    return "\n".join(lines)


# ---- command lines -----------------------------------------------------------------------


def command_help(module_name: str, before_help: Sequence[str]) -> str:
    """What `--help` prints for a command, read from its parser in this process."""
    module = importlib.import_module(module_name)
    main: Callable[[list[str]], Any] = module.main
    printed = io.StringIO()
    saved_columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        with contextlib.redirect_stdout(printed), contextlib.suppress(SystemExit):
            main([*before_help, "--help"])
    finally:
        if saved_columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved_columns
    return printed.getvalue().rstrip()


def cli_reference() -> str:
    """docs/reference/cli.md: every command's --help."""
    lines = [
        "# Command lines",
        "",
        GENERATED_NOTE,
        "",
        "What each msjax command prints for `--help`. Every one answers a usage mistake with one",
        "line on stderr and exit code 2 ([exit codes](exit-codes.md)); `msjax.launch.spare` and",
        "`msjax.resilience.self_checks` are started by the launcher and the doctor, not by hand.",
        "",
    ]
    lines += [f"- [`{command}`](#{_anchor(command)})" for command, _, _ in COMMANDS]
    lines.append("")
    for command, module_name, before_help in COMMANDS:
        lines += [f"## {command}", "", "```text", command_help(module_name, before_help), "```", ""]
    return "\n".join(lines)


def _anchor(heading: str) -> str:
    """The anchor GitHub makes for a heading: lower case, punctuation gone, spaces to dashes."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


# ---- pipeline schedules ------------------------------------------------------------------

# (schedule, stages P, repeats R, microbatches M) drawn on the page
SCHEDULE_EXAMPLES = (
    ("gpipe", 2, 1, 4),
    ("circular", 2, 2, 4),
    ("1f1b", 2, 1, 4),
    ("1f1b", 4, 1, 4),
)


def _action_text(kind: int, microbatch: int, repeat: int, repeats: int) -> str:
    from msjax.parallel import schedules

    if kind == schedules.IDLE:
        return "."
    letter = "F" if kind == schedules.FORWARD else "B"
    return f"{letter}{microbatch}" + (f" r{repeat}" if repeats > 1 else "")


def schedules_reference() -> str:
    """docs/reference/schedules.md: a few schedules' tables from msjax.parallel.schedules."""
    from msjax.parallel import schedules

    lines = [
        "# Pipeline schedule tables",
        "",
        GENERATED_NOTE,
        "",
        "Every pipeline schedule is a table (`msjax/parallel/schedules.py`): per iteration and",
        "stage, which microbatch (and repeat) runs forward (`F`) or backward (`B`), or nothing",
        "(`.`). The traced loops execute these tables, and the step and the planner read their",
        "facts. Under gpipe and circular the backward is autodiff through the forward loop, so",
        "their tables hold forwards only. How to choose one: [parallelism](../parallelism.md).",
        "",
    ]
    for name, stages, repeats, microbatches in SCHEDULE_EXAMPLES:
        table = schedules.schedule_table(name, stages, repeats, microbatches)
        title = f"`{name}`, P={stages}, M={microbatches}" + (
            f", R={repeats}" if repeats > 1 else ""
        )
        lines += [
            f"## {title}",
            "",
            f"{table.iterations} iterations, bubble {table.bubble_fraction:.1%}, "
            f"{table.stash_slots} microbatches stashed a stage at most, "
            f"{table.sends_per_iteration:g} stage activations (or gradients) a device sends over "
            "`pipe` per iteration on average (forward and backward).",
            "",
            "| iteration | " + " | ".join(f"stage {stage}" for stage in range(stages)) + " |",
            "| --- |" + " --- |" * stages,
        ]
        for iteration in range(table.iterations):
            cells = []
            for stage in range(stages):
                kind, microbatch, repeat, _ = table.at(iteration, stage)
                cells.append(_action_text(kind, microbatch, repeat, table.repeats))
            lines.append(f"| {iteration} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


# ---- the pages ---------------------------------------------------------------------------

PAGES: dict[str, Callable[[], str]] = {
    "docs/reference/config.md": config_reference,
    "docs/reference/exit-codes.md": exit_codes_reference,
    "docs/reference/cli.md": cli_reference,
    "docs/reference/schedules.md": schedules_reference,
}


def stale_pages() -> list[str]:
    """The reference pages whose file differs from what the code makes now."""
    stale = []
    for page, make in PAGES.items():
        path = REPO / page
        if not path.is_file() or path.read_text(encoding="utf-8") != make():
            stale.append(page)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        for page in stale:
            print(f"stale: {page} (run {REGENERATE})")
        return 1 if stale else 0
    for page, make in PAGES.items():
        path = REPO / page
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(make(), encoding="utf-8")
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
