"""Hugging Face Mixtral interop checked against transformers: a mixture of experts imported,
exported, and what has no Mixtral form refused in one line."""

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
from test_hf import RUN, mesh_for, msjax_logits, refused_export

from msjax.checkpoint.hf_weights import SafetensorsReader, load_params
from msjax.checkpoint.run_params import checkpoint_source, load_run_params, saved_config
from msjax.config import Config, ModelConfig, load_config
from msjax.errors import ConfigError
from msjax.hf.__main__ import main as hf_cli
from msjax.llama_config import model_from_init, open_weight_files
from msjax.models.transformer import Transformer
from msjax.parallel.mesh import build_mesh
from msjax.parallel.rules import logical_axis_rules, shardings_for
from msjax.resolve import resolve_model
from msjax.state_layout import state_layout
from msjax.train import main as train_cli
from msjax.train import train
from tests.random_hf import save_random

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 48
MOE_RUN = [
    *RUN,
    "model.moe.num_experts=4",
    "model.moe.experts_per_token=2",
    "model.moe.expert_mlp_dim=24",
]


def random_mixtral(directory: Path, sliding_window: int | None, **changes: object) -> None:
    """A tiny random MixtralForCausalLM saved in directory (nothing downloaded)."""
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        sliding_window=sliding_window,
        max_position_embeddings=64,
        **changes,
    )
    save_random(transformers.MixtralForCausalLM(config), directory, seed=3)


def hf_mixtral(directory: Path) -> object:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", dtype=torch.float32
    )
    assert type(model).__name__ == "MixtralForCausalLM"
    return model


def hf_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_mixtral(directory)(torch.tensor(tokens)).logits.numpy()


def msjax_greedy(model: ModelConfig, params: dict, prompt: np.ndarray, new: int) -> np.ndarray:
    """prompt [batch, len] and its `new` greedy tokens, each from the training forward pass over
    a fixed-length buffer (causal: the slots after a position never change its logits)."""
    abstract = nnx.eval_shape(lambda: Transformer(model, nnx.Rngs(params=0)))
    graphdef, state = nnx.split(abstract, nnx.Param)

    @jax.jit
    def forward(params: dict, tokens: jax.Array) -> jax.Array:
        fresh = jax.tree.map(lambda leaf: leaf, state)
        nnx.replace_by_pure_dict(fresh, params)
        return nnx.merge(graphdef, fresh)(tokens)

    single = jax.tree.map(lambda a: jax.device_put(a, jax.devices()[0]), params)
    length = prompt.shape[1]
    tokens = np.zeros((prompt.shape[0], length + new), np.int32)  # [batch, len + new]
    tokens[:, :length] = prompt
    for position in range(length, length + new):
        logits = np.asarray(forward(single, jnp.asarray(tokens)))
        tokens[:, position] = logits[:, position - 1].argmax(-1)
    return tokens


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_imported_mixtral_matches_transformers(tmp_path: Path, sliding_window: int | None) -> None:
    random_mixtral(tmp_path, sliding_window)
    config = Config(model=ModelConfig(init_from=f"hf:{tmp_path}", from_hf=True), mesh=mesh_for(2))
    model = resolve_model(model_from_init(config).model, "cpu")
    moe = model.moe
    assert (moe.num_experts, moe.experts_per_token, moe.expert_mlp_dim) == (4, 2, 24)
    assert (moe.shared_experts, moe.first_dense_layers, moe.normalize_top_k) == (0, 0, True)
    assert model.attention_window == sliding_window
    mesh = build_mesh(config.mesh)
    layout = state_layout(model, config.optim, 10)
    rules = logical_axis_rules(dataclasses.replace(config, model=model))
    shardings = shardings_for(layout.param_axes, mesh, rules)
    params = load_params(SafetensorsReader(tmp_path, open_weight_files(tmp_path)), model, shardings)
    gate = params["moe_layers"]["mlp"]["gate"]
    assert gate.shape == (2, 4, 32, 24) and gate.sharding == shardings["moe_layers"]["mlp"]["gate"]

    tokens = np.random.default_rng(1).integers(0, VOCAB, size=(2, 20))
    theirs = hf_logits(tmp_path, tokens)
    ours = msjax_logits(model, params, tokens)
    assert np.abs(theirs).max() > 1.0  # not a near-zero model where anything matches
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)

    prompt = tokens[:, :5]
    with torch.no_grad():
        expected = hf_mixtral(tmp_path).generate(
            torch.tensor(prompt), max_new_tokens=8, do_sample=False, eos_token_id=None
        )
    np.testing.assert_array_equal(msjax_greedy(model, params, prompt, 8), expected.numpy())


@pytest.fixture(scope="module")
def trained_moe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("hf_moe") / "run"
    train(load_config(None, [*MOE_RUN, f"run.dir={run_dir}"]), progress_stream=io.StringIO())
    return run_dir


