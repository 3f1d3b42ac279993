"""Files someone hands msjax are not trusted: Hugging Face directories stay inside themselves and
are type-checked, the compile cache's key and folders must be this user's own, generation checks
its inputs, and a garbled checkpoint record or a bad export target is one line."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from msjax.checkpoint.__main__ import main as checkpoint_cli
from msjax.checkpoint.hf_weights import (
    INDEX_FILE,
    SINGLE_FILE,
    SafetensorsReader,
    hf_tensors,
    load_params,
    write_safetensors,
)
from msjax.checkpoint.manager import Checkpointer
from msjax.config import Config, MeshConfig, ModelConfig, load_config
from msjax.errors import ConfigError, MsjaxError
from msjax.generate import main as generate_cli
from msjax.hf.__main__ import main as hf_cli
from msjax.llama_config import CONFIG_FILE, llama_config, model_from_init, open_weight_files
from msjax.models.transformer import Transformer
from msjax.parallel.mesh import build_mesh
from msjax.resilience.compile_cache import KEY_FILE, signing_key
from msjax.step import build_program

TINY = ModelConfig(
    vocab_size=16,
    num_layers=1,
    embed_dim=8,
    num_heads=2,
    num_kv_heads=1,
    mlp_dim=16,
    attention_impl="xla",
    norm_impl="xla",
    loss_impl="xla",
)


def cli(main, argv: list[str]) -> tuple[int, list[str], str]:
    """(exit code, stderr lines, stdout) of an msjax command's main, run in this process."""
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = main(argv)
    return code, errors.getvalue().strip().splitlines(), printed.getvalue()


def tiny_params(model: ModelConfig = TINY) -> dict:
    """Randomly initialised parameters of the tiny model, as writable numpy arrays."""
    state = nnx.state(Transformer(model, nnx.Rngs(params=0)), nnx.Param)
    return jax.tree.map(np.array, nnx.to_pure_dict(state))


def write_hf(
    directory: Path, params: dict | None = None, model: ModelConfig = TINY, **config_changes
) -> Path:
    """A Hugging Face Llama directory of the tiny model (config.json and model.safetensors)."""
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(hf_tensors(params or tiny_params(model), model), directory)
    config = {**llama_config(model, None, 64, "float32"), **config_changes}
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    return directory


def import_config(directory: Path) -> Config:
    return Config(model=ModelConfig(init_from=f"hf:{directory}", from_hf=True))


def one_device_shardings(params: dict) -> dict:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: device, params)


def index_naming(directory: Path, entry: str) -> None:
    """An index whose weight_map puts every tensor in `entry`."""
    names = [name for name, _ in hf_tensors(tiny_params(), TINY)]
    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": dict.fromkeys(names, entry)}))
    (directory / SINGLE_FILE).unlink()


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("../outside.safetensors", "must be a plain file name"),
        ("{outside}", "must be a plain file name"),  # absolute
        ("sub/model.safetensors", "must be a plain file name"),
        ("..", "must be a plain file name"),
        ("fifo.safetensors", "not a regular file"),
        ("null.safetensors", "not a regular file"),  # a link to /dev/null: a device
        ("folder.safetensors", "not a regular file"),
    ],
)
def test_weight_map_names_only_regular_files_inside_the_directory(
    tmp_path: Path, entry: str, expected: str
) -> None:
    outside = write_hf(tmp_path / "elsewhere") / SINGLE_FILE  # real weights, outside the model
    shutil.copy(outside, tmp_path / "outside.safetensors")
    model = write_hf(tmp_path / "model")
    (model / "sub").mkdir()
    shutil.copy(outside, model / "sub" / SINGLE_FILE)
    os.mkfifo(model / "fifo.safetensors")
    (model / "null.safetensors").symlink_to("/dev/null")
    (model / "folder.safetensors").mkdir()
    index_naming(model, entry.replace("{outside}", str(outside)))

    with pytest.raises(ConfigError) as raised:
        model_from_init(import_config(model))  # at resolve time: before any run dir
    message = str(raised.value)
    assert expected in message and "\n" not in message, message
    assert "weight_map names" in message
    with pytest.raises(MsjaxError, match=expected):
        open_weight_files(model)  # the worker opens its weight files by the same rule


