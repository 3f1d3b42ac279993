"""Every numeric config key is range-checked: nonsense is refused when the config is loaded."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from msjax.config import Config, load_config
from msjax.errors import ConfigError


def numeric_keys() -> list[tuple[str, type]]:
    """`section.key` and its number type, for every int and float key (optional ones included)."""
    keys = []
    for section in dataclasses.fields(Config):
        hints = typing.get_type_hints(typing.get_type_hints(Config)[section.name])
        for key, annotation in hints.items():
            options = set(typing.get_args(annotation)) or {annotation}
            number = next((kind for kind in (float, int) if kind in options), None)
            if number is not None and bool not in options:
                keys.append((f"{section.name}.{key}", number))
    return keys


def test_every_numeric_key_is_found() -> None:
    names = {name for name, _ in numeric_keys()}
    assert {"optim.b1", "optim.eps", "model.rope_theta", "run.seed", "train.steps"} <= names
    assert len(names) >= 40


@pytest.mark.parametrize(("name", "number"), numeric_keys(), ids=lambda value: str(value))
def test_every_numeric_key_refuses_a_negative_value(name: str, number: type) -> None:
    """-2 is below every range (-1 is a mesh axis's "the rest of the devices")."""
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        load_config(None, [f"{name}=-2"])


@pytest.mark.parametrize(("name", "number"), numeric_keys(), ids=lambda value: str(value))
def test_every_numeric_key_refuses_a_value_past_its_range(name: str, number: type) -> None:
    """Integers past int32 (step counters, shapes; a seed past uint32); floats not finite."""
    value = "5000000000" if number is int else "inf"
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        load_config(None, [f"{name}={value}"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.b1=1.0", r"optim\.b1=1\.0 must be in \[0, 1\)"),
        ("optim.b2=1.0", r"optim\.b2=1\.0 must be in \[0, 1\)"),
        ("optim.final_lr_fraction=1.01", r"must be in \[0, 1\]"),
        ("model.norm_eps=1.0", r"model\.norm_eps=1\.0 must be in \(0, 1\)"),
        ("model.init_std=1.5", r"model\.init_std=1\.5 must be in \(0, 1\]"),
        ("model.rope_theta=1", r"model\.rope_theta=1\.0 must be greater than 1"),
        ("run.seed=4294967296", r"run\.seed=4294967296 must be in \[0, 4294967295\]"),
        ("optim.grad_clip_norm=0", r"optim\.grad_clip_norm=0\.0 must be positive"),
        ("resilience.peer_timeout_s=0", r"resilience\.peer_timeout_s=0 must be positive"),
    ],
)
def test_upper_and_edge_values_are_refused(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize(
    "override",
    [
        "optim.b1=0",
        "optim.b2=0.999",
        "optim.weight_decay=0",
        "optim.final_lr_fraction=0",
        "optim.final_lr_fraction=1",
        "optim.grad_clip_norm=null",
        "model.init_std=1",
        "run.seed=4294967295",
        "train.steps=2147483647",
    ],
)
def test_values_at_the_edge_of_their_range_are_accepted(override: str) -> None:
    load_config(None, [override])