def test_trained_moe_run_exports_to_mixtral_and_back(trained_moe_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "exported"
    with contextlib.redirect_stdout(io.StringIO()):
        assert hf_cli(["export", str(trained_moe_run), str(out)]) == 0
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == ["MixtralForCausalLM"]
    assert (exported["num_local_experts"], exported["num_experts_per_tok"]) == (4, 2)
    assert exported["intermediate_size"] == 24
    checkpointer, step = checkpoint_source(str(trained_moe_run))
    config = saved_config(checkpointer, step)
    saved = jax.device_get(load_run_params(checkpointer, step, config).params)
    checkpointer.close()

    tokens = np.random.default_rng(0).integers(0, 257, size=(2, 16))
    np.testing.assert_allclose(
        msjax_logits(config.model, saved, tokens), hf_logits(out, tokens), atol=1e-4, rtol=0
    )

    # The export imports back bit-identical, into the model its config.json describes.
    fields = model_from_init(
        dataclasses.replace(
            config,
            model=dataclasses.replace(config.model, init_from=f"hf:{out}", from_hf=True),
        )
    ).model
    assert fields.moe == config.model.moe
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    reread = load_params(
        SafetensorsReader(out, open_weight_files(out)),
        config.model,
        jax.tree.map(lambda _: device, saved),
    )
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), reread, saved)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("model.moe.shared_experts=1", "model.moe.shared_experts=1"),
        ("model.moe.first_dense_layers=1", "model.moe.first_dense_layers=1"),
        ("model.moe.bias_balancing=true", "model.moe.bias_balancing=true"),
        ("model.moe.normalize_top_k=false", "model.moe.normalize_top_k=false"),
    ],
)
def test_export_refuses_what_mixtral_cannot_run_in_one_line(
    tmp_path: Path, change: str, named: str
) -> None:
    lines = refused_export(tmp_path, [*MOE_RUN, change])
    assert len(lines) == 1 and named in lines[0] and "MixtralForCausalLM" in lines[0], lines


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 > num_local_experts=4"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_import_refuses_what_msjax_cannot_represent_in_one_line(
    tmp_path: Path, changes: dict, named: str
) -> None:
    random_mixtral(tmp_path / "mixtral", None)
    path = tmp_path / "mixtral" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    arguments = [f"model.init_from=hf:{tmp_path / 'mixtral'}", "model.from_hf=true"]
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        code = train_cli([*arguments, f"run.dir={tmp_path / 'run'}"])
    assert code == 2
    lines = errors.getvalue().strip().splitlines()
    assert len(lines) == 1 and named in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_import_names_each_moe_key_that_differs_from_the_mixtral(tmp_path: Path) -> None:
    random_mixtral(tmp_path, None)
    overrides = [
        f"model.init_from=hf:{tmp_path}",
        f"model.vocab_size={VOCAB}",
        "model.num_layers=2",
        "model.embed_dim=32",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.mlp_dim=24",
        "model.rope_theta=500",
        "model.norm_eps=1e-5",
        "model.moe.num_experts=8",
        "model.moe.experts_per_token=2",
        "model.moe.shared_experts=1",
    ]
    with pytest.raises(ConfigError) as raised:
        model_from_init(load_config(None, overrides))
    message = str(raised.value)
    assert "\n" not in message
    assert "model.moe.num_experts=8 but config.json has 4" in message
    assert "model.moe.shared_experts=1 but config.json has 0" in message
    assert "experts_per_token" not in message and "expert_mlp_dim" not in message
    matching = [*overrides[:-3], "model.moe.num_experts=4", "model.moe.experts_per_token=2"]
    assert model_from_init(load_config(None, matching)).model.moe.num_experts == 4


def test_a_bias_balanced_run_starts_from_a_mixtral_with_a_zero_routing_bias(tmp_path: Path) -> None:
    random_mixtral(tmp_path, None)
    overrides = [f"model.init_from=hf:{tmp_path}", "model.from_hf=true"]
    config = model_from_init(load_config(None, [*overrides, "model.moe.bias_balancing=true"]))
    model = resolve_model(config.model, "cpu")
    assert model.moe.bias_balancing and model.moe.num_experts == 4
    layout = state_layout(model, config.optim, 10)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(
        lambda _: device, layout.param_axes, is_leaf=lambda x: isinstance(x, tuple)
    )
    params = load_params(SafetensorsReader(tmp_path, open_weight_files(tmp_path)), model, shardings)
    assert jax.tree.structure(params) == jax.tree.structure(shardings)  # every parameter
    bias = np.asarray(params["moe_layers"]["mlp"]["router"]["bias"])
    np.testing.assert_array_equal(bias, np.zeros((2, 4), np.float32))
