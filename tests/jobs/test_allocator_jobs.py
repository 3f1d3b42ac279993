"""A step does not re-fault XLA's temp buffer page by page: msjax runs glibc with huge pages,
in `python -m msjax.train` (a re-exec at start) and in msjax.launch's workers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from msjax.allocator import OPT_OUT_VAR, REEXEC_MARKER_VAR, TUNABLES_VAR, on_glibc
from msjax.config import load_config
from msjax.planner.aot import compile_step
from msjax.planner.candidates import MeshShape
from tests.jobs.harness import job_env, read_jsonl, run_to_end, train_command

PAGE_BYTES = 4096
# a tiny model whose step still has a temp buffer of tens of MiB (activations of 4 x 256 tokens)
RUN = [
    "train.steps=3",
    "train.global_batch=4",
    "train.eval_every=0",
    "checkpoint.every_steps=0",
    "data.max_corpus_mib=2",
    "data.seq_len=256",
    "mesh.data=1",
    "mesh.fsdp=1",
    "mesh.tensor=1",
]
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

pytestmark = pytest.mark.skipif(
    not on_glibc() or not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
    reason="needs glibc and transparent huge pages (madvise or always)",
)


def run_train(run_dir: Path, opt_out: bool) -> list[dict]:
    """`python -m msjax.train` on one CPU device, as a user starts it; its step records."""
    env = {
        "JAX_NUM_CPU_DEVICES": "1",
        TUNABLES_VAR: "",
        REEXEC_MARKER_VAR: "",
        OPT_OUT_VAR: "0" if opt_out else "1",
    }
    completed = run_to_end(train_command(run_dir, RUN), cwd=run_dir.parent, **env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return [record for record in read_jsonl(run_dir / "metrics.jsonl") if "loss" in record]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("allocator")
    config = load_config(None, RUN)
    temp_bytes = compile_step(config, MeshShape(1, 1, 1)).memory.temp_bytes
    return {
        "temp_pages": temp_bytes / PAGE_BYTES,
        "huge": (root / "huge", run_train(root / "huge", opt_out=False)),
        "plain": (root / "plain", run_train(root / "plain", opt_out=True)),
    }


def steady_faults(records: list[dict]) -> list[int]:
    """Minor faults of the steps after the first (which includes compiling)."""
    return [record["minor_faults"] for record in records[1:]]


def test_without_huge_pages_every_step_faults_its_whole_temp_buffer(runs):
    faults = steady_faults(runs["plain"][1])
    assert runs["temp_pages"] > 5000  # the yardstick is big enough to tell the two apart
    assert min(faults) > 0.5 * runs["temp_pages"], (faults, runs["temp_pages"])


def test_with_huge_pages_a_step_faults_a_small_share_of_its_temp_pages(runs):
    faults = steady_faults(runs["huge"][1])
    assert max(faults) < 0.1 * runs["temp_pages"], (faults, runs["temp_pages"])


def test_the_run_dir_records_the_allocator_setting(runs):
    huge = json.loads((runs["huge"][0] / "xla_flags.json").read_text())["allocator"]
    plain = json.loads((runs["plain"][0] / "xla_flags.json").read_text())["allocator"]
    assert huge == {
        TUNABLES_VAR: "glibc.malloc.hugetlb=1",
        "malloc_hugetlb": True,
        "opted_out": False,
    }
    assert plain["malloc_hugetlb"] is False and plain["opted_out"] is True


def test_msjax_launch_starts_its_workers_with_huge_pages(tmp_path):
    from msjax.launch.workers import WorkerProcess

    show = "import os; print('tunables:', os.environ.get('GLIBC_TUNABLES'))"
    env = job_env(**{TUNABLES_VAR: "glibc.malloc.arena_max=2", OPT_OUT_VAR: "1"})
    worker = WorkerProcess(0, [sys.executable, "-c", show], env, tmp_path / "0.log", 1, None)
    assert worker.wait(timeout_s=60) and worker.exit_code == 0
    worker.close()
    assert (
        "tunables: glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
        in (tmp_path / "0.log").read_text()
    )
