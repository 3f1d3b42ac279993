"""The cost of agreeing on each step's decisions: a 2-process jax.distributed job on 127.0.0.1 runs
the same sharded step loop without a vote, with one `ProcessVote.agree` per step (decided in the
step, as msjax did before) and with one `ProcessVote.agree_behind` per step (decided one step
behind, as msjax.training.decisions does now), interleaved.

    python benchmarks/agreement_overhead.py            # starts both processes itself
    python benchmarks/agreement_overhead.py --smoke    # 10 steps a measurement: seconds
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

STEPS = 200
SMOKE_STEPS = 10


def worker(rank: int, port: int, steps: int) -> None:
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
    votes = {"in step": ProcessVote("benchmark"), "behind": ProcessVote("benchmark_behind")}
    timings: dict[str, list[float]] = {"without": [], "in step": [], "behind": []}
    for label in ("without", "in step", "behind") * 2:  # twice each, interleaved
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
        timings[label].append((time.perf_counter() - started) / steps * 1e3)
    if rank == 0:
        base, in_step, behind = (sum(timings[k]) / 2 for k in ("without", "in step", "behind"))
        print(
            f"agreement: {base:.2f} ms/step without, {in_step:.2f} ms/step with one vote per "
            f"step decided in the step (ratio {in_step / base:.3f}), {behind:.2f} ms/step "
            f"decided one step behind (+{behind - base:.2f} ms, ratio {behind / base:.3f}) "
            f"over {steps} steps, 2 processes"
        )


def main() -> None:
    if len(sys.argv) == 4:
        worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
        return
    if sys.argv[1:] not in ([], ["--smoke"]):
        raise SystemExit(f"usage: {sys.argv[0]} [--smoke]")
    steps = SMOKE_STEPS if sys.argv[1:] == ["--smoke"] else STEPS
    import portpicker

    port = portpicker.pick_unused_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    processes = [
        subprocess.Popen([sys.executable, __file__, str(rank), str(port), str(steps)], env=env)
        for rank in range(2)
    ]
    codes = [process.wait(timeout=600) for process in processes]
    if any(codes):
        raise SystemExit(f"a process failed: exit codes {codes}")


if __name__ == "__main__":
    main()
