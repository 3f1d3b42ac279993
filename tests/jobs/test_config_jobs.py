"""Specifications of the config tree and of how `python -m msjax.train` reports user errors."""

import dataclasses
import subprocess
from pathlib import Path

import pytest
import yaml
from harness import run_to_end, train_command
from test_config import (
    DEVICES,
    assert_one_line_user_error,
    run_main,
)

from msjax.config import (
    Config,
    TrainConfig,
    config_from_dict,
)

USER_ERRORS = {
    "unknown_key": (["model.num_head=4"], ["did you mean model.num_heads"]),
    "unknown_section": (["modle.num_heads=4"], ["did you mean model"]),
    "wrong_type_int": (["train.steps=abc"], ["train.steps", "abc", "integer"]),
    "wrong_type_bool": (["model.parallel_block=1"], ["model.parallel_block=1", "boolean"]),
    "bad_literal": (["optim.name=sgd"], ["sgd", "adamw, lamb"]),
    "mesh_product": (
        ["mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1"],
        ["has 4 devices but 8 are available"],
    ),
    "minus_one_cannot_fill": (
        ["mesh.data=-1", "mesh.fsdp=3", "mesh.tensor=1", "model.embed_dim=96"],
        ["cannot fill 8 devices", "not divisible by 3"],
    ),
    "two_minus_one_axes": (["mesh.data=-1", "mesh.fsdp=-1"], ["only one mesh axis may be -1"]),
    "global_batch": (["train.global_batch=30"], ["train.global_batch=30", "= 4"]),
    "heads_by_tensor": (
        [
            "model.num_heads=6",
            "model.embed_dim=96",
            "model.num_kv_heads=3",
            "mesh.tensor=4",
            "mesh.data=2",
            "mesh.fsdp=1",
        ],
        ["model.num_heads=6", "mesh.tensor=4"],
    ),
    "missing_config_file": (["--config", "{tmp}/absent.yaml"], ["not found", "absent.yaml"]),
    "malformed_override": (["train.steps"], ["'train.steps'", "section.key=value"]),
    "invalid_yaml_file": (["--config", "{tmp}/broken.yaml"], ["broken.yaml", "not valid YAML"]),
    "yaml_file_not_a_mapping": (["--config", "{tmp}/list.yaml"], ["list.yaml", "mapping"]),
    "cudnn_without_gpu": (["model.attention_impl=cudnn"], ["attention_impl=cudnn needs a GPU"]),
}


def write_bad_config_files(directory: Path) -> None:
    (directory / "broken.yaml").write_text("model:\n  num_layers: [4\n")
    (directory / "list.yaml").write_text("- model\n- train\n")


def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m msjax.train args` as a real process in cwd, on 8 simulated CPU devices."""
    return run_to_end(train_command(None, args), 120, cwd, JAX_NUM_CPU_DEVICES=str(DEVICES))


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


@pytest.mark.parametrize(("args", "fragments"), USER_ERRORS.values(), ids=USER_ERRORS.keys())
def test_user_error_is_one_line_exit_2_and_writes_nothing(
    capsys, tmp_path, monkeypatch, args, fragments
):
    monkeypatch.chdir(tmp_path)
    write_bad_config_files(tmp_path)
    before = sorted(tmp_path.iterdir())
    run_dir = tmp_path / "run"
    argv = [arg.format(tmp=tmp_path) for arg in args] + [f"run.dir={run_dir}"]
    code, out, err = run_main(capsys, *argv)
    assert_one_line_user_error(code, out, err, *fragments)
    assert not run_dir.exists()
    assert sorted(tmp_path.iterdir()) == before  # no runs/ in the working directory either
