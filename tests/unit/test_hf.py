"""Hugging Face Llama interop checked against transformers: import, export, round trip, refusals."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from msjax.checkpoint.hf_weights import INDEX_FILE, SafetensorsReader, load_params
from msjax.checkpoint.manager import Checkpointer
from msjax.checkpoint.run_params import checkpoint_source, load_run_params, saved_config
from msjax.config import Config, MeshConfig, ModelConfig, load_config
from msjax.errors import ConfigError
from msjax.generate import main as generate_cli
from msjax.hf.__main__ import main as hf_cli
from msjax.hf.export import export_checkpoint
from msjax.llama_config import model_from_init, open_weight_files
from msjax.models.transformer import Transformer
from msjax.parallel.mesh import build_mesh
from msjax.parallel.rules import logical_axis_rules, shardings_for
from msjax.resolve import resolve, resolve_model
from msjax.state_layout import state_layout
from msjax.step import build_program
from msjax.train import main as train_cli
from msjax.train import train
from msjax.training.checkpoints import restore_or_init
from tests.random_hf import save_random

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY_MODEL = [
    "model.num_layers=2",
    "model.embed_dim=32",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
]
RUN = [
    *TINY_MODEL,
    "data.seq_len=16",
    "data.max_corpus_mib=1",
    "train.global_batch=8",
    "train.steps=2",
    "train.eval_every=0",
    "train.peak_tflops=0.5",
    "checkpoint.every_steps=2",
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=2",
]


def msjax_logits(model: ModelConfig, params: dict, tokens: np.ndarray) -> np.ndarray:
    """Logits of the training forward pass with these parameters, on one device."""
    abstract = nnx.eval_shape(lambda: Transformer(model, nnx.Rngs(params=0)))
    graphdef, state = nnx.split(abstract, nnx.Param)

    @jax.jit
    def forward(params: dict, tokens: jax.Array) -> jax.Array:
        fresh = jax.tree.map(lambda leaf: leaf, state)
        nnx.replace_by_pure_dict(fresh, params)
        return nnx.merge(graphdef, fresh)(tokens)

    single = jax.tree.map(lambda a: jax.device_put(a, jax.devices()[0]), params)
    return np.asarray(forward(single, jnp.asarray(tokens)))


def hf_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", dtype=torch.float32
    )
    assert type(model).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def random_llama(directory: Path, kv_heads: int, tied: bool) -> None:
    """A tiny random LlamaForCausalLM saved in directory (nothing downloaded)."""
    config = transformers.LlamaConfig(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        tie_word_embeddings=tied,
        max_position_embeddings=64,
    )
    save_random(transformers.LlamaForCausalLM(config), directory, seed=kv_heads + 10 * tied)


def mesh_for(kv_heads: int) -> MeshConfig:
    tensor = 2 if kv_heads % 2 == 0 else 1
    return MeshConfig(data=8 // (4 * tensor), fsdp=4, tensor=tensor)


@pytest.mark.parametrize(("kv_heads", "tied"), [(k, t) for k in (1, 2, 4) for t in (False, True)])
def test_imported_llama_matches_transformers(tmp_path: Path, kv_heads: int, tied: bool) -> None:
    random_llama(tmp_path, kv_heads, tied)
    config = Config(
        model=ModelConfig(init_from=f"hf:{tmp_path}", from_hf=True), mesh=mesh_for(kv_heads)
    )
    model = resolve_model(model_from_init(config).model, "cpu")
    assert (model.num_kv_heads, model.tied_embeddings, model.rope_theta) == (kv_heads, tied, 500)
    mesh = build_mesh(config.mesh)
    layout = state_layout(model, config.optim, 10)
    rules = logical_axis_rules(dataclasses.replace(config, model=model))
    shardings = shardings_for(layout.param_axes, mesh, rules)
    params = load_params(SafetensorsReader(tmp_path, open_weight_files(tmp_path)), model, shardings)
    query = params["layers"]["attention"]["query"]
    assert query.sharding == shardings["layers"]["attention"]["query"]
    assert len(query.addressable_shards[0].data.shape) == 4

    tokens = np.random.default_rng(kv_heads).integers(0, 48, size=(2, 20))
    theirs = hf_logits(tmp_path, tokens)
    ours = msjax_logits(model, params, tokens)
    assert np.abs(theirs).max() > 1.0  # not a near-zero model where anything matches
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("hf") / "run"
    train(load_config(None, [*RUN, f"run.dir={run_dir}"]), progress_stream=io.StringIO())
    return run_dir


def test_trained_model_exports_to_transformers_and_back(trained_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "exported"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert hf_cli(["export", str(trained_run), str(out)]) == 0
    assert {"config.json", "generation_config.json", "model.safetensors"} <= {
        p.name for p in out.iterdir()
    }
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256
    checkpointer, step = checkpoint_source(str(trained_run))
    config = saved_config(checkpointer, step)
    saved = jax.device_get(load_run_params(checkpointer, step, config).params)
    checkpointer.close()

    tokens = np.random.default_rng(0).integers(0, 257, size=(2, 16))
    np.testing.assert_allclose(
        msjax_logits(config.model, saved, tokens), hf_logits(out, tokens), atol=1e-4, rtol=0
    )

    # Import through the run's own start: an empty run dir starts from the export's weights,
    # sharded like the program's state, bit-identical to the checkpoint's.
    imported = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, init_from=f"hf:{out}"),
        run=dataclasses.replace(config.run, dir=str(tmp_path / "fresh")),
    )
    imported = resolve(imported, jax.device_count(), "cpu")
    program = build_program(imported, build_mesh(imported.mesh))
    abstract_state = program.abstract_state()
    empty = Checkpointer(tmp_path / "fresh" / "checkpoints", imported.checkpoint)
    start = restore_or_init(imported, empty, program, abstract_state, lambda _: None)
    empty.close()
    assert start.step == 0 and start.restored is None
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), start.state.params, saved
    )
    assert (
        jax.tree.leaves(start.state.params)[0].sharding
        == (jax.tree.leaves(program.state_shardings.params)[0])
    )

    # A run that has checkpoints resumes from them, not from the Hugging Face weights.
    own = Checkpointer(trained_run / "checkpoints", imported.checkpoint, read_only=True)
    resumed = restore_or_init(imported, own, program, abstract_state, lambda _: None)
    own.close()
    assert resumed.step == step and resumed.restored is not None


def test_export_shards_past_the_size_limit_and_bfloat16(trained_run: Path, tmp_path: Path) -> None:
    export_checkpoint(str(trained_run), tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 2
    checkpointer, step = checkpoint_source(str(trained_run))
    config = saved_config(checkpointer, step)
    saved = jax.device_get(load_run_params(checkpointer, step, config).params)
    checkpointer.close()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, saved)
    reread = load_params(
        SafetensorsReader(tmp_path / "sharded", open_weight_files(tmp_path / "sharded")),
        config.model,
        shardings,
    )
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), reread, saved)

    export_checkpoint(str(trained_run), tmp_path / "half", dtype="bfloat16")
    halved = load_params(
        SafetensorsReader(tmp_path / "half", open_weight_files(tmp_path / "half")),
        config.model,
        shardings,
    )
    embedding = np.asarray(halved["embedding"])
    assert not np.array_equal(embedding, saved["embedding"])
    np.testing.assert_allclose(embedding, saved["embedding"], rtol=1e-2, atol=1e-3)


def refused_export(run_dir: Path, overrides: list[str]) -> list[str]:
    """The lines `python -m msjax.hf export` prints for a one-device run of `overrides` saved at
    step 0 in run_dir, once it has refused it (exit 2, no output directory left)."""
    config = load_config(None, [*overrides, "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"])
    config = dataclasses.replace(config, mesh=MeshConfig(data=1, fsdp=1, tensor=1))
    program = build_program(config, build_mesh(config.mesh, jax.devices()[:1]))
    checkpointer = Checkpointer(run_dir / "checkpoints", config.checkpoint)
    checkpointer.save(0, program.init_state(), {"config": config.to_dict()})
    checkpointer.wait()
    checkpointer.close()

    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        code = hf_cli(["export", str(run_dir), str(run_dir / "out")])
    assert code == 2
    assert not (run_dir / "out").exists()
    return errors.getvalue().strip().splitlines()


def test_export_refuses_a_parallel_block_in_one_line(tmp_path: Path) -> None:
    lines = refused_export(tmp_path, [*RUN, "model.parallel_block=true"])
    assert len(lines) == 1 and "parallel_block" in lines[0], lines


def test_mismatched_import_is_one_line(tmp_path: Path) -> None:
    random_llama(tmp_path, kv_heads=2, tied=False)
    overrides = [
        f"model.init_from=hf:{tmp_path}",
        "model.vocab_size=48",
        "model.num_layers=2",
        "model.embed_dim=32",
        "model.num_heads=4",
        "model.mlp_dim=64",
        "model.num_kv_heads=1",
        "model.tied_embeddings=true",
        "model.rope_theta=500",
    ]
    with pytest.raises(ConfigError) as raised:
        model_from_init(load_config(None, overrides))
    message = str(raised.value)
    assert "\n" not in message
    assert "model.num_kv_heads=1 but config.json has 2" in message
    assert "model.tied_embeddings=True but config.json has False" in message
    with pytest.raises(ConfigError, match="hf:PATH"):
        load_config(None, [f"model.init_from={tmp_path}"])

    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        code = train_cli([*overrides, f"run.dir={tmp_path / 'run'}"])
    assert code == 2
    assert len(errors.getvalue().strip().splitlines()) == 1, errors.getvalue()
    assert not (tmp_path / "run").exists()


def test_generate_command_on_one_device_and_on_the_run_mesh(trained_run: Path) -> None:
    outputs = []
    for mesh in ("one", "run"):
        printed, errors = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
            code = generate_cli(
                [
                    str(trained_run),
                    "--prompt",
                    "def ",
                    "--max-new-tokens",
                    "6",
                    "--temperature",
                    "0",
                    "--mesh",
                    mesh,
                ]
            )
        assert code == 0, errors.getvalue()
        assert printed.getvalue().startswith("def ")
        assert "tokens/s" in errors.getvalue()
        outputs.append(printed.getvalue())
    assert outputs[0] == outputs[1]
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        assert generate_cli([str(trained_run), "--prompt", "x", "--step", "99"]) == 2
    assert len(errors.getvalue().strip().splitlines()) == 1


def test_export_writes_a_tokenizer_json_that_transformers_reads(tmp_path: Path) -> None:
    from test_tokenizers import train_tokenizer_json

    from msjax.data.tokenizer import load_tokenizer
    from msjax.hf.export import tokenizer_files

    path = train_tokenizer_json(tmp_path / "tokenizer.json", ["<unk>", "<|endoftext|>"])
    config = load_config(None, [f"data.tokenizer={path}"])
    eos_id, files = tokenizer_files(config)
    out = tmp_path / "out"
    out.mkdir()
    for name, content in files.items():
        (out / name).write_bytes(content)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer(str(path))
    text = "def tokenize(text): return text.split()"
    assert theirs.encode(text) == [int(i) for i in ours.encode(text)]
    assert theirs.eos_token_id == eos_id == ours.eos_id
