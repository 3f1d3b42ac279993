"""The fast tier's guard: a process started under tests/unit/ fails at the call, in one line
naming the test, the program and tests/jobs/, and nothing is left patched afterwards."""

import multiprocessing
import os
import subprocess
import sys

import pytest
from process_guard import StartsAProcess, processes_refused

STARTS = {
    "subprocess.run": lambda: subprocess.run([sys.executable, "-c", "pass"], check=True),
    "subprocess.Popen": lambda: subprocess.Popen(["true"]),
    "os.posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], dict(os.environ)),
    "os.fork": lambda: os.fork(),
    "multiprocessing": lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
}


@pytest.mark.parametrize("how", sorted(STARTS))
def test_every_way_of_starting_a_process_fails_in_one_line_naming_the_jobs_tier(how, request):
    with pytest.raises(StartsAProcess) as refused:
        STARTS[how]()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{request.node.nodeid} starts a process (")
    assert message.endswith("belongs in tests/jobs/")


def test_a_guard_puts_back_what_it_replaced():
    originals = (subprocess.Popen.__init__, os.fork, os.posix_spawn)
    with processes_refused("a test"):
        assert subprocess.Popen.__init__ is not originals[0]
        assert os.fork is not originals[1]
    assert (subprocess.Popen.__init__, os.fork, os.posix_spawn) == originals
