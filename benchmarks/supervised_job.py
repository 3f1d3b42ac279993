"""One supervised `python -m msjax.launch` job of the tiny model, as fault_drill.py and recovery.py
run theirs: the overrides they share, and what the job leaves (wall time, incidents, goodput)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.smoke import TINY_MODEL, TINY_SEQ_LEN  # noqa: E402
from msjax.run_dir import RunDir  # noqa: E402


def tiny_job_args(run_dir: Path, steps: int, save_every: int, smoke: bool) -> list[str]:
    """The tiny model on data 2 x fsdp 2 (2 processes x 2 devices); smoke's model is smaller."""
    model = [*TINY_MODEL, f"data.seq_len={TINY_SEQ_LEN}"] if smoke else ["model.num_layers=2"]
    return [
        *model,
        *([] if smoke else ["data.seq_len=64"]),
        "data.max_corpus_mib=1",
        "train.global_batch=8",
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.peak_tflops=0.5",
        f"checkpoint.every_steps={save_every}",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=1",
        f"run.dir={run_dir}",
    ]


def launch(
    run_dir: Path, nprocs: int, flags: list[str], args: list[str], window_s: float | None = None
) -> tuple[int, float]:
    """Runs the job to its end, its output in RUN_DIR.log beside the run dir: exit code, wall s.
    With window_s, a job still running then gets SIGTERM (its workers save and stop)."""
    command = [
        *(sys.executable, "-m", "msjax.launch", f"--nprocs={nprocs}", "--devices-per-proc=2"),
        *flags,
        "--",
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = run_dir.parent / f"{run_dir.name}.log"
    started = time.perf_counter()
    with log.open("w") as out:
        job = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            code = job.wait(timeout=window_s)
        except subprocess.TimeoutExpired:
            job.send_signal(signal.SIGTERM)
            code = job.wait()
    return code, time.perf_counter() - started


def incidents(run_dir: Path) -> list[dict[str, Any]]:
    path = RunDir(run_dir).incidents_log
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def finished_job(
    run_dir: Path, flags: list[str], args: list[str], nprocs: int = 2
) -> dict[str, Any]:
    """A job of nprocs processes that must exit 0: its wall time, incidents and goodput
    summary."""
    code, wall_s = launch(run_dir, nprocs, flags, args)
    if code != 0:
        raise SystemExit(f"the job in {run_dir} exited {code}; see {run_dir}.log")
    goodput = json.loads(RunDir(run_dir).goodput.read_text())
    return {"wall_s": wall_s, "incidents": incidents(run_dir), "goodput": goodput}
