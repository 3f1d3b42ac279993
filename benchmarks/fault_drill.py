"""Fault drill: the same supervised job run clean and with faults injected in the first step after
a save; what each fault costs in wall time (detection, restart and catch-up together), and the
effective training time of both runs.

    python benchmarks/fault_drill.py [--steps 4000] [--save-every 200] [--out DIR]
    python benchmarks/fault_drill.py --smoke   # 12 steps of a smaller model, one crash

Each job is a real `python -m msjax.launch --nprocs 2 --devices-per-proc 2` on the tiny model with
the compilation caches on and every deadline at its default (measured deadlines included). The
baseline is the clean run of the same job in the same sitting. A fault's cost is the time the
faulty run did not spend in kept steps, less the clean run's, divided by the number of faults (the
two runs' step rates differ by several percent on a shared machine, so their wall times alone do
not tell a fault's cost); each incident's own cost is its detection latency plus detection to the
first step after the restart. Prints both tables and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.supervised_job import finished_job, tiny_job_args  # noqa: E402

FAULT_KINDS = ("crash", "hang", "crash")  # the drill's faults, in order, alternating ranks
SMOKE_STEPS, SMOKE_SAVE_EVERY = 12, 4


def drill_faults(steps: int, save_every: int, count: int) -> str:
    """`count` faults spread over the run, each in the first step after a save (step index
    k * save_every runs right after the checkpoint of step k * save_every)."""
    saves = steps // save_every
    faults = []
    for index in range(count):
        save = max(1, (index + 1) * saves // (count + 1))
        kind = FAULT_KINDS[index % len(FAULT_KINDS)]
        faults.append(f"{kind}@step={save * save_every},rank={(index + 1) % 2}")
    return ";".join(faults)


def run_job(
    run_dir: Path, cache_dir: Path, args: argparse.Namespace, faults: str | None
) -> dict[str, Any]:
    flags = [f"--fault={faults}"] if faults else []
    job = tiny_job_args(run_dir, args.steps, args.save_every, args.smoke)
    return finished_job(run_dir, flags, [*job, f"resilience.compile_cache_dir={cache_dir}"])


def not_stepping_s(job: dict[str, Any]) -> float:
    """The job's wall time outside the steps it kept (goodput's step share)."""
    return job["wall_s"] - job["goodput"]["breakdown_s"]["step_s"]


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def ranks(value: list[int] | None) -> str:
    return "-" if not value else " ".join(str(rank) for rank in value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--faults", type=int, default=3, help="how many faults the drill injects")
    parser.add_argument("--out", type=Path, help="keep the run dirs here (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="12 steps, one crash")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.save_every, args.faults = SMOKE_STEPS, SMOKE_SAVE_EVERY, 1
    base = args.out or Path(tempfile.mkdtemp(prefix="msjax-drill-"))
    base.mkdir(parents=True, exist_ok=True)
    cache_dir = base / "compile-cache"
    faults = drill_faults(args.steps, args.save_every, args.faults)
    print(
        f"fault drill{' (smoke)' if args.smoke else ''}: tiny model, 2 processes x 2 CPU devices, "
        f"{args.steps} steps, a checkpoint every {args.save_every}; faults: {faults}",
        flush=True,
    )
    # the clean run first: it fills the compilation cache both runs then load from
    print("running the clean job ...", flush=True)
    clean = run_job(base / "clean", cache_dir, args, None)
    print("running the job with faults ...", flush=True)
    faulty = run_job(base / "faults", cache_dir, args, faults)

    print()
    print(
        "| incident | cause | rank | detection latency | detection to first step | stop | "
        "restart to first step | catch-up | killed at once | killed after grace |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for incident in faulty["incidents"]:
        cells = [
            seconds(incident.get(key))
            for key in (
                "detection_latency_s",
                "restart_s",
                "stop_s",
                "restart_to_first_step_s",
                "catch_up_s",
            )
        ]
        killed = [ranks(incident.get(key)) for key in ("killed_at_once", "killed_after_grace")]
        print(
            f"| {incident['incident']} | {incident['cause']} | {incident['rank']} | "
            f"{' | '.join([*cells, *killed])} |"
        )
    costs = [
        (incident.get("detection_latency_s") or 0.0) + (incident.get("restart_s") or 0.0)
        for incident in faulty["incidents"]
    ]
    print(
        "each incident, detection latency + detection to first step: "
        + ", ".join(f"{cost:.2f} s" for cost in costs)
    )
    count = max(len(faulty["incidents"]), 1)
    per_fault_s = (not_stepping_s(faulty) - not_stepping_s(clean)) / count
    print()
    print("| measure | clean | with faults |")
    print("| --- | --- | --- |")
    print(f"| wall time | {clean['wall_s']:.2f} s | {faulty['wall_s']:.2f} s |")
    for name, key in (("effective training time", "effective_training_time_ratio"),):
        print(f"| {name} | {clean['goodput'][key]:.4f} | {faulty['goodput'][key]:.4f} |")
    print(f"| incidents | {len(clean['incidents'])} | {len(faulty['incidents'])} |")
    for name, job in (("clean", clean), ("with faults", faulty)):
        shares = ", ".join(
            f"{key[:-2]} {value:.1f} s" for key, value in job["goodput"]["breakdown_s"].items()
        )
        print(f"{name}: {shares}")
    print(
        f"wall time per fault, outside kept steps against the clean run: {per_fault_s:.2f} s "
        "(goal: at most 15 s)"
    )
    print(f"with faults / clean wall time: {faulty['wall_s'] / clean['wall_s']:.3f}")
    print(f"run dirs in {base}")


if __name__ == "__main__":
    main()
