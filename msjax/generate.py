"""`python -m msjax.generate RUN_DIR --prompt TEXT`: sample text from a checkpoint, KV-cached.

Greedy at temperature 0, else sampling with optional top-k / top-p from a seeded key; the text is
printed as it is produced and the decoding speed at the end.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from msjax.cli import ArgumentParser, user_error
from msjax.config import Config, ModelConfig
from msjax.config_checks import MAX_SEED
from msjax.errors import MsjaxError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits."""

    temperature: float = 1.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # nucleus: the fewest tokens whose probabilities reach top_p
    seed: int = 0


def sample_token(logits: Any, key: Any, sampling: Sampling, vocab_limit: int) -> Any:
    """One token id per row of logits [batch, vocab]; ids >= vocab_limit (padding) never."""
    import jax
    import jax.numpy as jnp

    logits = logits.astype(jnp.float32)
    lowest = jnp.finfo(jnp.float32).min
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, lowest)
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / sampling.temperature
    if sampling.top_k > 0:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, lowest, logits)
    if sampling.top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[..., ::-1]
        probabilities = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probabilities, axis=-1) - probabilities  # mass of the larger ones
        kept = jnp.where(before < sampling.top_p, ordered, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, lowest, logits)
    return jax.random.categorical(key, logits, axis=-1)


class Generator:
    """A model's parameters with compiled prefill and one-token steps over a KV cache."""

    def __init__(self, model: ModelConfig, params: dict[str, Any], vocab_limit: int):
        import jax
        from flax import nnx

        from msjax.models.decoding import decode
        from msjax.models.transformer import Transformer

        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(lambda: Transformer(model, nnx.Rngs(params=0)))
        self.graphdef, self.abstract_state = nnx.split(abstract, nnx.Param)
        self.config = model
        self.params = params
        self.vocab_limit = vocab_limit

        def advance(params, tokens, cache, key, sampling):
            state = jax.tree.map(lambda leaf: leaf, self.abstract_state)
            nnx.replace_by_pure_dict(state, params)
            logits, cache = decode(nnx.merge(self.graphdef, state), tokens, cache)
            token = sample_token(logits[:, -1], key, sampling, self.vocab_limit)
            return token, cache

        self._advance = jax.jit(advance, static_argnames=("sampling",), donate_argnums=(2,))

    def tokens(
        self, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling, eos_id: int | None
    ) -> Iterator[int]:
        """New token ids one by one (stopping after eos_id), the prompt prefilled at once."""
        import jax
        import jax.numpy as jnp

        from msjax.models.decoding import empty_cache

        cache = empty_cache(self.config, 1, len(prompt) + max_new_tokens)
        key = jax.random.key(sampling.seed)
        tokens = jnp.asarray([list(prompt)], jnp.int32)
        compiled_for = dataclasses.replace(sampling, seed=0)  # the seed is in the key, not code
        for _ in range(max_new_tokens):
            key, step_key = jax.random.split(key)
            token, cache = self._advance(
                self.params, tokens, cache, step_key, sampling=compiled_for
            )
            value = int(token[0])
            yield value
            if value == eos_id:
                return
            tokens = token[:, None].astype(jnp.int32)


def generation_model(config: Config, backend: str) -> ModelConfig:
    """The saved model with its kernels chosen anew for this backend; a mixture of experts
    dropless (a capacity factor is a training budget: every token runs its experts, as in the
    Hugging Face export)."""
    from msjax.resolve import IMPL_KEYS, resolve_model

    automatic = dataclasses.replace(config.model, **dict.fromkeys(IMPL_KEYS, "auto"))
    dropless = dataclasses.replace(automatic.moe, capacity_factor=0.0)
    return resolve_model(dataclasses.replace(automatic, moe=dropless), backend)


