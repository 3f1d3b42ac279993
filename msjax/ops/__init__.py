"""Op dispatch: each hot op runs a Pallas kernel on GPU or the plain-XLA reference elsewhere.

`model.attention_impl`, `model.norm_impl` and `model.loss_impl` choose: `auto` (the kernel on
GPU, the reference elsewhere), `xla`, `pallas` (interpret mode off GPU: slow, for tests) or, for
attention, `cudnn`, and for norms, `triton` (a jax-triton kernel). Kernels run per shard under
`shard_map` when the parallel layer installs a mesh.
"""

from msjax.ops.attention import attention
from msjax.ops.dispatch import resolve_impl
from msjax.ops.loss import logits, token_losses
from msjax.ops.norm import add_rms_norm, rms_norm

__all__ = ["add_rms_norm", "attention", "logits", "resolve_impl", "rms_norm", "token_losses"]
