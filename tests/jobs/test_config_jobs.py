"""Specifications of the config tree and of how `python -m msjax.train` reports user errors."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_config import (
    DEVICES,
    REPO_ROOT,
    USER_ERRORS,
    assert_one_line_user_error,
    write_bad_config_files,
)

from msjax.config import (
    Config,
    TrainConfig,
    config_from_dict,
)


def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m msjax.train args` as a real process in cwd, on 8 simulated CPU devices."""
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(DEVICES))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "msjax.train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "name", ["unknown_key", "mesh_product", "invalid_yaml_file"], ids=lambda name: name
)
def test_user_error_in_a_real_process_is_one_line_without_traceback(tmp_path, name):
    args, fragments = USER_ERRORS[name]
    write_bad_config_files(tmp_path)
    before = sorted(tmp_path.iterdir())
    run_dir = tmp_path / "run"
    argv = [arg.format(tmp=tmp_path) for arg in args] + [f"run.dir={run_dir}"]
    result = run_cli(tmp_path, *argv)
    assert_one_line_user_error(result.returncode, result.stdout, result.stderr, *fragments)
    assert not run_dir.exists()
    assert sorted(tmp_path.iterdir()) == before


def test_print_config_in_a_real_process_exits_0_and_creates_no_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(tmp_path, "--print-config", "train.steps=7", f"run.dir={run_dir}")
    assert (result.returncode, result.stderr) == (0, "")
    printed = config_from_dict(yaml.safe_load(result.stdout))
    assert printed == dataclasses.replace(
        Config(),
        train=TrainConfig(steps=7),
        run=dataclasses.replace(Config().run, dir=str(run_dir)),
    )
    assert list(tmp_path.iterdir()) == []
