"""Op dispatch: each hot op runs the implementation msjax.resolve chose for the run.

`xla` is the plain-JAX reference (the default, runs everywhere), `pallas` a Pallas kernel
(interpreted off GPU), `cudnn` and `triton` GPU-only kernels; kernels run per shard when sharded.
"""

from msjax.ops.attention import attention
from msjax.ops.grouped_matmul import grouped_matmul, routed_experts
from msjax.ops.loss import logits, token_losses
from msjax.ops.norm import add_rms_norm, rms_norm

__all__ = [
    "add_rms_norm",
    "attention",
    "grouped_matmul",
    "logits",
    "rms_norm",
    "routed_experts",
    "token_losses",
]
