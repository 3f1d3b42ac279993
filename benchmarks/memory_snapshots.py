"""In-memory snapshots: the training loop's stall, and a restart's restore from memory vs disk.

checkpoint.memory_every_steps: what the snapshots cost the loop and how much faster a restart
restores from them than from disk.

    python benchmarks/memory_snapshots.py [--steps 20] [--global-batch 1] [--seq-len 256]
        [--every 1,4] [--stall-only] [--out DIR]
    python benchmarks/memory_snapshots.py --smoke   # the tiny model, a few steps, 1-process jobs

(1) Snapshot stall: `configs/small.yaml` (smaller batch and sequence) trained in this process on
    one CPU device with a snapshot every N steps (each N of --every) against none, disk
    checkpoints off in all; the mean and median step time of each (warm-up steps left out) and
    the ratio of the means (goal <= 1.02): the mean counts every step a snapshot slowed, where
    the median of a run snapshotting every 4th step would miss them. A snapshot's device copy
    and its time in the loop count in the next step's time; its write to /dev/shm runs beside
    the steps, on the same cores here. --stall-only stops after this part.
(2) Restore after a kill, on the same state: supervised `python -m msjax.launch` jobs of the tiny
    model (2 processes x 2 CPU devices, data 2 x fsdp 2) with one crash of rank 1 before the same
    step: (a) a snapshot every step -> each process restores its own; (b) the same with rank 1's
    node memory lost (the memory_loss fault) -> rank 1 restores its buddy's copy; (c) no
    snapshots -> every process restores the disk checkpoint, a few steps back. Per source: the
    restore's seconds (the slowest rank's, from the incident's restored_by_rank), its bytes (the
    largest rank's: a snapshot holds a process's own shards, a disk checkpoint is its whole
    directory), the steps lost, the detection latency and detection to first step (the incident's
    restart_s); for (a), where those seconds went (the incident's startup_s). The ratio:
    own-snapshot restore seconds / disk restore seconds (goal <= 0.10).
    Each job must have restored from the source it stands for, else the script exits 1.
(3) Steps lost per fault with snapshots and without, from the same jobs.

The smoke form runs (1) for a few steps of the tiny model and (2) with 1 process x 2 devices
(data 2): jobs (a) and (c) only, since one process has no buddy; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ["JAX_NUM_CPU_DEVICES"] = "1"  # this process's training; the jobs' workers set theirs
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.smoke import SMOKE_LABEL, TINY_CORPUS, TINY_MODEL, TINY_SEQ_LEN  # noqa: E402
from benchmarks.supervised_job import finished_job, tiny_job_args  # noqa: E402
from benchmarks.train_timing import quiet_run_records  # noqa: E402

WARMUP_STEPS = 2
SMOKE_STEPS = 6
# the restore jobs: a crash before CRASH_STEP, the newest disk checkpoint DISK_EVERY steps back
CRASH_STEP, DISK_EVERY, JOB_STEPS = 10, 7, 14
SMOKE_CRASH_STEP, SMOKE_DISK_EVERY, SMOKE_JOB_STEPS = 5, 3, 6
# each job's expected restore: resumed_from, and each rank's source
EXPECTED = {
    "own snapshot": ("memory", {"0": "own", "1": "own"}),
    "buddy's copy": ("memory", {"0": "own", "1": "buddy"}),
    "disk": ("disk", {"0": "disk", "1": "disk"}),
}


def snapshot_step_times(overrides: list[str]) -> dict[str, float]:
    """Median step time (warm-up left out) of an in-process run; its snapshots taken and skipped
    (one due while the last is still being written is skipped), their bytes and the loop's mean
    stall for one."""
    records = quiet_run_records(REPO / "configs" / "small.yaml", overrides)
    steps = [r for r in records if "loss" in r][WARMUP_STEPS:]
    # a snapshot record's step counts updates: the one after loss step s is s + 1
    snapshots = [r for r in records if "memory_snapshot_bytes" in r]
    taken = [r for r in snapshots if r["memory_snapshot_bytes"] > 0]
    measured = [r for r in taken if r["step"] > steps[0]["step"]]
    return {
        "median_step_s": statistics.median(r["step_time_s"] for r in steps),
        "mean_step_s": statistics.fmean(r["step_time_s"] for r in steps),
        "taken": len(taken),
        "skipped": snapshots[-1]["memory_snapshots_skipped"] if snapshots else 0,
        "bytes": max((r["memory_snapshot_bytes"] for r in taken), default=0),
        # the loop's own part: dispatching the device copy (None: none in the measured steps)
        "stall_s": statistics.fmean(r["memory_snapshot_stall_s"] for r in measured)
        if measured
        else None,
    }


def cadence(every: int) -> str:
    return "every step" if every == 1 else f"every {every} steps"


def measure_stall(args: argparse.Namespace) -> None:
    """Part (1): step times with a snapshot every N steps (each N of args.every) against none."""
    base = [
        f"train.steps={args.steps}",
        f"train.global_batch={args.global_batch}",
        f"data.seq_len={args.seq_len}",
        "train.eval_every=0",
        "mesh.data=-1",
        "checkpoint.enabled=false",
        *(TINY_MODEL + TINY_CORPUS if args.smoke else []),
    ]
    print(
        f"(1) snapshot stall: configs/small.yaml{SMOKE_LABEL if args.smoke else ''} on 1 CPU "
        f"device, batch {args.global_batch} x seq {args.seq_len}, {args.steps} steps "
        f"({WARMUP_STEPS} left out), disk checkpoints off",
        flush=True,
    )
    without = snapshot_step_times([*base, "checkpoint.memory_every_steps=0"])
    runs = {every: snapshot_step_times([*base, f"checkpoint.memory_every_steps={every}"])
            for every in args.every}  # fmt: skip
    print()
    print("| run | mean step time | median step time | snapshots taken | skipped (the last "
          "still writing) | mean / none |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    print(
        f"| no snapshots (memory_every_steps=0) | {1e3 * without['mean_step_s']:.2f} ms "
        f"| {1e3 * without['median_step_s']:.2f} ms | 0 | 0 | 1.000 |"
    )
    for every, run in runs.items():
        if run["taken"] == 0:
            raise SystemExit(f"memory_every_steps={every} took no snapshot")
        print(
            f"| a snapshot {cadence(every)} (memory_every_steps={every}) "
            f"| {1e3 * run['mean_step_s']:.2f} ms | {1e3 * run['median_step_s']:.2f} ms "
            f"| {run['taken']} | {run['skipped']} "
            f"| {run['mean_step_s'] / without['mean_step_s']:.3f} |"
        )
    for every, run in runs.items():
        print(
            f"snapshot {cadence(every)} / none, mean step time: "
            f"{run['mean_step_s'] / without['mean_step_s']:.3f} (goal <= 1.02)"
        )
    first = runs[args.every[0]]
    stall = "-" if first["stall_s"] is None else f"{1e3 * first['stall_s']:.2f} ms"
    print(
        f"per-snapshot bytes: {first['bytes']:,} (this process's shards); the loop's own part "
        f"of one (the device copy dispatched), measured steps: {stall}"
    )
    print()


def restore_job(
    run_dir: Path, cache_dir: Path, args: argparse.Namespace, fault: str, memory_every: int
) -> dict[str, Any]:
    """One supervised job with `fault` injected: its single incident."""
    crash_step, disk_every, steps = (
        (SMOKE_CRASH_STEP, SMOKE_DISK_EVERY, SMOKE_JOB_STEPS)
        if args.smoke
        else (CRASH_STEP, DISK_EVERY, JOB_STEPS)
    )
    rank = 0 if args.smoke else 1
    job = [
        *tiny_job_args(run_dir, steps, disk_every, args.smoke),
        *(["mesh.fsdp=1"] if args.smoke else []),  # 1 process x 2 devices: data 2
        f"checkpoint.memory_every_steps={memory_every}",
        "resilience.heartbeat_every_s=0.05",
        "resilience.restart_backoff_s=0.1",
        "resilience.stop_grace_s=2",
        f"resilience.compile_cache_dir={cache_dir}",
    ]
    flags = [f"--fault={fault}@step={crash_step},rank={rank}"]
    done = finished_job(run_dir, flags, job, nprocs=1 if args.smoke else 2)
    if len(done["incidents"]) != 1:
        raise SystemExit(f"the job in {run_dir} had {len(done['incidents'])} incidents, not 1")
    return done["incidents"][0]


def check_source(name: str, incident: dict[str, Any], nprocs: int) -> None:
    """Exit with one line unless the job restored from the source `name` stands for."""
    resumed_from, sources = EXPECTED[name]
    expected = {rank: source for rank, source in sources.items() if int(rank) < nprocs}
    actual = {rank: r["source"] for rank, r in (incident.get("restored_by_rank") or {}).items()}
    if incident.get("resumed_from") != resumed_from or actual != expected:
        raise SystemExit(
            f"the {name} job resumed from {incident.get('resumed_from')} with sources {actual}, "
            f"not {resumed_from} with {expected}"
        )


def print_restart_split(incident: dict[str, Any]) -> None:
    """Where the own-snapshot restart's seconds went: detection to the spawn, then each start-up
    mark as the last rank reached it (the incident's startup_s), up to the first step."""
    spawn_s = incident["restart_s"] - incident["restart_to_first_step_s"]
    print("split of the own-snapshot restart (the last rank at each mark):")
    print("| from | to | seconds |")
    print("| --- | --- | --- |")
    print(f"| detection | spawn (stop, backoff {incident.get('backoff_s')} s) | {spawn_s:.2f} |")
    previous, previous_s = "spawn", 0.0
    for mark, after_spawn_s in (incident.get("startup_s") or {}).items():
        print(f"| {previous} | {mark} | {after_spawn_s - previous_s:.2f} |")
        previous, previous_s = mark, after_spawn_s
    print()


def measure_restores(args: argparse.Namespace) -> None:
    """Parts (2) and (3): the same crash restored from each source."""
    nprocs = 1 if args.smoke else 2
    crash_step, disk_every = (
        (SMOKE_CRASH_STEP, SMOKE_DISK_EVERY) if args.smoke else (CRASH_STEP, DISK_EVERY)
    )
    layout = "1 process x 2 CPU devices (data 2)" if args.smoke else "2 processes x 2 CPU devices"
    print(
        f"(2) restore after a kill{' (smoke)' if args.smoke else ''}: tiny model, {layout}, "
        f"a crash before step {crash_step}, a disk checkpoint every {disk_every} steps",
        flush=True,
    )
    base = args.out or Path(tempfile.mkdtemp(prefix="msjax-memory-"))
    base.mkdir(parents=True, exist_ok=True)
    cache_dir = base / "compile-cache"
    jobs = [("own snapshot", "crash", 1)]
    if not args.smoke:  # one process has no buddy
        jobs.append(("buddy's copy", "memory_loss", 1))
    jobs.append(("disk", "crash", 0))
    found = {}
    for name, fault, memory_every in jobs:
        print(f"running the job restoring from {name} ...", flush=True)
        run_dir = base / name.split()[0].replace("'s", "")
        found[name] = restore_job(run_dir, cache_dir, args, fault, memory_every)
        check_source(name, found[name], nprocs)
    print()
    print(
        "| restored from | fault | restore (slowest rank) | bytes (largest rank) | steps lost | "
        "detection latency | detection to first step (restart_s) | spawn to first step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    seconds = {}
    for (name, fault, _), incident in zip(jobs, found.values(), strict=True):
        by_rank = incident["restored_by_rank"].values()
        seconds[name] = max(r["seconds"] for r in by_rank)
        print(
            f"| {name} | {fault} | {seconds[name]:.3f} s | {max(r['bytes'] for r in by_rank):,} "
            f"| {incident['steps_lost']} | {incident['detection_latency_s']:.2f} s "
            f"| {incident['restart_s']:.2f} s | {incident['restart_to_first_step_s']:.2f} s |"
        )
    print(
        f"memory / disk restore seconds (own snapshot): "
        f"{seconds['own snapshot'] / seconds['disk']:.3f} = {seconds['own snapshot']:.3f} / "
        f"{seconds['disk']:.3f} (goal <= 0.10)"
    )
    print()
    print_restart_split(found["own snapshot"])
    with_snapshots = [found[name]["steps_lost"] for name in found if name != "disk"]
    print(
        f"(3) steps lost per fault: with snapshots {statistics.fmean(with_snapshots):.1f}, "
        f"without {found['disk']['steps_lost']}"
    )
    if args.out is None:
        shutil.rmtree(base, ignore_errors=True)
    else:
        print(f"run dirs in {base}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps of each stall run")
    parser.add_argument("--global-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--out", type=Path, help="keep the jobs' run dirs here")
    parser.add_argument(
        "--every",
        type=lambda text: [int(part) for part in text.split(",")],
        default=[1],
        help="the snapshot cadences of part (1), comma-separated (default 1)",
    )
    parser.add_argument("--stall-only", action="store_true", help="part (1) alone")
    parser.add_argument("--smoke", action="store_true", help="tiny model, few steps, 1 process")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.seq_len = SMOKE_STEPS, TINY_SEQ_LEN
    measure_stall(args)
    if not args.stall_only:
        measure_restores(args)


if __name__ == "__main__":
    main()
