"""The two tiers can run as one session (`pytest tests`): no test module's name is in both,
since pytest imports test files by their name alone (the folders are no packages)."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_no_test_file_name_is_in_both_tiers():
    names = Counter(path.name for tier in ("unit", "jobs") for path in (TESTS / tier).glob("*.py"))
    assert [name for name, count in names.items() if count > 1] == []
