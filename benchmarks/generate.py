"""Decoding speed of msjax.generate's KV cache against recomputing the full forward per token.

Both decode greedily from the same random `configs/small.yaml` model on one CPU device. The
baseline runs the training forward pass over the whole sequence so far for every new token (one
compiled program over the padded final length; a causal model never looks at the padding) and
takes the argmax at the last real position; msjax.generate prefills the prompt once and then
runs one token at a time against its cache. Prints tokens/s of both and their ratio; the two
must also produce the same tokens.

    python benchmarks/generate.py [--prompt-tokens 64] [--new-tokens 32] [--rounds 2]
    python benchmarks/generate.py --smoke   # a tiny model, 8 + 4 tokens, 1 round: seconds

Each method runs once to compile, then --rounds timed rounds alternating with the other, keeping
its best, so a burst of load from elsewhere on a shared machine does not decide the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["JAX_NUM_CPU_DEVICES"] = "1"
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.smoke import TINY_MODEL  # noqa: E402
from msjax.config import load_config  # noqa: E402
from msjax.generate import Generator, Sampling  # noqa: E402
from msjax.models.transformer import Transformer  # noqa: E402
from msjax.resolve import resolve_model  # noqa: E402


def full_forward_tokens(model: Transformer, prompt: list[int], count: int) -> list[int]:
    forward = nnx.jit(lambda model, tokens, last: jnp.argmax(model(tokens)[0, last]))
    length = len(prompt) + count
    tokens = list(prompt)
    for _ in range(count):
        padded = jnp.asarray([tokens + [0] * (length - len(tokens))], jnp.int32)
        tokens.append(int(forward(model, padded, len(tokens) - 1)))
    return tokens[len(prompt) :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 8 + 4 tokens")
    args = parser.parse_args()
    if args.smoke:
        args.prompt_tokens, args.new_tokens, args.rounds = 8, 4, 1

    config = load_config(REPO / "configs" / "small.yaml", TINY_MODEL if args.smoke else [])
    model_config = resolve_model(config.model, "cpu")
    model = Transformer(model_config, nnx.Rngs(params=0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    generator = Generator(model_config, params, vocab_limit=257)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 256, args.prompt_tokens)]
    greedy = Sampling(temperature=0.0)

    def cached() -> list[int]:
        return list(generator.tokens(prompt, args.new_tokens, greedy, eos_id=None))

    def recomputed() -> list[int]:
        return full_forward_tokens(model, prompt, args.new_tokens)

    methods = {"kv cache (msjax.generate)": cached, "full forward per token": recomputed}
    produced = {name: method() for name, method in methods.items()}  # compiles
    best = dict.fromkeys(methods, float("inf"))
    for _ in range(args.rounds):
        for name, method in methods.items():
            started = time.perf_counter()
            method()
            best[name] = min(best[name], time.perf_counter() - started)

    params_m = sum(x.size for x in jax.tree.leaves(params)) / 1e6
    print(
        f"configs/small.yaml ({params_m:.0f}M parameters), 1 CPU device, prompt "
        f"{args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy"
    )
    rates = {name: args.new_tokens / seconds for name, seconds in best.items()}
    for name, rate in rates.items():
        print(f"  {name:<28} {rate:8.1f} tokens/s")
    same = produced["kv cache (msjax.generate)"] == produced["full forward per token"]
    ratio = rates["kv cache (msjax.generate)"] / rates["full forward per token"]
    print(f"ratio kv cache / full forward: {ratio:.1f}x; same tokens: {same}")


if __name__ == "__main__":
    main()
