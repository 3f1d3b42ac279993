"""Checkpoints: exact resume, resume on another mesh, fallback past damaged ones, inspection."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_checkpoint import run, saved_fingerprints
from test_checkpoint import straight_run as straight_run  # a fixture, re-exported for pytest

from msjax.checkpoint.manager import committed_steps

HELD_SAVE_SCRIPT = """
import json, os, sys
from pathlib import Path
import jax.numpy as jnp
from msjax.checkpoint.commits import committed_steps, uncommitted_entries
from msjax.checkpoint.manager import Checkpointer
from msjax.config import CheckpointConfig

directory = Path(sys.argv[1])
checkpointer = Checkpointer(directory, CheckpointConfig())
state = {"weights": jnp.ones((64, 256))}
checkpointer.save(1, state, {})
checkpointer.wait()
checkpointer.hold_write(2)
checkpointer.save(2, state, {})
# how long it may take: two whole saves of the same state, started after it, each committed
witness = Checkpointer(Path(sys.argv[2]), CheckpointConfig())
for step in (1, 2):
    witness.save(step, state, {})
    witness.wait()
found = [committed_steps(directory), uncommitted_entries(directory), checkpointer.save_in_flight()]
found.append(committed_steps(witness.directory))
print(json.dumps(found), flush=True)
os._exit(0)  # as the injected crash in a save does; the held write would never end
"""


def test_a_held_save_stays_unfinished_however_long_its_process_lives(tmp_path: Path):
    """What makes an injected crash_in_save land mid-write on any machine: the held save does
    not commit while the process goes on, and the process dies with it unfinished."""
    done = subprocess.run(
        [sys.executable, "-c", HELD_SAVE_SCRIPT, str(tmp_path / "held"), str(tmp_path / "witness")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    committed, unfinished, in_flight, witnessed = json.loads(done.stdout.splitlines()[-1])
    assert witnessed == [1, 2], done.stdout  # two saves of the same state, begun later, committed
    assert committed == [1] and in_flight, done.stdout  # while 2 is still being written
    assert [name.split(".")[0] for name in unfinished] == ["2"], unfinished
    assert committed_steps(tmp_path / "held") == [1]  # and never finished once its process was gone


@contextlib.contextmanager
def immutable(directory: Path):
    """Nothing can be created in directory, not even by root (ext4's immutable attribute)."""
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_a_failed_save_is_an_infrastructure_fault_that_ends_the_attempt(
    straight_run: Path, tmp_path: Path, policy: str
):
    from msjax.resilience.worker import SavesFailing

    run_dir = tmp_path / policy
    shutil.copytree(straight_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "8")  # resume from 4; the save at 8 (the last) fails
    overrides = (f"checkpoint.on_save_error={policy}",)
    with immutable(run_dir / "checkpoints"):
        # stop: at the first failure; continue: the run's last save cannot be given up on
        expected = (
            "checkpoint save at step 8 failed"
            if policy == "stop"
            else r"the last checkpoint \(step 8\) could not be saved"
        )
        with pytest.raises(SavesFailing, match=expected):
            run(run_dir, *overrides)
    assert committed_steps(run_dir / "checkpoints") == [4]
    assert saved_fingerprints(run_dir, 4) == saved_fingerprints(straight_run, 4)
