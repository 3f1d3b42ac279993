"""Hugging Face Qwen3-MoE and Qwen3 interop checked against transformers: per-head query/key norm,
routing, import onto a mesh, export and back, and what has no Qwen3 form refused in one line."""

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
from test_hf import RUN, msjax_logits, refused_export

from msjax.checkpoint.hf_weights import (
    SafetensorsReader,
    hf_tensors,
    load_params,
    write_safetensors,
)
from msjax.checkpoint.run_params import checkpoint_source, load_run_params, saved_config
from msjax.config import Config, MeshConfig, ModelConfig, load_config
from msjax.generate import Generator, Sampling, generation_model
from msjax.generate import main as generate_cli
from msjax.hf.__main__ import main as hf_cli
from msjax.hf.export import hf_form
from msjax.llama_config import model_from_init, open_weight_files
from msjax.models.moe import route
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
QWEN3_MOE_RUN = [
    *RUN,
    "model.num_layers=3",
    "model.qk_norm=true",
    "model.moe.num_experts=4",
    "model.moe.experts_per_token=2",
    "model.moe.expert_mlp_dim=24",
    "model.moe.first_dense_layers=1",
    "model.moe.normalize_top_k=false",
]


def qwen3_moe_config(**changes: object) -> object:
    """A tiny Qwen3MoeConfig: 3 layers, the first dense, 4 experts of which 2 per token."""
    settings = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 40,
        "moe_intermediate_size": 24,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "mlp_only_layers": [0],
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
        "max_position_embeddings": 64,
        **changes,
    }
    return transformers.Qwen3MoeConfig(**settings)


def hf_model(directory: Path, form: str) -> object:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", dtype=torch.float32
    )
    assert type(model).__name__ == form
    return model


