"""Blame lands on one machine. A two-node job (two `msjax.launch --nnodes 2` on 127.0.0.1, as the
Slurm tasks of nodes node-a and node-b, each given two GPUs) whose rank 1, on node-b, gets a bit
of a parameter flipped at every replay: node-b's launcher alone marks its node bad (exit 9, its
last line naming it), node-a's stops for a restart of the whole job (exit 5) with its node
unmarked, and train.sbatch's decision requeues the job without node-b alone."""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import REPO, LaunchJob, free_port, kill_all
from slurm_step import SLURM_STEP_ENV
from test_corruption_guard import FLIP_STEP, JOB_TIMEOUT_S, train_args

from msjax.resilience import exit_codes
from msjax.run_dir import RunDir

SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
NODES = ("node-a", "node-b")
NODE_GPUS = ("4,5", "6,7")  # CUDA_VISIBLE_DEVICES as Slurm gives each node


@dataclass(frozen=True)
class TwoNodes:
    run_dir: Path
    codes: list[int]  # each node's msjax.launch exit code
    outputs: list[str]  # each node's launcher output


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:
    base = tmp_path_factory.mktemp("blame")
    run_dir, cache = base / "run", base / "compile_cache"
    coordinator = f"127.0.0.1:{free_port()}"
    secret = secrets.token_hex(32)  # one for the job, as train.sbatch exports it
    nodes: list[LaunchJob] = []
    try:
        for node_rank, (node, gpus) in enumerate(zip(NODES, NODE_GPUS, strict=True)):
            env = {
                **SLURM_STEP_ENV,
                "SLURM_NTASKS": "2",
                "SLURM_PROCID": str(node_rank),
                "SLURMD_NODENAME": node,
                "CUDA_VISIBLE_DEVICES": gpus,
                "MSJAX_JOB_SECRET": secret,
            }
            flags = [
                "--nnodes=2",
                f"--node-rank={node_rank}",
                f"--coordinator={coordinator}",
                f"--fault=bitflip@step={FLIP_STEP},rank=1,times=99",
            ]
            nodes.append(
                LaunchJob.start(
                    run_dir,
                    train_args(cache),
                    launch_flags=flags,
                    log_path=base / f"{node}.log",
                    env=env,
                )
            )
        ended = [node.finish(JOB_TIMEOUT_S) for node in nodes]
        yield TwoNodes(run_dir, [node.exit_code for node in ended], [n.output for n in ended])
    finally:
        kill_all(nodes)


def bad_nodes_of(srun_output: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """train.sbatch's own decision (its bad_nodes_of function) on a job step's output."""
    output = tmp_path / "srun.out"
    output.write_text(srun_output)
    program = (
        f'eval "$(sed -n "/^bad_nodes_of() {{/,/^}}/p" "{SBATCH}")"\n'
        f"BAD_NODE_EXIT_CODE={exit_codes.BAD_NODE}\n"
        f'bad_nodes_of "{output}"\n'
    )
    return subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_only_the_node_that_ran_the_corrupting_rank_is_marked_bad(two_nodes):
    node_a, node_b = two_nodes.outputs
    assert two_nodes.codes == [exit_codes.JOB_RESTART_NEEDED, exit_codes.BAD_NODE], node_b[-3000:]
    assert "node node-b is marked bad: silent corruption on rank 1" in node_b
    last_line = node_b.strip().splitlines()[-1]
    assert "requeue the job without node node-b;" in last_line
    assert "rank 1 runs on another node: node node-a is not blamed" in node_a
    assert "is marked bad" not in node_a
    run = RunDir(two_nodes.run_dir)
    marked = json.loads(run.bad_slots.read_text())["slots"]
    assert [(slot["slot"], slot["rank"]) for slot in marked] == [("node-b", 1)]
    faults = [json.loads(line) for line in run.slot_faults.read_text().splitlines()]
    assert ("node-b", 1, "silent_corruption") in [
        (f["slot"], f["rank"], f["cause"]) for f in faults
    ]
    assert "node-a" not in [f["slot"] for f in faults if f["cause"] == "silent_corruption"]


@pytest.mark.slow
def test_each_nodes_worker_saw_its_own_gpus_alone(two_nodes):
    logs = RunDir(two_nodes.run_dir)
    for rank, gpus in enumerate(NODE_GPUS):
        first = gpus.split(",")[0]  # one device per process: the node's first GPU
        line = f"msjax: process {rank}: devices CUDA_VISIBLE_DEVICES={first}, local devices 0"
        assert line in logs.log(rank).read_text()


@pytest.mark.slow
def test_train_sbatch_requeues_without_the_node_its_own_launcher_named_alone(two_nodes, tmp_path):
    srun_output = "".join(two_nodes.outputs) + "".join(
        f"msjax: node {rank} ({node}): msjax.launch exit code {code}\n"
        for rank, (node, code) in enumerate(zip(NODES, two_nodes.codes, strict=True))
    )
    decided = bad_nodes_of(srun_output, tmp_path)
    assert (decided.returncode, decided.stdout) == (0, "node-b\n"), decided.stderr
