"""The cost of agreeing on each step's decisions: a 2-process jax.distributed job on 127.0.0.1 runs
the same sharded step loop without a vote, with one `ProcessVote.agree` per step (decided in the
step), with one `ProcessVote.agree_behind` per step (decided one step behind), and with
msjax.training.decisions's own `agree` (one round behind, its rounds spaced by `VoteSpacing` where
steps are short), interleaved in chunks of 25 steps (each label's chunk in turn, 24 times over);
each label's time is the median of its chunks, so a burst of load from elsewhere does not decide a
ratio. The timings are noisy at the 1% level on a shared machine, so it also counts the work: the
key-value store calls per round and per step.

    python benchmarks/agreement_overhead.py            # starts both processes itself
    python benchmarks/agreement_overhead.py --smoke    # 10 steps a measurement: seconds
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHUNK_STEPS = 25
CHUNKS = 24  # per label
SMOKE_CHUNK_STEPS = 5
SMOKE_CHUNKS = 2


def worker(rank: int, port: int, steps: int, chunks: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from msjax.parallel.agreement import ProcessVote

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows, replicated = (
        NamedSharding(mesh, PartitionSpec("data")),
        NamedSharding(mesh, PartitionSpec()),
    )
    step = jax.jit(
        lambda x: (jnp.tanh(x @ x.T @ x) / 10, jnp.sum(x)),  # a step with cross-process traffic
        out_shardings=(rows, replicated),
        donate_argnums=0,
    )
    x = jax.make_array_from_process_local_data(rows, np.full((256, 512), 0.01, np.float32))
    from msjax.parallel.agreement import VoteSpacing
    from msjax.training.decisions import Decision, agree

    labels = ("without", "in step", "behind", "as msjax.train")
    votes = {label: ProcessVote(f"benchmark_{i}") for i, label in enumerate(labels[1:])}
    for vote in votes.values():
        vote.client = CountingClient(vote.client)
    spacing = VoteSpacing()
    timings: dict[str, list[float]] = {label: [] for label in labels}
    for label in labels * chunks:  # interleaved
        x, metric = step(x)
        previous = metric
        started = time.perf_counter()
        for i in range(steps):
            x, metric = step(x)
            float(np.asarray(previous.addressable_data(0)))  # read step i-1 as the loop does
            previous = metric
            if label == "in step":
                votes[label].agree([0, int(i % 50 == 0), 0])
            elif label == "behind":
                votes[label].agree_behind([0, int(i % 50 == 0), 0])
            elif label == "as msjax.train":
                agree(
                    Decision(step=len(timings[label]) * steps + i + 1),
                    False,
                    votes[label],
                    spacing=spacing,
                )
        timings[label].append((time.perf_counter() - started) / steps * 1e3)
    best = {label: statistics.median(times) for label, times in timings.items()}
    if rank == 0:
        base = best["without"]
        print(f"agreement, median of {chunks} chunks of {steps} steps each, 2 processes:")
        print(f"  without a vote: {base:.2f} ms/step")
        for label in labels[1:]:
            print(
                f"  {label}: {best[label]:.2f} ms/step ({best[label] - base:+.2f} ms, "
                f"ratio {best[label] / base:.3f})"
            )
    per_round = {label: vote.client.calls / max(vote.rounds, 1) for label, vote in votes.items()}
    per_step = {label: vote.client.calls / (chunks * steps) for label, vote in votes.items()}
    rounds = votes["as msjax.train"].rounds
    print(
        f"rank {rank}: key-value store calls per round / per step: "
        + ", ".join(
            f"{label} {per_round[label]:.2f} / {per_step[label]:.2f}" for label in per_round
        )
        + f"; msjax.train's rounds: {rounds} in {chunks * steps} steps "
        f"({spacing.steps_between} steps apart at the end)",
        flush=True,
    )


class CountingClient:
    """jax's key-value client, counting the calls made through it."""

    def __init__(self, client):
        self.client, self.calls = client, 0

    def __getattr__(self, name):
        method = getattr(self.client, name)

        def counted(*args):
            self.calls += 1
            return method(*args)

        return counted


def main() -> None:
    if len(sys.argv) == 5:
        worker(*(int(argument) for argument in sys.argv[1:]))
        return
    if sys.argv[1:] not in ([], ["--smoke"]):
        raise SystemExit(f"usage: {sys.argv[0]} [--smoke]")
    smoke = sys.argv[1:] == ["--smoke"]
    steps, chunks = (SMOKE_CHUNK_STEPS, SMOKE_CHUNKS) if smoke else (CHUNK_STEPS, CHUNKS)
    import portpicker

    port = portpicker.pick_unused_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, *(str(a) for a in (rank, port, steps, chunks))], env=env
        )
        for rank in range(2)
    ]
    codes = [process.wait(timeout=600) for process in processes]
    if any(codes):
        raise SystemExit(f"a process failed: exit codes {codes}")


if __name__ == "__main__":
    main()
