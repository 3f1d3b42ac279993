"""The fast tier: every test here runs in this process; one that starts a process, in itself or
in a fixture of any scope, fails (tests/process_guard.py) with a line saying it belongs in
tests/jobs/."""

import pytest
from process_guard import processes_refused


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with processes_refused(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with processes_refused(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    with processes_refused(item.nodeid):
        return (yield)
