"""Specifications of the `model.moe` section: defaults, overrides, round trips and its checks."""

import dataclasses

import pytest

from msjax.config import config_from_dict, load_config
from msjax.errors import ConfigError
from msjax.resolve import resolve_model


def test_default_model_is_dense() -> None:
    assert load_config().model.moe.num_experts == 0
    assert not load_config().model.moe.enabled


def test_nested_overrides_set_moe_keys_and_survive_a_round_trip() -> None:
    config = load_config(
        None, ["model.moe.num_experts=4", "model.moe.capacity_factor=1.25", "model.mlp_dim=64"]
    )
    assert (config.model.moe.num_experts, config.model.moe.capacity_factor) == (4, 1.25)
    assert config_from_dict(config.to_dict()) == config


def test_auto_grouped_matmul_resolves_to_blocks_on_cpu_and_ragged_dot_elsewhere() -> None:
    model = load_config(None, ["model.moe.num_experts=4"]).model
    assert resolve_model(model, "cpu").moe.matmul_impl == "blocks"
    assert resolve_model(model, "gpu").moe.matmul_impl == "xla"
    assert resolve_model(model, "tpu").moe.matmul_impl == "xla"
    pallas = load_config(None, ["model.moe.num_experts=4", "model.moe.matmul_impl=pallas"]).model
    assert resolve_model(pallas, "cpu").moe.matmul_impl == "pallas"
    blocks = load_config(None, ["model.moe.num_experts=4", "model.moe.matmul_impl=blocks"]).model
    assert resolve_model(blocks, "cpu").moe.matmul_impl == "blocks"
    assert resolve_model(blocks, "gpu").moe.matmul_impl == "blocks"  # plain JAX: everywhere


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.moe.num_experts=-1", "model.moe.num_experts=-1 must be >= 0 (0: dense)"),
        ("model.moe.experts_per_token=5", "model.moe.experts_per_token=5 must be in [1, "),
        ("model.moe.experts_per_token=0", "model.moe.experts_per_token=0 must be in [1, "),
        ("model.moe.shared_experts=-1", "model.moe.shared_experts=-1 must be >= 0"),
        ("model.moe.first_dense_layers=4", "model.moe.first_dense_layers=4 must be in [0, "),
        ("model.moe.expert_mlp_dim=0", "model.moe.expert_mlp_dim=0 must be positive"),
        ("model.moe.load_balance_loss_weight=-0.1", "load_balance_loss_weight=-0.1 must be"),
        ("model.moe.router_z_loss_weight=nan", "model.moe.router_z_loss_weight=nan must be"),
        ("model.moe.bias_update_rate=-1", "model.moe.bias_update_rate=-1.0 must be"),
        ("model.moe.capacity_factor=-1", "model.moe.capacity_factor=-1.0 must be >= 0"),
        ("model.moe.matmul_impl=cuda", "choose one of auto, xla, blocks, pallas"),
        ("model.moe.normalize_top_k=3", "model.moe.normalize_top_k=3 must be a boolean"),
        ("model.moe.top_k=2", "unknown config key 'model.moe.top_k'"),
    ],
)
def test_bad_moe_key_is_one_line_naming_it(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["model.moe.num_experts=4", override])
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_resume_names_a_changed_moe_key_and_lets_the_kernel_choice_change() -> None:
    from msjax.config import differences

    before = load_config(None, ["model.moe.num_experts=4"])
    more_experts = load_config(None, ["model.moe.num_experts=8"])
    other_kernel = load_config(None, ["model.moe.num_experts=4", "model.moe.matmul_impl=pallas"])
    assert differences(before, more_experts) == ["model.moe.num_experts: 4 -> 8"]
    assert differences(before, other_kernel) == []


def test_a_mixture_of_experts_has_no_llama_form_to_export() -> None:
    from msjax.llama_config import unsupported_by_llama

    model = load_config(None, ["model.moe.num_experts=4"]).model
    assert unsupported_by_llama(model) == (
        "model.moe.num_experts=4 (a mixture of experts) has no LlamaForCausalLM form"
    )
    assert unsupported_by_llama(load_config().model) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["mesh.expert=2"], "mesh.expert=2 splits the experts of MoE layers; the model has none"),
        (["mesh.expert=0"], "mesh.expert=0 must be a positive size (1: no expert parallelism)"),
        (["mesh.expert=-1"], "mesh.expert=-1 must be a positive size"),
        (
            ["model.moe.num_experts=6", "mesh.expert=4", "mesh.data=1", "mesh.fsdp=1"],
            "model.moe.num_experts=6 is not divisible by mesh.expert=4",
        ),
        (
            ["model.moe.num_experts=4", "mesh.expert=4", "train.global_batch=8"],
            "train.global_batch=8 is not divisible by the data-parallel size mesh.data x "
            "mesh.fsdp x mesh.expert = 16",
        ),
    ],
)
def test_bad_expert_axis_is_one_line_naming_it(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(None, overrides)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_expert_axis_is_carved_out_of_the_data_parallel_devices() -> None:
    from msjax.resolve import check_device_count

    config = load_config(
        None, ["model.moe.num_experts=8", "mesh.data=-1", "mesh.fsdp=1", "mesh.expert=4"]
    )
    resolved = check_device_count(dataclasses.replace(config), 8 * config.mesh.tensor)
    assert resolved.mesh.axis_sizes() == {
        "data": 2, "fsdp": 1, "expert": 4, "pipe": 1, "tensor": config.mesh.tensor,
    }  # fmt: skip
    assert resolved.mesh.batch_split() == 8
