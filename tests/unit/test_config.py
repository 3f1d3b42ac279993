"""Specifications of the config tree and of how `python -m msjax.train` reports user errors."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from msjax.config import (
    Config,
    MeshConfig,
    TrainConfig,
    config_from_dict,
    load_config,
)
from msjax.errors import ConfigError
from msjax.resolve import check_device_count, resolve_mesh_shape
from msjax.run_dir import RunDir, save_config
from msjax.train import main

REPO_ROOT = Path(__file__).resolve().parents[2]


CONFIGS = REPO_ROOT / "configs"


SHIPPED_CONFIGS = sorted(CONFIGS.glob("*.yaml"))


DEVICES = 8  # conftest.py: JAX_NUM_CPU_DEVICES=8


# The cheapest settings that still reach train()'s run-directory check.
SMALL_RUN = ("train.steps=1", "data.max_corpus_mib=1", "train.eval_every=0", "train.peak_tflops=1")


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of msjax.train.main(args), in this process."""
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_user_error(code: int, out: str, err: str, *fragments: str) -> None:
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("msjax.train: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def test_tiny_yaml_spells_out_exactly_the_defaults():
    assert load_config(CONFIGS / "tiny.yaml") == Config()


def test_no_config_file_means_the_defaults():
    assert load_config() == Config()


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=[p.stem for p in SHIPPED_CONFIGS])
def test_every_shipped_config_loads_and_is_named_after_its_file(path):
    assert load_config(path).run.name == path.stem


def test_overrides_replace_only_their_key_of_a_config_file():
    config = load_config(CONFIGS / "small.yaml", ["train.steps=7"])
    assert config.train.steps == 7
    assert config.train.global_batch == 16
    assert config.model.num_layers == 12
    assert config.optim.learning_rate == 1e-3


def test_a_later_override_of_the_same_key_wins():
    config = load_config(None, ["model.attention_window=64", "model.attention_window=null"])
    assert config.model.attention_window is None


def test_llama_1b_fills_the_data_axis_with_all_devices():
    config = check_device_count(load_config(CONFIGS / "llama_1b.yaml"), DEVICES)
    assert config.mesh == MeshConfig(data=8, fsdp=1, tensor=1)


def test_print_config_prints_yaml_that_loads_back_to_the_same_config_and_writes_nothing(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    overrides = ["model.parallel_block=true", "train.steps=7", f"run.dir={run_dir}"]
    code, out, err = run_main(
        capsys, "--config", str(CONFIGS / "tiny.yaml"), "--print-config", *overrides
    )
    assert (code, err) == (0, "")
    printed = config_from_dict(yaml.safe_load(out))
    assert printed == load_config(CONFIGS / "tiny.yaml", overrides)
    assert printed.model.parallel_block is True
    assert printed.train.steps == 7
    assert printed.run.dir == str(run_dir)
    assert not run_dir.exists()
    assert list(tmp_path.iterdir()) == []  # no runs/<name>-<stamp> either


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=[p.stem for p in SHIPPED_CONFIGS])
def test_print_config_round_trips_every_shipped_config(capsys, path):
    code, out, _ = run_main(capsys, "--config", str(path), "--print-config")
    assert code == 0
    assert config_from_dict(yaml.safe_load(out)) == load_config(path)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.steps=7", 7),
        ("mesh.data=-1", -1),
        ("optim.learning_rate=1e-3", 0.001),  # YAML reads 1e-3 (no dot) as a string
        ("optim.learning_rate=3.0e-4", 0.0003),
        ("optim.learning_rate=2", 2.0),
        ("model.rope_theta=500000", 500000.0),
        ("model.parallel_block=true", True),
        ("model.tied_embeddings=false", False),
        ("model.attention_window=64", 64),
        ("model.attention_window=null", None),
        ("optim.grad_clip_norm=null", None),
        ("train.peak_tflops=null", None),
        ("model.head_dim=32", 32),
        ("optim.name=lamb", "lamb"),
        ("optim.schedule=linear", "linear"),
        ("model.remat=dots", "dots"),
        ("model.compute_dtype=bfloat16", "bfloat16"),
        ("run.name=experiment-3", "experiment-3"),
        ("run.dir=/tmp/somewhere", "/tmp/somewhere"),
    ],
)
def test_override_values_become_the_annotated_type(override, expected):
    name, _, _ = override.partition("=")
    section, key = name.split(".")
    value = getattr(getattr(load_config(None, [override]), section), key)
    assert value == expected
    assert type(value) is type(expected)