def hf_logits(directory: Path, form: str, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(directory, form)(torch.tensor(tokens)).logits.numpy()


def hf_greedy(directory: Path, form: str, prompt: np.ndarray, new: int) -> np.ndarray:
    with torch.no_grad():
        return (
            hf_model(directory, form)
            .generate(torch.tensor(prompt), max_new_tokens=new, do_sample=False, eos_token_id=None)
            .numpy()
        )


def imported(directory: Path, mesh: MeshConfig) -> tuple[ModelConfig, dict]:
    """The model section filled from directory, and its weights loaded sharded over mesh."""
    config = Config(model=ModelConfig(init_from=f"hf:{directory}", from_hf=True), mesh=mesh)
    model = resolve_model(model_from_init(config).model, "cpu")
    layout = state_layout(model, config.optim, 10)
    rules = logical_axis_rules(dataclasses.replace(config, model=model))
    shardings = shardings_for(layout.param_axes, build_mesh(mesh), rules)
    params = load_params(
        SafetensorsReader(directory, open_weight_files(directory)), model, shardings
    )
    jax.tree.map(
        lambda a, s: (a.sharding == s) or pytest.fail(f"{a.sharding} != {s}"), params, shardings
    )
    return model, params


def generated(model: ModelConfig, params: dict, prompt: np.ndarray, new: int) -> np.ndarray:
    """Each prompt row [batch, len] and its `new` greedy tokens from msjax.generate's Generator
    (the KV-cache decoder: the prompt prefilled at once, then one token a step)."""
    generator = Generator(generation_model(Config(model=model), "cpu"), params, model.vocab_size)
    greedy = Sampling(temperature=0.0, top_k=0, top_p=1.0, seed=0)
    rows = [[*row, *generator.tokens([int(t) for t in row], new, greedy, None)] for row in prompt]
    return np.asarray(rows)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3_moe")
    save_random(transformers.Qwen3MoeForCausalLM(qwen3_moe_config()), directory, seed=3)
    return directory


def test_qk_norm_is_an_rms_norm_of_each_head_over_head_dim() -> None:
    config = resolve_model(
        ModelConfig(num_layers=1, embed_dim=32, num_heads=4, num_kv_heads=2, qk_norm=True), "cpu"
    )
    attention = Transformer(config, nnx.Rngs(params=0)).layers.attention
    rng = np.random.default_rng(0)
    query = rng.normal(0, 3, (2, 5, 4, 8)).astype(np.float32)  # [batch, seq, heads, head_dim]
    key = rng.normal(0, 3, (2, 5, 2, 8)).astype(np.float32)  # [batch, seq, kv_heads, head_dim]
    query_scale, key_scale = rng.normal(1, 0.3, (2, 8)).astype(np.float32)
    attention.query_norm.scale[...] = query_scale[None]  # [layers, head_dim]
    attention.key_norm.scale[...] = key_scale[None]

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def normalize(carry: None, attention: nnx.Module) -> tuple[None, tuple]:
        return carry, attention.normalize_heads(jnp.asarray(query), jnp.asarray(key))

    _, (ours_query, ours_key) = normalize(None, attention)

    def expected(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
        rms = np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5)
        return x / rms * scale

    np.testing.assert_allclose(ours_query[0], expected(query, query_scale), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours_key[0], expected(key, key_scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("normalize", [False, True])
def test_routing_equals_qwen3_moe_router(normalize: bool) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    router = Qwen3MoeTopKRouter(qwen3_moe_config(num_experts=8, norm_topk_prob=normalize))
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        hidden = torch.randn(64, 32)
        _, weights, experts = router(hidden)
        logits = hidden @ router.weight.T  # [tokens, experts]
    ours = route(jnp.asarray(logits.numpy()), 2, normalize)
    np.testing.assert_array_equal(np.asarray(ours.experts), experts.numpy())
    np.testing.assert_allclose(np.asarray(ours.weights), weights.numpy(), rtol=1e-6, atol=1e-7)


def test_imported_qwen3_moe_matches_transformers(qwen3_moe_dir: Path) -> None:
    model, params = imported(qwen3_moe_dir, MeshConfig(data=2, fsdp=1, expert=2, tensor=2))
    moe = model.moe
    assert model.qk_norm and (model.mlp_dim, model.resolved_head_dim) == (40, 8)
    assert (moe.num_experts, moe.experts_per_token, moe.expert_mlp_dim) == (4, 2, 24)
    assert (moe.first_dense_layers, moe.normalize_top_k, moe.shared_experts) == (1, False, 0)
    assert moe.load_balance_loss_weight == pytest.approx(0.002)  # 0.001 over each of 2 choices
    assert params["moe_layers"]["mlp"]["gate"].shape == (2, 4, 32, 24)
    assert params["dense_layers"]["mlp"]["gate"].shape == (1, 32, 40)
    assert params["moe_layers"]["attention"]["key_norm"]["scale"].shape == (2, 8)

    tokens = np.random.default_rng(1).integers(0, VOCAB, size=(2, 20))
    theirs = hf_logits(qwen3_moe_dir, "Qwen3MoeForCausalLM", tokens)
    assert np.abs(theirs).max() > 1.0  # not a near-zero model where anything matches
    np.testing.assert_allclose(msjax_logits(model, params, tokens), theirs, atol=1e-4, rtol=0)

    prompt = tokens[:, :5]
    expected = hf_greedy(qwen3_moe_dir, "Qwen3MoeForCausalLM", prompt, 8)
    np.testing.assert_array_equal(generated(model, params, prompt, 8), expected)


def test_imported_qwen3_generates_as_transformers(tmp_path: Path) -> None:
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # not hidden_size / heads
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    save_random(transformers.Qwen3ForCausalLM(config), tmp_path, seed=5)
    model, params = imported(tmp_path, MeshConfig(data=2, fsdp=2, tensor=2))
    assert model.qk_norm and not model.moe.enabled and model.resolved_head_dim == 16

    tokens = np.random.default_rng(2).integers(0, VOCAB, size=(2, 12))
    theirs = hf_logits(tmp_path, "Qwen3ForCausalLM", tokens)
    np.testing.assert_allclose(msjax_logits(model, params, tokens), theirs, atol=1e-4, rtol=0)

    prompt = tokens[:, :5]
    expected = hf_greedy(tmp_path, "Qwen3ForCausalLM", prompt, 8)
    np.testing.assert_array_equal(generated(model, params, prompt, 8), expected)


def test_a_dense_qk_norm_model_written_as_qwen3_loads_in_transformers(tmp_path: Path) -> None:
    model = resolve_model(
        ModelConfig(vocab_size=VOCAB, num_layers=2, embed_dim=32, num_heads=4, qk_norm=True),
        "cpu",
    )
    network = Transformer(model, nnx.Rngs(params=1))
    for scale in (
        network.layers.attention.query_norm.scale,
        network.layers.attention.key_norm.scale,
    ):
        scale[...] = jax.random.uniform(jax.random.key(2), scale.shape, minval=0.5, maxval=2.0)
    params = jax.device_get(nnx.to_pure_dict(nnx.state(network, nnx.Param)))
    form, reason, form_config = hf_form(model)
    assert (form, reason) == ("Qwen3ForCausalLM", None)
    write_safetensors(hf_tensors(params, model), tmp_path)
    config = form_config(model, None, 64, "float32")
    (tmp_path / "config.json").write_text(json.dumps(config))

    tokens = np.random.default_rng(3).integers(0, VOCAB, size=(2, 12))
    theirs = hf_logits(tmp_path, "Qwen3ForCausalLM", tokens)
    np.testing.assert_allclose(msjax_logits(model, params, tokens), theirs, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def trained_qwen3_moe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("hf_qwen") / "run"
    config = load_config(None, [*QWEN3_MOE_RUN, f"run.dir={run_dir}"])
    train(config, progress_stream=io.StringIO())
    return run_dir


def test_trained_qwen3_moe_run_exports_and_imports_back(
    trained_qwen3_moe_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "exported"
    with contextlib.redirect_stdout(io.StringIO()):
        assert hf_cli(["export", str(trained_qwen3_moe_run), str(out)]) == 0
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (exported["num_experts"], exported["num_experts_per_tok"]) == (4, 2)
    assert (exported["moe_intermediate_size"], exported["intermediate_size"]) == (24, 64)
    assert (exported["mlp_only_layers"], exported["norm_topk_prob"]) == ([0], False)
    checkpointer, step = checkpoint_source(str(trained_qwen3_moe_run))
    config = saved_config(checkpointer, step)
    saved = jax.device_get(load_run_params(checkpointer, step, config).params)
    checkpointer.close()
    assert np.ptp(saved["moe_layers"]["attention"]["query_norm"]["scale"]) > 0  # trained

    tokens = np.random.default_rng(0).integers(0, 257, size=(2, 16))
    theirs = hf_logits(out, "Qwen3MoeForCausalLM", tokens)
    np.testing.assert_allclose(msjax_logits(config.model, saved, tokens), theirs, atol=1e-4, rtol=0)

    # The export imports back bit-identical, into the model its config.json describes.
    model = dataclasses.replace(config.model, init_from=f"hf:{out}", from_hf=True)
    fields = model_from_init(dataclasses.replace(config, model=model)).model
    assert fields.moe == config.model.moe and fields.qk_norm
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    reread = load_params(
        SafetensorsReader(out, open_weight_files(out)),
        config.model,
        jax.tree.map(lambda _: device, saved),
    )
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), reread, saved)


def test_generate_command_runs_a_mixture_of_experts_on_one_device_and_on_its_mesh(
    trained_qwen3_moe_run: Path,
) -> None:
    outputs = []
    for mesh in ("one", "run"):
        printed, errors = io.StringIO(), io.StringIO()
        arguments = ["--prompt", "def ", "--max-new-tokens", "6", "--temperature", "0"]
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
            code = generate_cli([str(trained_qwen3_moe_run), *arguments, "--mesh", mesh])
        assert code == 0, errors.getvalue()
        assert printed.getvalue().startswith("def ") and "tokens from step" in errors.getvalue()
        outputs.append(printed.getvalue())
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"shared_experts": 1}, "model.moe.shared_experts=1"),
        ({"bias_balancing": True}, "model.moe.bias_balancing=true"),
        ({"attention_window": 4}, "model.attention_window=4"),
        ({"parallel_block": True}, "model.parallel_block=true"),
    ],
)
def test_what_qwen3_moe_cannot_run_has_a_reason_naming_the_key(change: dict, named: str) -> None:
    model = load_config(None, QWEN3_MOE_RUN).model
    assert hf_form(model)[:2] == ("Qwen3MoeForCausalLM", None)
    moe_keys = {key: value for key, value in change.items() if hasattr(model.moe, key)}
    changed = dataclasses.replace(
        model,
        moe=dataclasses.replace(model.moe, **moe_keys),
        **{key: value for key, value in change.items() if key not in moe_keys},
    )
    form, reason, _ = hf_form(changed)
    assert form == "Qwen3MoeForCausalLM" and named in reason


