"""`python -m msjax.doctor --nprocs P --devices-per-proc D -- [train args]`: the job's self-checks.

Starts P `python -m msjax.resilience.self_checks` processes of one jax.distributed job, waits for
them within a deadline, judges their figures together (msjax.resilience.health) and writes the
verdict to RUN_DIR/health/N.json. Exit 0 if every rank passes, 10 (SELF_CHECK_FAILED) otherwise.
The rounds themselves live in msjax.launch.self_check_rounds; this module is the command.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from msjax.cli import ArgumentParser, split_at_double_dash, user_error
from msjax.errors import MsjaxError
from msjax.launch.devices import default_devices_per_proc, devices_per_slot, node_gpus
from msjax.launch.incidents import Incident, IncidentLog
from msjax.launch.job_options import job_config
from msjax.launch.self_check_rounds import (
    HealthRound,
    detail,
    report_lines,
    run_self_checks,
)
from msjax.launch.workers import free_port
from msjax.resilience import exit_codes
from msjax.resilience.fault_kinds import SELF_CHECK_FAILED
from msjax.resilience.faults import parse_faults
from msjax.resolve import check_device_count, fixed_mesh_device_count
from msjax.run_dir import RunDir


def _record_incident(run_dir: RunDir, health: HealthRound) -> None:
    """A failed round of the doctor's own as an incident in RUN_DIR/incidents.jsonl."""
    log = IncidentLog(run_dir, say=lambda text: None)
    now = time.time()
    log.open(
        Incident(
            incident=log.next_number(),
            cause=SELF_CHECK_FAILED.cause,
            rank=health.failed_ranks[0],
            detail=detail(health),
            attempt=0,
            phase="self_check",
            step=0,
            fault_unix_s=now - health.wall_s,
            fault_time_from="the self-checks' start",
            detected_unix_s=now,
            detection_latency_s=round(health.wall_s, 3),
            stop_s=0.0,
            diagnostics=str(health.path.relative_to(run_dir.path)),
            flight_recorder=None,
            action="stop",
            stop_reason="msjax.doctor: a self-check failed",
        )
    )
    log.write()


def parse_args(argv: Sequence[str]) -> tuple[Any, list[str]]:
    argv, train_args = split_at_double_dash(argv)
    parser = ArgumentParser(
        prog="python -m msjax.doctor",
        description="Self-check the job's processes and devices: a known-answer compute test "
        "and its speed, host memory, disk, and an all-reduce over each mesh axis. Names the "
        "ranks that fail. Exit 0: all pass; 10: a rank failed a check.",
        epilog="example: python -m msjax.doctor --nprocs 2 --devices-per-proc 2 -- "
        "--config configs/tiny.yaml mesh.tensor=1 run.dir=runs/doctor",
    )
    parser.add_argument("--nprocs", type=int, default=1, help="processes on this node")
    parser.add_argument(
        "--devices-per-proc",
        type=int,
        help="devices per process: the GPUs its slot owns on a GPU node (as msjax.launch), "
        "else CPU devices (JAX_NUM_CPU_DEVICES)",
    )
    parser.add_argument(
        "--fault", help="inject faults (MSJAX_FAULT syntax): corrupt_compute@rank=1"
    )
    return parser.parse_args(argv), train_args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, train_args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.nprocs < 1:
            raise MsjaxError(f"--nprocs={args.nprocs} must be at least 1")
        if args.fault:
            parse_faults(args.fault)
        config = job_config(train_args, None)
        devices = args.devices_per_proc
        if devices is None:
            devices = default_devices_per_proc(fixed_mesh_device_count(config.mesh), args.nprocs)
        elif devices < 1:
            raise MsjaxError(f"--devices-per-proc={devices} must be at least 1")
        devices = devices_per_slot(args.nprocs, devices, node_gpus())
        if devices is not None:
            config = check_device_count(config, devices * args.nprocs)
        run_dir = RunDir(Path(config.run.dir))
        run_dir.path.mkdir(parents=True, exist_ok=True)
    except MsjaxError as error:
        return user_error("msjax.doctor", error)
    coordinator = f"127.0.0.1:{free_port()}"
    health = run_self_checks(
        config, range(args.nprocs), args.nprocs, devices, coordinator, faults=args.fault
    )
    if not health.passed:
        _record_incident(run_dir, health)
    for line in report_lines(health):
        print(f"msjax.doctor: {line}", flush=True)
    return exit_codes.OK if health.passed else SELF_CHECK_FAILED.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