def test_null_override_clears_an_optional_key_set_by_a_file(tmp_path):
    path = tmp_path / "windowed.yaml"
    path.write_text("model:\n  attention_window: 64\n")
    assert load_config(path).model.attention_window == 64
    assert load_config(path, ["model.attention_window=null"]).model.attention_window is None


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("model.num_head=4", ("model.num_head'", "did you mean model.num_heads")),
        ("modle.num_heads=4", ("section 'modle'", "did you mean model")),
        ("zzz.steps=4", ("section 'zzz'", "valid:", "model", "train")),
        ("train.steps=abc", ("train.steps='abc'", "integer")),
        ("train.steps=7.5", ("train.steps=7.5", "integer")),
        ("model.parallel_block=1", ("model.parallel_block=1", "boolean")),
        ("optim.learning_rate=fast", ("optim.learning_rate='fast'", "number")),
        ("optim.name=sgd", ("optim.name='sgd'", "adamw", "lamb")),
        ("model.remat=some", ("model.remat='some'", "none", "full", "dots")),
        ("run.seed=null", ("run.seed=None", "integer")),
        ("train.steps", ("'train.steps'", "section.key=value")),
        ("steps=3", ("'steps=3'", "section.key=value")),
        ("model.num_layers.x=3", ("section.key=value",)),
        ("checkpoint.memory_every_steps=-1", ("checkpoint.memory_every_steps=-1", ">= 0")),
        ("checkpoint.memory_every_steps=2.5", ("checkpoint.memory_every_steps=2.5", "integer")),
        ("checkpoint.memory_max_fraction=0", ("checkpoint.memory_max_fraction=0", "(0, 1]")),
        ("checkpoint.memory_max_fraction=1.5", ("checkpoint.memory_max_fraction=1.5", "(0, 1]")),
        (
            "checkpoint.memory_when_busy=block",
            ("checkpoint.memory_when_busy='block'", "skip", "wait"),
        ),
    ],
)
def test_bad_override_raises_a_config_error_naming_it(override, fragments):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    for fragment in fragments:
        assert fragment in str(error.value)


def test_override_into_an_empty_section_of_a_file_is_applied(tmp_path):
    path = tmp_path / "empty_model.yaml"
    path.write_text("model:\ntrain:\n  steps: 5\n")
    config = load_config(path, ["model.num_layers=2"])
    assert config.model.num_layers == 2
    assert config.train.steps == 5


def test_nan_learning_rate_is_rejected():
    with pytest.raises(ConfigError, match=r"optim\.learning_rate"):
        load_config(None, ["optim.learning_rate=nan"])


def test_minus_one_fills_the_rest_of_the_devices():
    assert resolve_mesh_shape(MeshConfig(data=-1, fsdp=2, tensor=2), DEVICES) == {
        "data": 2,
        "fsdp": 2,
        "expert": 1,
        "pipe": 1,
        "tensor": 2,
    }
    assert resolve_mesh_shape(MeshConfig(data=1, fsdp=2, tensor=-1), DEVICES)["tensor"] == 4
    assert resolve_mesh_shape(MeshConfig(data=2, fsdp=1, pipe=-1, tensor=2), DEVICES)["pipe"] == 2


def test_check_device_count_returns_the_config_with_minus_one_resolved():
    config = load_config(None, ["mesh.data=-1"])
    resolved = check_device_count(config, DEVICES)
    assert resolved.mesh == MeshConfig(data=2, fsdp=2, tensor=2)
    assert dataclasses.replace(resolved, mesh=config.mesh) == config


def test_an_exact_mesh_is_returned_unchanged():
    assert resolve_mesh_shape(MeshConfig(data=2, fsdp=2, tensor=2), DEVICES) == {
        "data": 2,
        "fsdp": 2,
        "expert": 1,
        "pipe": 1,
        "tensor": 2,
    }


def test_mesh_product_different_from_the_device_count_names_both_numbers():
    with pytest.raises(ConfigError) as error:
        resolve_mesh_shape(MeshConfig(data=4, fsdp=1, tensor=1), DEVICES)
    assert "has 4 devices but 8 are available" in str(error.value)


def test_minus_one_that_cannot_divide_the_device_count_is_rejected():
    with pytest.raises(ConfigError) as error:
        resolve_mesh_shape(MeshConfig(data=-1, fsdp=3, tensor=1), DEVICES)
    assert "8 is not divisible by 3" in str(error.value)


def test_two_minus_one_axes_are_rejected_by_the_config_checks():
    with pytest.raises(ConfigError, match="only one mesh axis may be -1"):
        load_config(None, ["mesh.data=-1", "mesh.fsdp=-1"])


def test_resolve_mesh_shape_rejects_two_minus_one_axes():
    with pytest.raises(ConfigError):
        resolve_mesh_shape(MeshConfig(data=-1, fsdp=-1, tensor=2), DEVICES)


def test_global_batch_is_checked_against_a_data_axis_resolved_from_minus_one():
    config = Config(mesh=MeshConfig(data=-1, fsdp=1, tensor=1), train=TrainConfig(global_batch=12))
    with pytest.raises(ConfigError, match=r"global_batch=12 .* = 8$"):
        check_device_count(config, DEVICES)


def test_a_run_dir_holding_a_run_of_another_config_is_refused_and_left_untouched(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    other = load_config(None, [*SMALL_RUN, "model.num_layers=2", f"run.dir={run_dir}"])
    save_config(other, RunDir(run_dir))  # as msjax saves it: config.json and config.yaml
    metrics = run_dir / "metrics.jsonl"
    original = b'{"step": 0, "loss": 5.5}\n{"step": 1, "loss": 5.25}\n'
    metrics.write_bytes(original)
    code, out, err = run_main(capsys, *SMALL_RUN, f"run.dir={run_dir}")
    assert_one_line_user_error(
        code, out, err, f"run.dir={run_dir}", "holds a run of another config", "num_layers"
    )
    assert metrics.read_bytes() == original
    assert (run_dir / "config.yaml").read_text() == other.to_yaml()
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "config.json",
        "config.yaml",
        "metrics.jsonl",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
