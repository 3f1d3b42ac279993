"""A user's second run on one machine: the same job twice on one compile cache (JAX's own, warm
from the first run, and msjax's signed executables), with a crash and a restart in the second.
The restart must train on from its checkpoint to the same losses as the first run, on every
Python (and so jax version) msjax supports: CI names the second interpreter in
MSJAX_SECOND_PYTHON (Python 3.12, jax 0.12) beside this one (Python 3.11, jax 0.10)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import job_env
from small_runs import QUICK_RUN

from msjax.run_dir import RunDir

SECOND_PYTHON = os.environ.get("MSJAX_SECOND_PYTHON")
PYTHONS = [
    pytest.param(sys.executable, id="this-python"),
    pytest.param(
        SECOND_PYTHON,
        id="second-python",
        marks=pytest.mark.skipif(
            not SECOND_PYTHON, reason="MSJAX_SECOND_PYTHON names no second interpreter"
        ),
    ),
]


def launch(python: str, run_dir: Path, user_cache: Path, *launcher_args: str):
    command = [
        python,
        "-m",
        "msjax.launch",
        "--nprocs=1",
        "--devices-per-proc=1",
        *launcher_args,
        "--",
        *QUICK_RUN,
        "train.eval_every=0",
        "train.steps=6",
        "checkpoint.every_steps=2",
        "mesh.data=1",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "resilience.heartbeat_every_s=0.05",
        "resilience.restart_backoff_s=0.1",
        f"run.dir={run_dir}",
    ]
    # this test's own user cache folder: the first run warms it, whatever the session compiled
    env = job_env(MSJAX_CACHE_DIR=str(user_cache))
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_NUM_CPU_DEVICES"):
        env.pop(name, None)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def losses(run_dir: Path) -> dict[int, float]:
    lines = RunDir(run_dir).metrics.read_text().splitlines()
    return {
        record["step"]: record["loss"]
        for record in map(json.loads, lines)
        if "loss" in record and "step" in record
    }


@pytest.mark.slow
@pytest.mark.parametrize("python", PYTHONS)
def test_a_second_run_on_a_warm_compile_cache_survives_a_crash(python: str, tmp_path: Path):
    user_cache = tmp_path / "user_cache"
    first = launch(python, tmp_path / "first", user_cache)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert any((user_cache / "jax_compile_cache").glob("jit_train_step-*"))

    second_dir = tmp_path / "second"
    second = launch(python, second_dir, user_cache, "--fault=crash@step=3,rank=0")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "NOT_FOUND" not in second.stdout + second.stderr
    incidents = [
        json.loads(line) for line in RunDir(second_dir).incidents_log.read_text().splitlines()
    ]
    assert [(i["cause"], i["action"], i["resumed_from_step"]) for i in incidents] == [
        ("crash", "restart", 2)
    ]
    assert not RunDir(second_dir).bad_slots.exists()
    assert losses(second_dir) == losses(tmp_path / "first")
