"""Recovery benchmark: a 2-process tiny job with one crash and one hang injected, run with and
without the compilation caches; detection latency, restart-to-first-step, catch-up, goodput.

    python benchmarks/recovery.py [--steps 24] [--out DIR]
    python benchmarks/recovery.py --smoke   # 8 steps, a 4 s step deadline: about a minute

Each job is a real `python -m msjax.launch --nprocs 2 --devices-per-proc 2`. The job with caches
compiles once (its first attempt fills the caches) and loads on every restart; the other compiles
on every attempt. Prints one table, both jobs side by side, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from msjax.run_dir import RunDir  # noqa: E402

STEP_DEADLINE_S = 10.0
SMOKE_STEP_DEADLINE_S = 4.0  # the tiny model's steps take milliseconds; the hang costs this


def job_args(run_dir: Path, steps: int, cache: bool, step_deadline_s: float) -> list[str]:
    return [
        "model.num_layers=2",
        "data.seq_len=64",
        "data.max_corpus_mib=1",
        "train.global_batch=8",
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.peak_tflops=0.5",
        f"checkpoint.every_steps={steps // 4}",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=1",
        "resilience.heartbeat_every_s=0.1",
        f"resilience.step_deadline_s={step_deadline_s}",
        "resilience.stop_grace_s=3",
        "resilience.restart_backoff_s=0.5",
        f"resilience.compile_cache={'true' if cache else 'false'}",
        f"run.dir={run_dir}",
    ]


def run_job(run_dir: Path, steps: int, cache: bool, step_deadline_s: float) -> dict[str, Any]:
    """One supervised job with a crash (rank 1) and a hang (rank 0) injected."""
    crash_at, hang_at = steps // 3, 2 * steps // 3
    faults = f"crash@step={crash_at},rank=1;hang@step={hang_at},rank=0"
    command = [
        sys.executable,
        "-m",
        "msjax.launch",
        "--nprocs=2",
        "--devices-per-proc=2",
        f"--fault={faults}",
        "--",
        *job_args(run_dir, steps, cache, step_deadline_s),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = run_dir.parent / f"{run_dir.name}.log"
    started = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    wall_s = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"the job in {run_dir} exited {code}; see {log}")
    files = RunDir(run_dir)
    incidents = [json.loads(line) for line in files.incidents_log.read_text().splitlines()]
    goodput = json.loads(files.goodput.read_text())
    return {"wall_s": wall_s, "incidents": incidents, "goodput": goodput}


def row(name: str, with_cache: float | None, without: float | None, unit: str = "s") -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} {unit}" if unit else f"{value:.3f}"

    ratio = "-"
    if with_cache and without:
        ratio = f"{without / with_cache:.2f}x"
    return f"| {name} | {cell(with_cache)} | {cell(without)} | {ratio} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--out", type=Path, help="keep the run dirs here (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="8 steps, a shorter step deadline")
    args = parser.parse_args()
    step_deadline_s = SMOKE_STEP_DEADLINE_S if args.smoke else STEP_DEADLINE_S
    if args.smoke:
        args.steps = 8
    base = args.out or Path(tempfile.mkdtemp(prefix="msjax-recovery-"))
    base.mkdir(parents=True, exist_ok=True)
    results = {}
    for cache in (True, False):
        name = "cache" if cache else "no-cache"
        print(
            f"running the job {'with' if cache else 'without'} compilation caches ...", flush=True
        )
        results[name] = run_job(base / name, args.steps, cache, step_deadline_s)

    def incident(name: str, cause: str, key: str) -> float | None:
        found = [i for i in results[name]["incidents"] if i["cause"] == cause]
        return found[0].get(key) if found else None

    print()
    print(
        f"recovery: tiny model, 2 processes x 2 CPU devices, {args.steps} steps, "
        f"checkpoint every {args.steps // 4}, step deadline {step_deadline_s:g} s"
    )
    print("| measure | with caches | without | without / with |")
    print("| --- | --- | --- | --- |")
    for cause in ("crash", "hang"):
        for key, label in (
            ("detection_latency_s", "detection latency"),
            ("restart_to_first_step_s", "restart to first step"),
            ("restart_s", "detection to first step"),
            ("catch_up_s", "detection to catch-up"),
        ):
            print(
                row(
                    f"{cause}: {label}",
                    incident("cache", cause, key),
                    incident("no-cache", cause, key),
                )
            )
    for name in ("cache", "no-cache"):
        results[name]["ratio"] = results[name]["goodput"]["effective_training_time_ratio"]
    print(
        row(
            "effective training time ratio",
            results["cache"]["ratio"],
            results["no-cache"]["ratio"],
            "",
        )
    )
    print(
        row(
            "wall time",
            results["cache"]["goodput"]["wall_s"],
            results["no-cache"]["goodput"]["wall_s"],
        )
    )
    for name in ("cache", "no-cache"):
        breakdown = results[name]["goodput"]["breakdown_s"]
        shares = ", ".join(f"{key[:-2]} {value:.1f} s" for key, value in breakdown.items())
        print(f"{name}: {shares}")
    print(f"run dirs in {base}")


if __name__ == "__main__":
    main()
