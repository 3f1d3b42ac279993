"""The launcher's command line read once: the options of `python -m msjax.launch`, the node layout
under Slurm, and the job's config (`job_config`, shared with `python -m msjax.doctor`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from msjax.cli import ArgumentParser, split_at_double_dash
from msjax.config import Config, load_config
from msjax.distributed import parse_host_port, parse_port
from msjax.errors import MsjaxError
from msjax.resilience.faults import parse_faults
from msjax.resolve import RUNS_FOLDER, resolve_run_dir

DEFAULT_PORT = 29500
COORDINATOR_PORT = "MSJAX_COORDINATOR_PORT"  # --cluster slurm: the first node's port


def parse_args(argv: Sequence[str]) -> tuple[object, list[str]]:
    argv, train_args = split_at_double_dash(argv)
    parser = ArgumentParser(
        prog="python -m msjax.launch",
        description="Run msjax.train as a multi-process job under a supervisor that restarts it "
        "from the last checkpoint after a crash, a hang or a non-finite loss.",
        epilog="example: python -m msjax.launch --nprocs 2 --devices-per-proc 4 -- "
        "--config configs/tiny.yaml run.dir=runs/tiny",
    )
    parser.add_argument("--nprocs", type=int, default=1, help="worker processes on this node")
    parser.add_argument(
        "--devices-per-proc",
        type=int,
        help="devices per worker: on a GPU node the GPUs its slot owns (slot i: GPUs "
        "[i*D, (i+1)*D) of CUDA_VISIBLE_DEVICES, or of the machine), on CPU simulated devices "
        "(JAX_NUM_CPU_DEVICES); default: the mesh's devices / processes, else on GPUs the "
        "node's GPUs shared out",
    )
    parser.add_argument("--max-restarts", type=int, help="sets resilience.max_restarts")
    parser.add_argument(
        "--fault", help="inject faults (MSJAX_FAULT syntax), e.g. crash@step=7,rank=1"
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=0,
        help="extra worker processes on this node that wait, imports done, to take the rank of "
        "an excluded slot (resilience.on_bad_node=exclude)",
    )
    parser.add_argument("--cluster", choices=("slurm",), help="read the node layout from Slurm")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes, each with a launcher")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index")
    parser.add_argument(
        "--coordinator",
        help="host:port of process 0 (several nodes; default 127.0.0.1:free, under --cluster "
        "slurm the first node of SLURM_JOB_NODELIST)",
    )
    args = parser.parse_args(argv)
    return args, train_args


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: `gpu[003-005,9],cpu1` -> `gpu003`."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise MsjaxError(f"SLURM_JOB_NODELIST={nodelist!r} is not a node list")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def slurm_layout(environ: Mapping[str, str]) -> tuple[int, int, str]:
    """(nnodes, node rank, coordinator host:port) from a Slurm job step's environment."""
    try:
        nnodes = int(environ["SLURM_NNODES"])
        node_rank = int(environ["SLURM_NODEID"])
        host = first_slurm_host(environ["SLURM_JOB_NODELIST"])
    except KeyError as missing:
        raise MsjaxError(f"--cluster slurm: {missing} is not set (run under srun)") from None
    port = parse_port(environ.get(COORDINATOR_PORT, str(DEFAULT_PORT)), COORDINATOR_PORT)
    return nnodes, node_rank, f"{host}:{port}"


def job_config(
    train_args: list[str],
    max_restarts: int | None,
    nnodes: int = 1,
    environ: Mapping[str, str] = os.environ,
) -> Config:
    """The trainer's arguments read once: the config every worker runs, run.dir chosen. On
    several nodes every launcher must choose the same run.dir: given, or named by the Slurm
    job (runs/<name>-slurm<SLURM_JOB_ID>, the same on every node and on a requeue), never by
    each node's clock."""
    from msjax.train import parse_args as parse_train_args

    train = parse_train_args(train_args)
    if train.print_config:
        raise MsjaxError("--print-config: run python -m msjax.train --print-config instead")
    overrides = list(train.overrides)
    if max_restarts is not None:
        overrides.append(f"resilience.max_restarts={max_restarts}")
    config = load_config(train.config, overrides)
    if nnodes > 1 and not config.run.dir:
        job_id = environ.get("SLURM_JOB_ID", "")
        if not job_id.isdigit():
            raise MsjaxError(
                f"--nnodes={nnodes} needs run.dir=PATH, the same on every node (or SLURM_JOB_ID "
                "to name it): each node's clock would name another run dir"
            )
        run_dir = RUNS_FOLDER / f"{config.run.name}-slurm{job_id}"
        run = dataclasses.replace(config.run, dir=str(run_dir))
        config = dataclasses.replace(config, run=run)
    return resolve_run_dir(config)


@dataclass(frozen=True)
class LaunchOptions:
    """`python -m msjax.launch`'s command line, read and checked once; the node layout filled in
    from Slurm under --cluster slurm."""

    nprocs: int
    devices_per_proc: int | None  # as given; None: from the mesh (devices.default_devices_per_proc)
    max_restarts: int | None
    fault: str | None
    spares: int
    nnodes: int
    node_rank: int
    coordinator: str | None
    train_args: list[str]


def parse_options(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> LaunchOptions:
    """The launcher's options, or an MsjaxError naming the first bad one."""
    args, train_args = parse_args(argv)
    nnodes, node_rank, coordinator = args.nnodes, args.node_rank, args.coordinator
    if args.cluster == "slurm":
        nnodes, node_rank, slurm_coordinator = slurm_layout(environ)
        coordinator = args.coordinator or slurm_coordinator
    if args.nprocs < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise MsjaxError(
            f"--nprocs={args.nprocs}, --nnodes={nnodes}, --node-rank={node_rank}: need "
            "nprocs >= 1 and 0 <= node-rank < nnodes"
        )
    if args.spares < 0 or (args.spares and nnodes > 1):
        raise MsjaxError(
            f"--spares={args.spares}: give a count >= 0, on one node (--nnodes 1); several "
            "nodes are replaced by their scheduler"
        )
    if nnodes > 1 and not coordinator:
        raise MsjaxError("--nnodes > 1 needs --coordinator HOST:PORT (or --cluster slurm)")
    if coordinator:
        parse_host_port(coordinator, "--coordinator")
    if args.fault:
        parse_faults(args.fault)
    return LaunchOptions(
        nprocs=args.nprocs,
        devices_per_proc=args.devices_per_proc,
        max_restarts=args.max_restarts,
        fault=args.fault,
        spares=args.spares,
        nnodes=nnodes,
        node_rank=node_rank,
        coordinator=coordinator,
        train_args=train_args,
    )
