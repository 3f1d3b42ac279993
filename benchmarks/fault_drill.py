"""Fault drill: the same supervised job run clean, with faults injected at seeded random steps
between disk saves, and with the same faults and in-memory snapshots after every step
(checkpoint.memory_every_steps=1, memory_when_busy=wait); what each fault costs in wall time
(detection, restart and catch-up together) and in steps lost, and the effective training time of
each run.

    python benchmarks/fault_drill.py [--steps 4000] [--save-every 200] [--seed 0] [--out DIR]
    python benchmarks/fault_drill.py --smoke   # 12 steps, a smaller model, one crash, no clean run

Each job is a real `python -m msjax.launch --nprocs 2 --devices-per-proc 2` on the tiny model with
the compilation caches on and every deadline at its default (measured deadlines included). The
baseline is the clean run of the same job in the same sitting. A fault's cost is the time the
faulty run did not spend in kept steps, less the clean run's, divided by the number of faults (the
two runs' step rates differ by several percent on a shared machine, so their wall times alone do
not tell a fault's cost); each incident's own cost is its detection latency plus detection to the
first step after the restart. Prints the tables, the wall time ratio, and the effective
training time and steps lost per fault with memory snapshots against without.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.supervised_job import finished_job, tiny_job_args  # noqa: E402
from msjax.run_dir import RunDir  # noqa: E402

FAULT_KINDS = ("crash", "hang", "crash")  # the drill's faults, in order, alternating ranks
SMOKE_STEPS, SMOKE_SAVE_EVERY = 12, 4
ETT = "effective_training_time_ratio"  # goodput.json's effective training time
# the snapshots the third run keeps: every step, each waited for rather than skipped, so a fault
# loses at most one step
MEMORY_SNAPSHOTS = ["checkpoint.memory_every_steps=1", "checkpoint.memory_when_busy=wait"]


def drill_faults(steps: int, save_every: int, count: int, seed: int) -> str:
    """`count` faults spread over the run, each at a step drawn (from `seed`) strictly between
    two saves: step index k * save_every + d runs d steps after the checkpoint of step
    k * save_every, so restarting from that checkpoint repeats d steps."""
    draw = random.Random(seed)
    saves = steps // save_every
    faults = []
    for index in range(count):
        save = min(max(1, (index + 1) * saves // (count + 1)), saves - 1)
        step = save * save_every + draw.randint(1, save_every - 1)
        kind = FAULT_KINDS[index % len(FAULT_KINDS)]
        faults.append(f"{kind}@step={step},rank={(index + 1) % 2}")
    return ";".join(faults)


def run_job(
    run_dir: Path,
    cache_dir: Path,
    args: argparse.Namespace,
    faults: str | None,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    flags = [f"--fault={faults}"] if faults else []
    job = tiny_job_args(run_dir, args.steps, args.save_every, args.smoke)
    cache = f"resilience.compile_cache_dir={cache_dir}"
    finished = finished_job(run_dir, flags, [*job, cache, *extra])
    return {**finished, "steps_lost": steps_lost(run_dir, finished["incidents"])}


def steps_lost(run_dir: Path, incidents: list[dict[str, Any]]) -> list[int]:
    """Per fault, the updates its rank's state had when it fired (its step in faults.jsonl) less
    the step the restart after it resumed from: the steps done again. (The incident's own
    steps_lost counts from the newest step the launcher's heartbeats showed, which can lag.)"""
    path = RunDir(run_dir).faults
    fired = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if len(fired) != len(incidents):
        raise SystemExit(f"{run_dir}: {len(fired)} faults fired but {len(incidents)} incidents")
    return [
        fault["step"] - incident["resumed_from_step"]
        for fault, incident in zip(fired, incidents, strict=True)
    ]


def steps_lost_per_fault(job: dict[str, Any]) -> float:
    """The mean steps a fault of the job cost (0.0 with none)."""
    return sum(job["steps_lost"]) / max(len(job["steps_lost"]), 1)


def not_stepping_s(job: dict[str, Any]) -> float:
    """The job's wall time outside the steps it kept (goodput's step share)."""
    return job["wall_s"] - job["goodput"]["breakdown_s"]["step_s"]


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def ranks(value: list[int] | None) -> str:
    return "-" if not value else " ".join(str(rank) for rank in value)


def print_incidents(title: str, job: dict[str, Any]) -> None:
    """One row per incident of `job`: its timings, who was killed, where it resumed from and the
    steps it lost; then each incident's cost."""
    print()
    print(f"{title}:")
    print(
        "| incident | cause | rank | detection latency | detection to first step | stop | "
        "restart to first step | catch-up | killed at once | killed after grace | resumed from | "
        "steps lost |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for incident, lost in zip(job["incidents"], job["steps_lost"], strict=True):
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
        resumed = [str(incident.get("resumed_from", "-")), str(lost)]
        print(
            f"| {incident['incident']} | {incident['cause']} | {incident['rank']} | "
            f"{' | '.join([*cells, *killed, *resumed])} |"
        )
    costs = [
        (incident.get("detection_latency_s") or 0.0) + (incident.get("restart_s") or 0.0)
        for incident in job["incidents"]
    ]
    print(
        "each incident, detection latency + detection to first step: "
        + ", ".join(f"{cost:.2f} s" for cost in costs)
    )


def print_measures(runs: dict[str, dict[str, Any] | None]) -> None:
    """The runs side by side (clean first; "-" for a run not made), and where each one's time
    went."""
    names = list(runs)
    print()
    print(f"| measure | {' | '.join(names)} |")
    print(f"| --- |{' --- |' * len(names)}")
    for measure, value in (
        ("wall time", lambda job: f"{job['wall_s']:.2f} s"),
        ("effective training time", lambda job: f"{job['goodput'][ETT]:.4f}"),
        ("incidents", lambda job: str(len(job["incidents"]))),
        ("steps lost per fault", lambda job: f"{steps_lost_per_fault(job):.2f}"),
    ):
        cells = ["-" if job is None else value(job) for job in runs.values()]
        print(f"| {measure} | {' | '.join(cells)} |")
    for name, job in runs.items():
        if job is None:
            continue
        shares = ", ".join(
            f"{key[:-2]} {value:.1f} s" for key, value in job["goodput"]["breakdown_s"].items()
        )
        print(f"{name}: {shares}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--faults", type=int, default=3, help="how many faults the drill injects")
    parser.add_argument("--seed", type=int, default=0, help="draws the faults' steps")
    parser.add_argument("--out", type=Path, help="keep the run dirs here (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="12 steps, one crash, no clean run")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.save_every, args.faults = SMOKE_STEPS, SMOKE_SAVE_EVERY, 1
    base = args.out or Path(tempfile.mkdtemp(prefix="msjax-drill-"))
    base.mkdir(parents=True, exist_ok=True)
    cache_dir = base / "compile-cache"
    faults = drill_faults(args.steps, args.save_every, args.faults, args.seed)
    print(
        f"fault drill{' (smoke)' if args.smoke else ''}: tiny model, 2 processes x 2 CPU devices, "
        f"{args.steps} steps, a checkpoint every {args.save_every}; faults: {faults}",
        flush=True,
    )
    # the first run fills the compilation cache the others then load from; the smoke form has
    # no clean run (to stay as cheap as the two runs it made before the snapshots' run was added)
    clean = None
    if not args.smoke:
        print("running the clean job ...", flush=True)
        clean = run_job(base / "clean", cache_dir, args, None)
    print("running the job with faults ...", flush=True)
    faulty = run_job(base / "faults", cache_dir, args, faults)
    print("running the job with faults and memory snapshots ...", flush=True)
    memory = run_job(base / "faults-memory", cache_dir, args, faults, tuple(MEMORY_SNAPSHOTS))

    print_incidents("with faults", faulty)
    print_incidents("with faults and memory snapshots", memory)
    runs = {"clean": clean, "with faults": faulty, "with faults, memory snapshots": memory}
    print_measures(runs)
    if clean is not None:
        count = max(len(faulty["incidents"]), 1)
        per_fault_s = (not_stepping_s(faulty) - not_stepping_s(clean)) / count
        print(
            f"wall time per fault, outside kept steps against the clean run: {per_fault_s:.2f} s "
            "(goal: at most 15 s)"
        )
        print(f"with faults / clean wall time: {faulty['wall_s'] / clean['wall_s']:.3f}")
    with_ett, without_ett = (job["goodput"][ETT] for job in (memory, faulty))
    print(
        "effective training time with faults, memory snapshots / without: "
        f"{with_ett:.4f} / {without_ett:.4f} = {with_ett / without_ett:.3f}"
    )
    print(
        f"steps lost per fault: {steps_lost_per_fault(faulty):.2f} without memory snapshots, "
        f"{steps_lost_per_fault(memory):.2f} with them (goal: at most 1 with them)"
    )
    print(f"run dirs in {base}")


if __name__ == "__main__":
    main()
