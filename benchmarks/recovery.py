"""Recovery benchmark: a 2-process tiny job with one crash and one hang injected, run with and
without the compilation caches; detection latency, restart-to-first-step, catch-up, goodput.

    python benchmarks/recovery.py [--steps 24] [--out DIR]
    python benchmarks/recovery.py --smoke   # 8 steps, a smaller model, 1 process, the hang alone
    python benchmarks/recovery.py --bad-slot [--steps 24]   # a crash-looping slot, 4 processes
    python benchmarks/recovery.py --long-drill [--minutes 10]   # a slot crash-looping, 2 bit flips

Each job is a real `python -m msjax.launch --nprocs 2 --devices-per-proc 2` (one process in the
smoke form). The job with caches compiles once (its first attempt fills the caches) and loads on
every restart; the other compiles on every attempt. Prints one table, both jobs side by side, and
the ratio.

--bad-slot: 4 processes x 2 devices where the slot of rank 3 crashes at every start; excluded
after 2 faults, it is replaced by a spare (--spares 1), or the mesh shrinks to 2 processes, or
(resilience.on_bad_node=restart, today's behaviour) the job restarts until its budget is spent.

--long-drill: the same 4-process job (data 4 x fsdp 2, so replicas exist on the shrunk mesh too)
for a window of --minutes, through a bit flip on rank 1, slot 3 crashing at every start, then a
bit flip on rank 0; the corruption guard checks every 25 steps and reruns (on_corruption=rerun).
Run under on_bad_node=exclude (the default: slot 3 is left out, the mesh shrinks) and restart
(today's behaviour: the job restarts on the broken slot until a limit stops it), one after the
other; a job still running when the window ends gets SIGTERM (it saves and stops). Effective
training time over the drill: the kept steps' time over the window (or the job's wall time,
if longer). Prints both and their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.supervised_job import finished_job, incidents, launch, tiny_job_args  # noqa: E402
from msjax.run_dir import RunDir  # noqa: E402

STEP_DEADLINE_S = 10.0
SMOKE_STEP_DEADLINE_S = 4.0  # the tiny model's steps take milliseconds; the hang costs this
# the smoke form's job is one process holding both devices (data 2): the hang it injects is
# rank 0's, found and restarted the same way, for half the processes' start-up and compiles
SMOKE_MESH = ["mesh.data=2", "mesh.fsdp=1"]


def processes(smoke: bool) -> int:
    return 1 if smoke else 2


def job_shape(smoke: bool) -> str:
    return "1 process x 2 CPU devices" if smoke else "2 processes x 2 CPU devices"


def job_args(run_dir: Path, steps: int, cache: bool, step_deadline_s: float, smoke: bool):
    return [
        *tiny_job_args(run_dir, steps, steps // 4, smoke),
        "resilience.heartbeat_every_s=0.1",
        f"resilience.step_deadline_s={step_deadline_s}",
        "resilience.stop_grace_s=3",
        "resilience.restart_backoff_s=0.5",
        f"resilience.compile_cache={'true' if cache else 'false'}",
        *(SMOKE_MESH if smoke else []),
    ]


def injected_causes(smoke: bool) -> tuple[str, ...]:
    """The faults each job meets: a crash and a hang; the smoke form's only the hang (the
    slower one to find, the one its check reads)."""
    return ("hang",) if smoke else ("crash", "hang")


def run_job(run_dir: Path, steps: int, cache: bool, smoke: bool) -> dict[str, Any]:
    """One supervised job with a crash (rank 1) and a hang (rank 0) injected (a hang alone
    in the smoke form)."""
    crash_at, hang_at = steps // 3, 2 * steps // 3
    fault_of = {"crash": f"crash@step={crash_at},rank=1", "hang": f"hang@step={hang_at},rank=0"}
    faults = ";".join(fault_of[cause] for cause in injected_causes(smoke))
    step_deadline_s = SMOKE_STEP_DEADLINE_S if smoke else STEP_DEADLINE_S
    args = job_args(run_dir, steps, cache, step_deadline_s, smoke)
    return finished_job(run_dir, [f"--fault={faults}"], args, processes(smoke))


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
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="8 steps, 1 process, the hang alone, a shorter deadline",
    )
    parser.add_argument("--bad-slot", action="store_true", help="a crash-looping slot instead")
    parser.add_argument(
        "--long-drill", action="store_true", help="a crash-looping slot and 2 bit flips"
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="the long drill's window")
    args = parser.parse_args()
    if args.long_drill:
        long_drill(args.minutes, args.out or Path(tempfile.mkdtemp(prefix="msjax-long-drill-")))
        return
    if args.bad_slot:
        bad_slot(args.steps, args.out or Path(tempfile.mkdtemp(prefix="msjax-bad-slot-")))
        return
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
        results[name] = run_job(base / name, args.steps, cache, args.smoke)

    def incident(name: str, cause: str, key: str) -> float | None:
        found = [i for i in results[name]["incidents"] if i["cause"] == cause]
        return found[0].get(key) if found else None

    print()
    print(
        f"recovery: tiny model, {job_shape(args.smoke)}, {args.steps} steps, "
        f"checkpoint every {args.steps // 4}, step deadline {step_deadline_s:g} s"
    )
    print("| measure | with caches | without | without / with |")
    print("| --- | --- | --- | --- |")
    for cause in injected_causes(args.smoke):
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


def run_bad_slot_job(run_dir: Path, steps: int, how: str) -> dict[str, Any]:
    """One 4-process job whose slot 3 crashes at every start: `spare`, `shrink` or `restart`."""
    save_every = steps // 4
    flags = ["--spares=1"] if how == "spare" else []
    overrides = [
        "mesh.tensor=2",
        f"checkpoint.every_steps={save_every}",
        "resilience.max_faults_per_slot=2",
        "resilience.readmit_after_s=0",
        "resilience.max_restarts=3",
        f"resilience.on_bad_node={'restart' if how == 'restart' else 'exclude'}",
    ]
    # a compile cache of this job's own (restarts load from it), not one others have written
    cache_dir = f"resilience.compile_cache_dir={run_dir.parent / f'{run_dir.name}-cache'}"
    args = [*job_args(run_dir, steps, True, STEP_DEADLINE_S, False), *overrides, cache_dir]
    fault = f"--fault=crash@step={save_every + 2},rank=3,times=99"
    code, wall_s = launch(run_dir, 4, [*flags, fault], args)
    faults = incidents(run_dir)
    membership = next((i["membership"] for i in faults if "membership" in i), {})
    first_step = membership.get("first_step_unix_s")
    excluded = membership.get("excluded_unix_s")
    return {
        "exit code": code,
        "faults": len(faults),
        "first fault to first step on the new mesh (s)": membership.get(
            "first_fault_to_new_mesh_s"
        ),
        "exclusion to first step on the new mesh (s)": (
            round(first_step - excluded, 3) if first_step and excluded else None
        ),
        "steps lost": sum(i.get("steps_lost") or 0 for i in faults),
        "wall time (s)": round(wall_s, 1),
        "effective training time ratio": json.loads(RunDir(run_dir).goodput.read_text())[
            "effective_training_time_ratio"
        ],
    }


def bad_slot(steps: int, base: Path) -> None:
    base.mkdir(parents=True, exist_ok=True)
    results = {}
    for how in ("spare", "shrink", "restart"):
        print(f"running the crash-looping slot job: {how} ...", flush=True)
        results[how] = run_bad_slot_job(base / f"bad-slot-{how}", steps, how)
    print()
    print(
        f"bad slot: tiny model, 4 processes x 2 CPU devices (data 2 x fsdp 2 x tensor 2), "
        f"{steps} steps, checkpoint every {steps // 4}, slot 3 crashes at step {steps // 4 + 2} "
        "of every start, excluded after 2 faults in a row"
    )
    print("| measure | spare | shrink | restart (on_bad_node=restart) |")
    print("| --- | --- | --- | --- |")
    for measure in results["spare"]:
        cells = ["-" if results[h][measure] is None else str(results[h][measure]) for h in results]
        print(f"| {measure} | {' | '.join(cells)} |")
    print(f"run dirs in {base}")


LONG_DRILL_SAVE_EVERY = 50
LONG_DRILL_CHECK_EVERY = 25  # resilience.replica_check_every
LONG_DRILL_STEPS = 1_000_000  # more than any window holds: the window ends the job


def long_drill_faults(save_every: int = LONG_DRILL_SAVE_EVERY) -> str:
    """A bit flip on rank 1; slot 3 crashing at every start from the step after a save on; a
    bit flip on rank 0 (under exclude, on the shrunk mesh)."""
    return ";".join(
        (
            f"bitflip@step={save_every + save_every // 2},rank=1",
            f"crash@step={2 * save_every + 2},rank=3,times=99",
            f"bitflip@step={6 * save_every + save_every // 2},rank=0",
        )
    )


def run_long_drill_job(run_dir: Path, window_s: float, on_bad_node: str) -> dict[str, Any]:
    """One 4-process job through the long drill's faults for window_s (or until it stops)."""
    overrides = [
        "mesh.data=4",
        "mesh.fsdp=2",
        "mesh.tensor=1",
        f"resilience.replica_check_every={LONG_DRILL_CHECK_EVERY}",
        "resilience.on_corruption=rerun",
        f"resilience.on_bad_node={on_bad_node}",
        "resilience.readmit_after_s=0",  # the slot stays out for the drill
        f"resilience.compile_cache_dir={run_dir.parent / f'{run_dir.name}-cache'}",
    ]
    job = tiny_job_args(run_dir, LONG_DRILL_STEPS, LONG_DRILL_SAVE_EVERY, False)
    flags = [f"--fault={long_drill_faults()}"]
    code, wall_s = launch(run_dir, 4, flags, [*job, *overrides], window_s=window_s)
    goodput = json.loads(RunDir(run_dir).goodput.read_text())
    faults = incidents(run_dir)
    membership = next((i["membership"] for i in faults if "membership" in i), {})
    mismatches = RunDir(run_dir).replica_mismatches
    lines = mismatches.read_text().splitlines() if mismatches.exists() else []
    events = [json.loads(line)["event"] for line in lines]
    kept_s = goodput["effective_training_time_ratio"] * goodput["wall_s"]
    return {
        "exit code": code,
        "wall time (s)": round(wall_s, 1),
        "steps kept": goodput["steps"],
        "incidents": len(faults),
        "causes": " ".join(i["cause"] for i in faults) or "-",
        "replica checks: mismatch / transient": (
            f"{events.count('mismatch')} / {events.count('transient')}"
        ),
        "first fault to first step on the new mesh (s)": membership.get(
            "first_fault_to_new_mesh_s"
        ),
        "steps lost": sum(i.get("steps_lost") or 0 for i in faults),
        "kept step time (s)": round(kept_s, 1),
        "effective training time over the drill": round(kept_s / max(wall_s, window_s), 4),
    }


