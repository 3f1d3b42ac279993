"""The fast tier: every test here runs in this process; one that starts a process, in itself or
in a fixture of any scope, fails (tests/process_guard.py) with a line saying it belongs in
tests/jobs/. Bare `pytest` leaves the slow-marked ones (XLA compiles of many meshes) to
`pytest tests`, which runs everything.

JAX's backend starts here, once: an in-process run that starts it first would fork a copy of
this process to ask XLA about XLA_FLAGS (msjax.parallel.xla_flags.apply_xla_profile), so which
test forks would depend on the order the tests run in.
"""

import jax
import pytest
from process_guard import processes_refused

jax.devices()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Bare `pytest` (no paths, no -m): the fast tier, without the slow-marked tests."""
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS or config.option.markexpr:
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]


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
