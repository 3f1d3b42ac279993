"""Per-device memory of a compiled program, as XLA's buffer assignment reports it.

`total_bytes` is what one device must hold at once: arguments + outputs - outputs aliased onto
donated arguments + temporaries. XLA also reports `peak_memory_in_bytes`, but on the CPU backend
it is about the argument size, not a peak, so msjax does not use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CompiledMemory:
    """Bytes per device of one compiled program."""

    argument_bytes: int  # inputs: the train state and the batch shards
    output_bytes: int
    alias_bytes: int  # outputs written in place of donated inputs (the new state)
    temp_bytes: int  # activations, gradients, collective buffers: XLA's temporaries at their peak

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def compiled_memory(compiled: Any) -> CompiledMemory | None:
    """XLA's memory analysis of a `jax.stages.Compiled`; None where the backend gives none."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # backends without the analysis raise assorted errors
        return None
    if stats is None:
        return None
    return CompiledMemory(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
    )