def test_hub_snapshot_links_to_regular_files_are_read(tmp_path: Path) -> None:
    """The Hugging Face hub's snapshots are links to blobs: a plain name linking to a regular
    file is accepted, and the weights read are the blob's."""
    params = tiny_params()
    blob = write_hf(tmp_path / "blobs", params) / SINGLE_FILE
    model = write_hf(tmp_path / "snapshot")
    (model / SINGLE_FILE).unlink()
    (model / SINGLE_FILE).symlink_to(blob)
    filled = model_from_init(import_config(model)).model
    assert (filled.num_layers, filled.embed_dim, filled.num_kv_heads) == (1, 8, 1)
    loaded = load_params(
        SafetensorsReader(model, open_weight_files(model)), TINY, one_device_shardings(params)
    )
    np.testing.assert_array_equal(np.asarray(loaded["embedding"]), params["embedding"])


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"num_hidden_layers": 2.5}, "num_hidden_layers=2.5; it must be a positive integer"),
        ({"num_hidden_layers": True}, "num_hidden_layers=true; it must be a positive integer"),
        ({"tie_word_embeddings": "false"}, 'tie_word_embeddings="false"; it must be true or'),
        ({"attention_bias": "false"}, 'attention_bias="false"; it must be true or false'),
        ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads=0; it must be a"),
        ({"num_key_value_heads": 0}, "num_key_value_heads=0; it must be a positive integer"),
        ({"vocab_size": "16"}, 'vocab_size="16"; it must be a positive integer'),
        ({"rms_norm_eps": "1e-5"}, 'rms_norm_eps="1e-5"; it must be a finite positive number'),
        ({"rope_parameters": ["default"], "rope_scaling": None}, "rope parameters are not a"),
    ],
)
def test_config_json_fields_are_type_checked(tmp_path: Path, change: dict, expected: str) -> None:
    model = write_hf(tmp_path / "model", **change)
    with pytest.raises(ConfigError) as raised:
        model_from_init(import_config(model))
    assert expected in str(raised.value), raised.value


def test_config_json_that_is_not_an_object_is_one_error(tmp_path: Path) -> None:
    model = write_hf(tmp_path / "model")
    (model / CONFIG_FILE).write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config\.json is not a JSON object"):
        model_from_init(import_config(model))
    (model / CONFIG_FILE).write_bytes(b'{"model_type": "caf\xe9"}')
    with pytest.raises(ConfigError, match=r"config\.json is not UTF-8"):
        model_from_init(import_config(model))


@pytest.mark.parametrize(("dtype", "bad"), [(np.float32, np.nan), (np.float16, np.inf)])
def test_non_finite_weights_are_refused(tmp_path: Path, dtype: type, bad: float) -> None:
    params = tiny_params()
    params["layers"]["mlp"]["gate"][0, 3, 5] = bad
    tensors = ((name, array.astype(dtype)) for name, array in hf_tensors(params, TINY))
    model = tmp_path / "model"
    model.mkdir()
    write_safetensors(tensors, model)
    (model / CONFIG_FILE).write_text(json.dumps(llama_config(TINY, None, 64, "float32")))
    with pytest.raises(MsjaxError) as raised:
        load_params(
            SafetensorsReader(model, open_weight_files(model)), TINY, one_device_shardings(params)
        )
    message = str(raised.value)
    assert "model.layers.0.mlp.gate_proj.weight holds non-finite values" in message, message
    assert str(model / SINGLE_FILE) in message


def test_safetensors_errors_name_the_file(tmp_path: Path) -> None:
    model = write_hf(tmp_path / "model")
    whole = (model / SINGLE_FILE).read_bytes()
    (model / SINGLE_FILE).write_bytes(whole[:-7])  # a download cut short
    with pytest.raises(ConfigError) as raised:
        model_from_init(import_config(model))
    assert f"{model / SINGLE_FILE} is not a readable safetensors file" in str(raised.value)
    (model / SINGLE_FILE).write_bytes(b"<html>rate limited</html>")
    with pytest.raises(MsjaxError, match="is not a readable safetensors file"):
        open_weight_files(model)  # the worker opens them alike


@pytest.fixture
def key_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "user_cache"
    folder.mkdir()
    monkeypatch.setenv("MSJAX_CACHE_DIR", str(folder))
    return folder


def test_a_symlinked_signing_key_is_never_followed(
    tmp_path: Path, key_folder: Path, capsys: pytest.CaptureFixture
) -> None:
    planted = tmp_path / "planted.key"
    planted.write_bytes(b"k" * 32)  # a key someone else knows
    planted.chmod(0o600)
    (key_folder / KEY_FILE).symlink_to(planted)
    assert signing_key() is None
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "is a symbolic link; compile cache off" in lines[0], lines
    assert planted.read_bytes() == b"k" * 32


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_signing_key_others_can_read_turns_the_cache_off(
    key_folder: Path, mode: int, capsys: pytest.CaptureFixture
) -> None:
    key = key_folder / KEY_FILE
    key.write_bytes(b"s" * 32)
    key.chmod(mode)
    assert signing_key() is None
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"can be read or written by others (mode {mode:o})" in lines[0]
    key.chmod(0o600)
    assert signing_key() == b"s" * 32


