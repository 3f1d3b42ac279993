"""One field of a Hugging Face `config.json`, read and type-checked: ConfigError in one line
naming the key and what it must be."""

from __future__ import annotations

import json
import math
from typing import Any

from msjax.errors import ConfigError

CONFIG_FILE = "config.json"


def integer_field(hf: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    """A positive integer field of config.json (a float, a bool or a string is refused)."""
    value = hf.get(key)
    if value is None:
        if default is None:
            raise ConfigError(
                f"{where}: {CONFIG_FILE} has no {key} (a {hf.get('model_type')} config has)"
            )
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{where}: {CONFIG_FILE} has {key}={json.dumps(value)}; it must be a positive integer"
        )
    return value


def boolean_field(hf: dict[str, Any], key: str, where: str, default: bool) -> bool:
    """A true/false field of config.json (the string "false" is not false, nor true)."""
    value = default if hf.get(key) is None else hf[key]
    if not isinstance(value, bool):
        raise ConfigError(
            f"{where}: {CONFIG_FILE} has {key}={json.dumps(value)}; it must be true or false"
        )
    return value


def number_field(hf: dict[str, Any], key: str, where: str, default: float) -> float:
    """A finite positive number field of config.json."""
    value = default if hf.get(key) is None else hf[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(
            f"{where}: {CONFIG_FILE} has {key}={json.dumps(value)}; it must be a finite "
            "positive number"
        )
    return float(value)