def test_export_refuses_what_qwen3_moe_cannot_run_in_one_line(tmp_path: Path) -> None:
    lines = refused_export(tmp_path, [*QWEN3_MOE_RUN, "model.attention_window=4"])
    assert len(lines) == 1, lines
    assert "model.attention_window=4" in lines[0] and "Qwen3MoeForCausalLM" in lines[0]


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window=true"),
        ({"decoder_sparse_step": 2, "mlp_only_layers": []}, "decoder_sparse_step=2"),
        ({"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 >"),
    ],
)
def test_import_refuses_what_msjax_cannot_represent_in_one_line(
    qwen3_moe_dir: Path, tmp_path: Path, changes: dict, named: str
) -> None:
    directory = tmp_path / "qwen3_moe"
    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        (directory / name).symlink_to(qwen3_moe_dir / name)
    hf = {**json.loads((qwen3_moe_dir / "config.json").read_text()), **changes}
    (directory / "config.json").unlink()
    (directory / "config.json").write_text(json.dumps(hf))
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        code = train_cli(
            [f"model.init_from=hf:{directory}", "model.from_hf=true", f"run.dir={tmp_path / 'run'}"]
        )
    assert code == 2
    lines = errors.getvalue().strip().splitlines()
    assert len(lines) == 1 and named in lines[0], lines
    assert not (tmp_path / "run").exists()
