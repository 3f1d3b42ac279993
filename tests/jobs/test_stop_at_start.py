"""A SIGTERM that reaches a worker while it starts up (joining the job, reading data,
compiling) is a request to save and leave like any other: the job saves after its first step and
exits 0. Neither JAX's own preemption handler nor Python's default one may swallow it or kill the
process before it has saved."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from harness import TrainJob, distributed_env, free_port, kill_all, wait_until
from small_runs import QUICK_RUN

from msjax.checkpoint.commits import committed_steps

STEPS = 400  # far more than the run takes before it sees the signal
JOB = [
    *QUICK_RUN,
    "mesh.data=2",
    "mesh.fsdp=1",
    "mesh.tensor=1",
    "train.eval_every=0",
    f"train.steps={STEPS}",
    "checkpoint.every_steps=1000",
]


@pytest.mark.slow
def test_a_sigterm_while_starting_up_saves_after_the_first_step_on_every_process(tmp_path: Path):
    run_dir, port = tmp_path / "run", free_port()
    workers = [
        TrainJob.start(
            run_dir,
            JOB,
            log_path=tmp_path / f"worker{rank}.log",
            env={"JAX_NUM_CPU_DEVICES": "1", **distributed_env(f"127.0.0.1:{port}", 2, rank)},
        )
        for rank in (0, 1)
    ]
    try:
        # process 0 prints its mesh once the job is joined (JAX's preemption service, when on,
        # has its SIGTERM handler in place by then) and before the first step is compiled
        def joined() -> bool:
            assert all(worker.running() for worker in workers), workers[0].output
            return workers[0].printed("run dir")

        wait_until(joined, "process 0's mesh line")
        assert "compiled the train step" not in workers[0].output
        for worker in workers:
            worker.send(signal.SIGTERM)
        codes = [worker.finish().exit_code for worker in workers]
    finally:
        kill_all(workers)
    outputs = [worker.output for worker in workers]
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    match = re.search(r"stopped by SIGTERM after step (\d+)", outputs[0])
    assert match, outputs[0][-3000:]
    step = int(match.group(1))
    assert 1 <= step < STEPS
    assert committed_steps(run_dir / "checkpoints") == [step]
