"""The check every op makes of its `impl`: the concrete choice msjax.resolve made for the run."""

from __future__ import annotations

from msjax.resolve import impl_choices


def resolved_impl(impl: str, key: str) -> str:
    """impl, if it is a concrete choice for `model.<key>` (`norm_impl`); ValueError otherwise.

    `auto` depends on the backend, which ops do not decide: msjax.resolve chooses once per run,
    so every part of the run agrees on what runs.
    """
    choices = impl_choices(key)  # read once from ModelConfig's Literal types
    if impl not in choices:
        raise ValueError(
            f"model.{key}={impl!r} reached msjax.ops unresolved; ops run one of "
            f"{', '.join(choices)}: resolve the config first with msjax.resolve "
            "(resolve, or resolve_model for the model section)"
        )
    return impl
