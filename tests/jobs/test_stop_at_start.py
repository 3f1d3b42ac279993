"""A SIGTERM that reaches a worker while it starts up (joining the job, reading data,
compiling) is a request to save and leave like any other: the job saves after its first step and
exits 0. Neither JAX's own preemption handler nor Python's default one may swallow it or kill the
process before it has saved."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from small_runs import QUICK_RUN

from msjax.checkpoint.commits import committed_steps

REPO = Path(__file__).resolve().parents[2]
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_a_sigterm_while_starting_up_saves_after_the_first_step_on_every_process(tmp_path: Path):
    run_dir, port = tmp_path / "run", free_port()
    logs = [tmp_path / f"worker{rank}.log" for rank in (0, 1)]
    workers = []
    for rank, log in enumerate(logs):
        env = {
            **os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
            "JAX_NUM_CPU_DEVICES": "1", "MSJAX_COORDINATOR": f"127.0.0.1:{port}",
            "MSJAX_NUM_PROCESSES": "2", "MSJAX_PROCESS_ID": str(rank),
        }  # fmt: skip
        env.pop("MSJAX_FAULT", None)
        with log.open("w") as out:
            command = [sys.executable, "-m", "msjax.train", *JOB, f"run.dir={run_dir}"]
            workers.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env))
    try:
        # process 0 prints its mesh once the job is joined (JAX's preemption service, when on,
        # has its SIGTERM handler in place by then) and before the first step is compiled
        deadline = time.monotonic() + 300
        while "run dir" not in logs[0].read_text() and time.monotonic() < deadline:
            assert all(worker.poll() is None for worker in workers), logs[0].read_text()
            time.sleep(0.05)
        assert "compiled the train step" not in logs[0].read_text()
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        codes = [worker.wait(timeout=300) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    match = re.search(r"stopped by SIGTERM after step (\d+)", outputs[0])
    assert match, outputs[0][-3000:]
    step = int(match.group(1))
    assert 1 <= step < STEPS
    assert committed_steps(run_dir / "checkpoints") == [step]