def _parse(argv: Sequence[str] | None) -> Any:
    parser = ArgumentParser(prog="python -m msjax.generate", description=__doc__)
    parser.add_argument("run_dir", help="RUN_DIR, RUN_DIR/checkpoints or .../checkpoints/STEP")
    parser.add_argument("--step", type=int, default=None, help="default: the newest checkpoint")
    parser.add_argument("--prompt", required=True)
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="with the prompt, at most the data.seq_len the model was trained on",
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: no nucleus cut")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mesh",
        choices=("one", "run"),
        default="one",
        help="one device, or the run's own mesh (needs as many devices)",
    )
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        raise MsjaxError(f"--max-new-tokens={args.max_new_tokens} must be at least 1")
    if not 0 <= args.temperature < math.inf:  # inf would sample padding ids, NaN token 0
        raise MsjaxError(f"--temperature={args.temperature} must be finite and >= 0 (0: greedy)")
    if args.top_k < 0:
        raise MsjaxError(f"--top-k={args.top_k} must be 0 (no cut) or in [1, vocabulary size]")
    if not 0 < args.top_p <= 1:
        raise MsjaxError(f"--top-p={args.top_p} must be in (0, 1]")
    if not 0 <= args.seed <= MAX_SEED:
        raise MsjaxError(f"--seed={args.seed} must be in [0, {MAX_SEED}]")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 reach argv as lone surrogates
        raise MsjaxError("--prompt is not UTF-8 text; give the prompt in UTF-8") from None
    return args


def check_fits(args: Any, prompt_tokens: int, vocab: int, trained_positions: int) -> None:
    """MsjaxError unless --top-k is within the vocabulary and the prompt plus the new tokens fit
    the positions the model was trained on (its data.seq_len, the export's
    max_position_embeddings): the KV cache is allocated for all of them at once."""
    if args.top_k > vocab:
        raise MsjaxError(
            f"--top-k={args.top_k} is more than the {vocab} tokens of the vocabulary; give 0 (no "
            f"cut) or a value in [1, {vocab}]"
        )
    total = prompt_tokens + args.max_new_tokens
    if total > trained_positions:
        room = trained_positions - prompt_tokens
        hint = f"give --max-new-tokens <= {room}" if room > 0 else "give a shorter prompt"
        raise MsjaxError(
            f"the prompt ({prompt_tokens} tokens) plus --max-new-tokens={args.max_new_tokens} is "
            f"{total} tokens, past the {trained_positions} positions the model was trained on "
            f"(data.seq_len); {hint}"
        )


def run(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from msjax.checkpoint.run_params import (
        checkpoint_source,
        load_run_params,
        saved_config,
    )
    from msjax.data.tokenizer import load_tokenizer

    checkpointer, step = checkpoint_source(args.run_dir, args.step)
    config = saved_config(checkpointer, step)
    tokenizer = load_tokenizer(config.data.tokenizer)
    prompt = [int(i) for i in tokenizer.encode(args.prompt)]
    if not prompt:
        raise MsjaxError("--prompt is empty; give some text to continue")
    vocab = min(tokenizer.vocab_size, config.model.vocab_size)
    check_fits(args, len(prompt), vocab, config.data.seq_len)
    import jax

    mesh = None
    if args.mesh == "run":
        from msjax.parallel.mesh import build_mesh
        from msjax.resolve import check_device_count

        mesh = build_mesh(check_device_count(config, jax.device_count()).mesh)
    model = generation_model(config, jax.default_backend())
    config = dataclasses.replace(config, model=model)
    params = load_run_params(checkpointer, step, config, mesh).params
    checkpointer.close()
    generator = Generator(model, params, vocab)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)

    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    produced: list[int] = []
    shown = ""
    times = []
    for token in generator.tokens(prompt, args.max_new_tokens, sampling, tokenizer.eos_id):
        times.append(time.perf_counter())
        produced.append(token)
        text = tokenizer.decode(produced)
        if not text.endswith("\ufffd"):  # an unfinished multi-byte character waits
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text
    text = tokenizer.decode(produced)
    sys.stdout.write(text[len(shown) :] + "\n")
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
    print(
        f"msjax.generate: {len(produced)} tokens from step {step}; {rate:.1f} tokens/s "
        "(after the first, which includes compiling)",
        file=sys.stderr,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(argv)
    except MsjaxError as error:
        return user_error("msjax.generate", error)


if __name__ == "__main__":
    raise SystemExit(main())
