"""Reading a YAML config file into its mapping of sections, with one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from msjax.errors import ConfigError


def read_config_file(path: Path) -> dict[str, Any]:
    """A config file's sections as a mapping (an empty file is none); a file that is missing,
    unreadable, not UTF-8, not YAML or not a mapping is a ConfigError naming it."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise ConfigError(f"config file {path} cannot be read ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {error.start}); save it as UTF-8"
        ) from None
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return tree