def test_a_signing_key_that_is_a_fifo_never_blocks(
    key_folder: Path, capsys: pytest.CaptureFixture
) -> None:
    os.mkfifo(key_folder / KEY_FILE, 0o600)
    assert signing_key() is None
    assert "is not a regular file; compile cache off" in capsys.readouterr().err


RUN = [
    "model.num_layers=1",
    "model.embed_dim=32",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "data.seq_len=16",
]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run dir with one real checkpoint (step 0) of a tiny model, saved as training does."""
    run_dir = tmp_path_factory.mktemp("handed") / "run"
    config = load_config(None, RUN)
    config = dataclasses.replace(config, mesh=MeshConfig(data=1, fsdp=1, tensor=1))
    program = build_program(config, build_mesh(config.mesh, jax.devices()[:1]))
    checkpointer = Checkpointer(run_dir / "checkpoints", config.checkpoint)
    meta = {
        "config": config.to_dict(),
        "data": {"next_step": 0, "samples_seen": 0},
        "seed": 0,
        "msjax_version": "test",
    }
    checkpointer.save(0, program.init_state(), meta)
    checkpointer.wait()
    checkpointer.close()
    return run_dir


def garbled_copy(saved_run: Path, where: Path, garble: str) -> Path:
    """A copy of the run whose checkpoint record is garbled: one value changed (the JSON still
    parses, its seal does not match) or the record cut short."""
    run_dir = where / "garbled"
    shutil.copytree(saved_run, run_dir)
    record = run_dir / "checkpoints" / "0" / "meta" / "metadata"
    raw = record.read_bytes()
    if garble == "value":
        changed = raw.replace(b'"embed_dim": 32', b'"embed_dim": 36', 1)
        assert changed != raw
    else:
        changed = raw[: len(raw) // 2]
    record.write_bytes(changed)
    return run_dir


@pytest.mark.parametrize("garble", ["value", "cut"])
def test_tools_on_a_garbled_record_are_one_line(
    saved_run: Path, tmp_path: Path, garble: str
) -> None:
    run_dir = garbled_copy(saved_run, tmp_path, garble)
    step_dir = run_dir / "checkpoints" / "0"
    commands = {
        "msjax.checkpoint": (checkpoint_cli, ["inspect", str(step_dir)]),
        "msjax.hf": (hf_cli, ["export", str(run_dir), str(tmp_path / "out")]),
        "msjax.generate": (generate_cli, [str(run_dir), "--prompt", "ab"]),
    }
    for prog, (main, argv) in commands.items():
        code, lines, printed = cli(main, argv)
        assert code == 2, (prog, lines)
        assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: checkpoint "), lines
        assert "is damaged: its JSON record" in lines[0], lines
        assert printed == "", (prog, printed)
    assert not (tmp_path / "out").exists()
    assert step_dir.is_dir(), "a tool never moves a checkpoint"


def test_generation_refuses_top_k_past_the_vocabulary_and_a_too_long_output(
    saved_run: Path,
) -> None:
    code, lines, printed = cli(generate_cli, [str(saved_run), "--prompt", "ab", "--top-k", "500"])
    assert code == 2 and printed == ""
    assert len(lines) == 1 and "--top-k=500 is more than the 257 tokens" in lines[0], lines
    code, lines, printed = cli(
        generate_cli, [str(saved_run), "--prompt", "abcd", "--max-new-tokens", "1000000000"]
    )
    assert code == 2 and printed == ""
    assert len(lines) == 1, lines
    assert "the prompt (4 tokens) plus --max-new-tokens=1000000000 is 1000000004 tokens" in lines[0]
    assert "past the 16 positions the model was trained on (data.seq_len)" in lines[0]
    assert "give --max-new-tokens <= 12" in lines[0]
    code, lines, printed = cli(
        generate_cli, [str(saved_run), "--prompt", "abcd", "--max-new-tokens", "12"]
    )
    assert code == 0, lines
    assert printed.startswith("abcd")


def test_export_into_a_symlink_is_refused_and_the_target_untouched(
    saved_run: Path, tmp_path: Path
) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name in ("link", "dangling"):
        code, lines, _ = cli(hf_cli, ["export", str(saved_run), str(tmp_path / name)])
        assert code == 2 and len(lines) == 1, lines
        assert f"{tmp_path / name} is a symbolic link" in lines[0]
        assert (tmp_path / name).is_symlink()
    assert list(target.iterdir()) == []
    assert not (tmp_path / "nowhere").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "link", "target"]
