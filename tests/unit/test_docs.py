"""The docs hold together: reference pages match the code, every page is linked, links resolve,
and the README stays a front page."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def load_make_reference():
    """docs/make_reference.py as a module (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("make_reference", REPO / "docs/make_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_reference = load_make_reference()


def doc_pages() -> list[Path]:
    """Every Markdown page whose links are checked."""
    pages = [REPO / "README.md", REPO / "launch/README.md", REPO / "benchmarks/RESULTS.md"]
    return pages + sorted((REPO / "docs").rglob("*.md"))


def outside_code(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes for a page's headings (a repeated one gets -1, -2, ...)."""
    found: set[str] = set()
    for line in outside_code(page.read_text(encoding="utf-8")):
        heading = re.match(r"#+ (.*)", line)
        if heading is None:
            continue
        anchor = make_reference._anchor(heading.group(1).replace("`", "").strip())
        candidate, repeat = anchor, 0
        while candidate in found:
            repeat += 1
            candidate = f"{anchor}-{repeat}"
        found.add(candidate)
    return found


def relative_links(page: Path) -> list[str]:
    links = []
    for line in outside_code(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if not re.match(r"[a-z]+:", target):  # http:, https:, mailto: are not checked
                links.append(target)
    return links


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """page's relative links whose file, or #anchor in a Markdown file, does not exist."""
    broken = []
    for link in relative_links(page):
        path_part, _, anchor = link.partition("#")
        target = (page.parent / path_part).resolve() if path_part else page
        if not target.exists():
            broken.append(f"{link} (no file {target.relative_to(root)})")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link} (no heading #{anchor} in {target.relative_to(root)})")
    return broken


def test_reference_pages_match_the_code():
    stale = []
    for page, make in make_reference.PAGES.items():
        path = REPO / page
        if not path.is_file() or path.read_text(encoding="utf-8") != make():
            stale.append(page)
    assert not stale, f"stale reference pages {stale}: run `{make_reference.REGENERATE}`"


def test_every_config_key_has_a_meaning_in_msjax_config():
    missing = make_reference.config_keys_without_meaning()
    assert not missing, f"config keys without a comment in msjax/config.py: {missing}"


def test_every_config_key_is_on_the_config_page():
    from msjax.config import Config

    page = (REPO / "docs/reference/config.md").read_text(encoding="utf-8")
    keys = [f"{section}.{key}" for section, values in Config().to_dict().items() for key in values]
    assert len(keys) > 90
    assert [key for key in keys if f"| `{key}` |" not in page] == []


def test_every_command_with_an_argument_parser_is_on_the_cli_page():
    with_parser = set()
    for path in (REPO / "msjax").rglob("*.py"):
        if path.name != "cli.py" and "ArgumentParser(" in path.read_text(encoding="utf-8"):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            with_parser.add(make_reference.PARSER_HOMES.get(module, module))
    on_page = {module for _, module, _ in make_reference.COMMANDS}
    assert with_parser == on_page


def test_cli_page_shows_the_parsers_flags():
    page = (REPO / "docs/reference/cli.md").read_text(encoding="utf-8")
    for flag in ("--print-config", "--devices-per-proc", "--spares", "--max-new-tokens"):
        assert flag in page


def test_exit_code_page_lists_every_code_and_fault_kind():
    from msjax.resilience import exit_codes, fault_kinds

    page = (REPO / "docs/reference/exit-codes.md").read_text(encoding="utf-8")
    codes = {v for k, v in vars(exit_codes).items() if k.isupper() and isinstance(v, int)}
    for code in codes:
        assert re.search(rf"^\| {code} \| `", page, re.MULTILINE), code
    for kind in fault_kinds.KINDS:
        assert f"| `{kind.name}` |" in page


def test_every_docs_page_is_linked_from_the_readme_or_the_index():
    linked = set()
    for index in (REPO / "README.md", REPO / "docs/index.md"):
        for link in relative_links(index):
            linked.add((index.parent / link.partition("#")[0]).resolve())
    pages = {page.resolve() for page in (REPO / "docs").rglob("*.md")}
    pages.discard((REPO / "docs/index.md").resolve())
    unlinked = sorted(str(page.relative_to(REPO)) for page in pages - linked)
    assert not unlinked, f"pages linked from neither README.md nor docs/index.md: {unlinked}"


def test_relative_links_point_at_files_and_headings_that_exist():
    broken = {
        str(page.relative_to(REPO)): broken_links(page) for page in doc_pages() if page.is_file()
    }
    broken = {page: links for page, links in broken.items() if links}
    assert not broken, f"broken links: {broken}"


def test_the_link_check_sees_a_missing_file_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: here\n")
    page.write_text(
        "[ok](other.md#a-code-heading-here) [gone](missing.md) [no heading](other.md#nowhere)\n"
        "```\n[in code](ignored.md)\n```\n"
    )
    assert broken_links(page, root=tmp_path) == [
        "missing.md (no file missing.md)",
        "other.md#nowhere (no heading #nowhere in other.md)",
    ]


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"
    assert "pytest" in lines  # the fast tier's command, as CI runs it
