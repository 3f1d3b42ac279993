"""The fast tier: every test here runs in this process; one that starts a process, in itself or
in a fixture of any scope, fails (tests/process_guard.py) with a line saying it belongs in
tests/jobs/.

JAX's backend starts here, once: an in-process run that starts it first would fork a copy of
this process to ask XLA about XLA_FLAGS (msjax.parallel.xla_flags.apply_xla_profile), so which
test forks would depend on the order the tests run in.
"""

import jax
import pytest
from process_guard import processes_refused

jax.devices()


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