def long_drill(minutes: float, base: Path) -> None:
    base.mkdir(parents=True, exist_ok=True)
    window_s = minutes * 60
    print(
        f"long drill: tiny model, 4 processes x 2 CPU devices (data 4 x fsdp 2), a window of "
        f"{minutes:g} min, a checkpoint every {LONG_DRILL_SAVE_EVERY} steps, replica check "
        f"every {LONG_DRILL_CHECK_EVERY}; faults: {long_drill_faults()}",
        flush=True,
    )
    results = {}
    for how in ("exclude", "restart"):
        print(f"running the long drill under resilience.on_bad_node={how} ...", flush=True)
        results[how] = run_long_drill_job(base / f"long-drill-{how}", window_s, how)
    print()
    print("| measure | exclude (default) | restart (on_bad_node=restart) |")
    print("| --- | --- | --- |")
    for measure in results["exclude"]:
        cells = ["-" if results[h][measure] is None else str(results[h][measure]) for h in results]
        print(f"| {measure} | {' | '.join(cells)} |")
    key = "effective training time over the drill"
    exclude, restart = results["exclude"][key], results["restart"][key]
    ratio = f"{exclude / restart:.2f}x" if restart else "- (restart kept no step)"
    print(f"effective training time, exclude / restart: {ratio}")
    print(f"run dirs in {base}")


if __name__ == "__main__":
    main()
