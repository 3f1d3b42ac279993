"""The mixture of experts against a dense model of the same active parameters, in one run.

`configs/tiny_moe.yaml`'s model (remat=none) and a dense model with the same layers, embed and
heads whose MLP is as wide as the experts a token runs (its top-k and shared experts: the dense
mlp_dim is their widths, averaged over the layers with the MoE's first dense layers), compiled
once each on 1 CPU device and on 8 simulated ones (data 2 x fsdp 4; data 2 x expert 4 for the MoE
alone: a dense model has no expert axis). Prints:

1. tokens/s of both and their ratio, the median of --rounds rounds of --steps steps each, the
   MoE with each grouped matmul that runs on CPU: jax.lax.ragged_dot (`xla`) and the padded row
   blocks (`blocks`), and the blocks' tokens/s over ragged_dot's;
2. the MoE step's compiled FLOPs (XLA's cost analysis, and the dots alone) over the model FLOPs
   of msjax.observe.flops (active parameters), against a goal of <= 1.10, with each matmul;
3. the all-to-all bytes one device sends per step on the expert-parallel mesh, read from the
   compiled step (the planner has no all-to-all figure yet);
4. the grouped matmul at one expert shape: jax.lax.ragged_dot, the padded row blocks and the
   Pallas kernel (interpreted on CPU: its error, not its speed) against the dense reference
   (every expert on every row, masked), forward only: max abs error and time ratio.

    python benchmarks/moe.py [--steps 6] [--rounds 3]
    python benchmarks/moe.py --smoke   # a tiny model, 2 steps, 1 round

The variants alternate within each round, so a burst of load from elsewhere on a shared machine
falls on all of them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
# the smoke form compiles ten programs: XLA's CPU backend without its costly LLVM passes makes
# that seconds each (same HLO, so the same FLOPs and collectives; slower steps)
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "--smoke" in sys.argv:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SMOKE_XLA_FLAGS}".strip()
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.smoke import SMOKE_LABEL, TINY_CORPUS, TINY_MODEL, TINY_SEQ_LEN  # noqa: E402
from msjax.config import Config, ModelConfig, load_config  # noqa: E402
from msjax.data.dataset import build_training_data  # noqa: E402
from msjax.observe.flops import count_params, flops_per_step  # noqa: E402
from msjax.ops.grouped_matmul_blocks import grouped_matmul_blocks  # noqa: E402
from msjax.planner.aot import CompiledStep, compile_step  # noqa: E402
from msjax.planner.candidates import MeshShape  # noqa: E402
from msjax.planner.compute import estimate_compute  # noqa: E402
from pallas_kernels import grouped_matmul as kernels  # noqa: E402

CONFIG = REPO / "configs" / "tiny_moe.yaml"
COMMON = ["model.remat=none", "train.eval_every=0", *TINY_CORPUS]
SMOKE_SHAPE = [*TINY_MODEL, "model.moe.expert_mlp_dim=32", f"data.seq_len={TINY_SEQ_LEN}"]
FLOPS_GOAL = 1.10  # compiled FLOPs over model FLOPs, remat=none
ONE_DEVICE = MeshShape(1, 1, 1)
FSDP_MESH = MeshShape(2, 4, 1)
EXPERT_MESH = MeshShape(2, 1, 1, expert=4)
MESHES = (ONE_DEVICE, FSDP_MESH, EXPERT_MESH)
MOE_MATMULS = {"moe": "xla", "blocks": "blocks"}  # variant name: model.moe.matmul_impl
WARMUP_STEPS = 1  # run before the timed rounds (first dispatch)


def mesh_name(mesh: MeshShape) -> str:
    """`data 2 x expert 4`: the axes longer than 1, or `1 device`."""
    axes = [f"{axis} {size}" for axis, size in mesh.sizes().items() if size > 1]
    return " x ".join(axes) or "1 device"


def matched_mlp_dim(model: ModelConfig) -> int:
    """The dense mlp_dim whose MLPs hold the MoE's active MLP parameters: the top-k and shared
    experts' widths in each MoE layer, mlp_dim in its first dense layers, averaged over layers
    (the router's embed x num_experts per MoE layer left out)."""
    moe = model.moe
    active_width = (moe.experts_per_token + moe.shared_experts) * (
        moe.expert_mlp_dim or model.mlp_dim
    )
    dense_layers = moe.first_dense_layers
    total = dense_layers * model.mlp_dim + (model.num_layers - dense_layers) * active_width
    return round(total / model.num_layers)


@dataclass
class Variant:
    """One model on one mesh: its compiled step, live state and batches on the devices."""

    source_config: Config  # as loaded, its kernels not yet resolved for this host
    step: CompiledStep
    state: Any
    batches: list[dict]
    tokens_per_s: list[float]

    @property
    def config(self) -> Config:
        return self.step.config


def prepare(config: Config, mesh: MeshShape, steps: int) -> Variant:
    """Compile config's step on mesh once, stage steps batches there and run the warm-up."""
    step = compile_step(config, mesh)
    program = step.program
    source = build_training_data(step.config, lambda line: None).train
    batches = [
        jax.device_put(source.global_batch_at(index), program.batch_sharding)
        for index in range(steps)
    ]
    state = program.init_state()
    for batch in batches[:WARMUP_STEPS]:
        state, metrics = step.compiled(state, batch)
    jax.block_until_ready(metrics)
    return Variant(config, step, state, batches, [])


def time_round(variant: Variant) -> None:
    """One round: every staged batch through the compiled step, one sync at the end."""
    started = time.perf_counter()
    for batch in variant.batches:
        variant.state, metrics = variant.step.compiled(variant.state, batch)
    jax.block_until_ready((variant.state, metrics))
    elapsed_s = time.perf_counter() - started
    config = variant.config
    tokens = len(variant.batches) * config.train.global_batch * config.data.seq_len
    variant.tokens_per_s.append(tokens / elapsed_s)


def print_throughput(variants: dict[str, Variant]) -> None:
    """Table 1: the MoE's median tokens/s on each mesh (ragged_dot and the padded row blocks)
    against the dense model's."""
    print(
        f"\n{'mesh':<20} {'MoE tokens/s':>14} {'blocks tokens/s':>16} {'blocks / xla':>13} "
        f"{'dense tokens/s':>16} {'MoE / dense':>12} {'blocks / dense':>15}"
    )
    for mesh in MESHES:
        dense_mesh = mesh if mesh.expert == 1 else FSDP_MESH
        moe = statistics.median(variants[f"moe {mesh}"].tokens_per_s)
        blocks = statistics.median(variants[f"blocks {mesh}"].tokens_per_s)
        dense = statistics.median(variants[f"dense {dense_mesh}"].tokens_per_s)
        note = "" if dense_mesh == mesh else f"   (dense on {mesh_name(dense_mesh)})"
        print(
            f"{mesh_name(mesh):<20} {moe:14,.1f} {blocks:16,.1f} {blocks / moe:13.3f} "
            f"{dense:16,.1f} {moe / dense:12.3f} {blocks / dense:15.3f}{note}"
        )
    print("  MoE: jax.lax.ragged_dot (model.moe.matmul_impl=xla); blocks: the padded row blocks")


def cost_analysis_flops(compiled: Any) -> float:
    """XLA's cost analysis of a compiled program: the FLOPs one device runs per call."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list | tuple):  # older JAX: one dict per program
        analysis = analysis[0]
    return float(analysis["flops"])


def print_flops(variants: dict[str, Variant]) -> None:
    """Table 2: compiled FLOPs over model FLOPs of each model on one device, with the goal and
    the planner's prediction (msjax.planner.compute) on CPU and on a GPU."""
    print(f"\ncompiled FLOPs / model FLOPs on 1 device, remat=none (goal <= {FLOPS_GOAL:.2f})")
    print(
        f"{'model':<6} {'model GFLOP':>12} {'XLA cost GFLOP':>15} {'ratio':>6} "
        f"{'dots GFLOP':>11} {'ratio':>6} {'planner cpu':>12} {'planner gpu':>12}"
    )
    for name in ("moe", "blocks", "dense"):
        variant = variants[f"{name} {ONE_DEVICE}"]
        model = flops_per_step(variant.config)
        xla = cost_analysis_flops(variant.step.compiled)
        dots = variant.step.flops.total
        planned = {
            platform: estimate_compute(variant.source_config, ONE_DEVICE, platform).ratio
            for platform in ("cpu", "gpu")
        }
        print(
            f"{name:<6} {model / 1e9:12.4f} {xla / 1e9:15.4f} {xla / model:6.3f} "
            f"{dots / 1e9:11.4f} {dots / model:6.3f} {planned['cpu']:12.3f} {planned['gpu']:12.3f}"
        )
    print(
        "  dots: msjax.observe.compiled_flops, every dot times its loop trips; XLA's cost\n"
        "  analysis counts a while loop's body (the scanned layers) once. On CPU ragged_dot runs\n"
        "  every expert on every routed row (num_experts x the grouped work); a GPU groups them;\n"
        "  blocks runs the routed rows and their padding to whole blocks alone, everywhere"
    )


def print_all_to_all(variant: Variant) -> None:
    """Section 3: the all-to-all traffic of the expert-parallel MoE step, from its program."""
    step = variant.step
    stats = step.collectives["all-to-all"]
    sent = step.sent_by_axes
    print(f"\nall-to-all on {mesh_name(step.mesh)}, per step, from the compiled program")
    print(f"  all-to-all ops {stats.ops}, runs per step {stats.executions}")
    print(f"  result bytes per device      {stats.result_bytes:14,d}")
    print(f"  sent over expert per device  {sent.get('expert', 0.0):14,.0f} bytes")
    print(f"  sent over all axes per device {sum(sent.values()):13,.0f} bytes  ({_axes(sent)})")
    print("  planner: no all-to-all figure yet (msjax.planner.communication counts ring")
    print("  collectives and pipeline permutes only): the compiled figure alone")


def _axes(sent: dict[str, float]) -> str:
    return ", ".join(f"{axis} {bytes_:,.0f}" for axis, bytes_ in sorted(sent.items()))


def dense_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Every group's weights on every row, masked to the row's group: E times the work."""
    every = jnp.einsum("rk,gkn->grn", x, w)  # [groups, rows, n]
    row_groups = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(x.shape[0]), side="right")
    mask = jax.nn.one_hot(row_groups, w.shape[0], dtype=x.dtype)  # [rows, groups]; none past
    return jnp.einsum("rg,grn->rn", mask, every)


def median_call_ms(fn: Any, args: tuple, calls: int, rounds: int) -> float:
    """The median over rounds of `calls` back-to-back calls' mean time, in ms."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - started) / calls * 1e3)
    return statistics.median(times)


def print_grouped_matmul(rows: int, embed: int, hidden: int, experts: int, rounds: int) -> None:
    """Section 4: ragged_dot, the padded row blocks and the Pallas kernel against the dense
    reference, forward."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (rows, embed), jnp.float32)  # [rows, embed]
    w = jax.random.normal(keys[1], (experts, embed, hidden), jnp.float32) / embed**0.5
    cuts = jnp.sort(jax.random.randint(keys[2], (experts - 1,), 0, rows - rows // 8))
    ends = jnp.concatenate([cuts, jnp.array([rows - rows // 8])])  # the last 1/8: no group
    group_sizes = jnp.diff(ends, prepend=0).astype(jnp.int32)  # [experts]
    dense = jax.jit(dense_grouped_matmul)
    impls = {
        "dense reference (masked)": dense,
        "jax.lax.ragged_dot": jax.jit(kernels.reference),
        "padded row blocks": jax.jit(grouped_matmul_blocks),
        "pallas (interpreted)": jax.jit(
            lambda x, w, sizes: kernels.grouped_matmul(x, w, sizes, interpret=True)
        ),
    }
    expected = dense(x, w, group_sizes)
    dense_ms = median_call_ms(dense, (x, w, group_sizes), 10, rounds)
    print(
        f"\ngrouped matmul, forward: {rows} rows x {embed} -> {hidden}, {experts} experts, float32"
        f" ({rows // 8} rows past every group)"
    )
    print(f"{'impl':<26} {'max abs error':>14} {'ms':>9} {'ms / dense':>11}")
    for name, fn in impls.items():
        error = float(jnp.max(jnp.abs(fn(x, w, group_sizes) - expected)))
        ms = dense_ms if fn is dense else median_call_ms(fn, (x, w, group_sizes), 10, rounds)
        print(f"{name:<26} {error:14.2e} {ms:9.3f} {ms / dense_ms:11.3f}")
    print(
        "  the Pallas kernel runs in the Pallas interpreter on CPU: its error counts, not its time"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 2 steps, 1 round")
    return parser.parse_args()


def main() -> None:
    """Every variant compiled and timed in alternation, then the four sections printed."""
    args = parse_args()
    shape = [f"train.global_batch={args.global_batch}", f"data.seq_len={args.seq_len}"]
    if args.smoke:
        args.steps, args.rounds = 2, 1
        shape = ["train.global_batch=8", *SMOKE_SHAPE]
    moe_configs = {
        name: load_config(CONFIG, [*COMMON, *shape, f"model.moe.matmul_impl={impl}"])
        for name, impl in MOE_MATMULS.items()
    }
    moe_config = moe_configs["moe"]
    width = matched_mlp_dim(moe_config.model)
    dense_config = load_config(
        CONFIG, [*COMMON, *shape, "model.moe.num_experts=0", f"model.mlp_dim={width}"]
    )
    moe_params = count_params(moe_config.model).active_matmul
    dense_params = count_params(dense_config.model).active_matmul
    model = moe_config.model
    print(
        f"configs/tiny_moe.yaml{SMOKE_LABEL if args.smoke else ''}: {model.num_layers} layers of "
        f"{model.embed_dim}, {model.moe.num_experts} experts (top-{model.moe.experts_per_token}, "
        f"{model.moe.shared_experts} shared) of {model.moe.expert_mlp_dim}, remat=none, batch "
        f"{moe_config.train.global_batch} x seq {moe_config.data.seq_len}, float32; "
        f"median of {args.rounds} rounds of {args.steps} steps, jax {jax.__version__}"
    )
    print(
        f"dense: mlp_dim {width} = ({model.moe.first_dense_layers} x {model.mlp_dim} + "
        f"{model.num_layers - model.moe.first_dense_layers} x "
        f"{model.moe.experts_per_token + model.moe.shared_experts} x {model.moe.expert_mlp_dim})"
        f" / {model.num_layers}; active matmul params MoE {moe_params:,}, dense {dense_params:,}"
        f" (ratio {moe_params / dense_params:.4f}: the routers)"
    )
    variants: dict[str, Variant] = {}
    for mesh in MESHES:
        for name, config in moe_configs.items():
            variants[f"{name} {mesh}"] = prepare(config, mesh, args.steps)
        if mesh.expert == 1:
            variants[f"dense {mesh}"] = prepare(dense_config, mesh, args.steps)
    for _ in range(args.rounds):
        for variant in variants.values():
            time_round(variant)
    print_throughput(variants)
    print_flops(variants)
    print_all_to_all(variants[f"moe {EXPERT_MESH}"])
    rows = 64 if args.smoke else 512
    print_grouped_matmul(
        rows, model.embed_dim, model.moe.expert_mlp_dim, model.moe.num_experts, args.rounds
    )


if __name__ == "__main__":
    main()
