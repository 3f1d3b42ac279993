"""A step does not fault XLA's temp buffer back in: msjax preloads jemalloc keeping what is freed
where it is installed (Debian's libjemalloc2), and glibc re-faults it on huge pages elsewhere,
in `python -m msjax.train` (a re-exec at start) and in msjax.launch's workers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from msjax.allocator import (
    ALLOCATOR_VAR,
    JEMALLOC_CONF,
    JEMALLOC_CONF_VAR,
    PRELOAD_VAR,
    REEXEC_MARKER_VAR,
    TUNABLES_VAR,
    jemalloc_library,
    on_glibc,
)
from msjax.config import load_config
from msjax.planner.aot import compile_step
from msjax.planner.candidates import MeshShape
from tests.jobs.harness import job_env, read_jsonl, run_to_end, train_command

PAGE_BYTES = 4096
HUGE_PAGE_BYTES = 2 << 20
# a tiny model whose step still has a temp buffer of tens of MiB (activations of 4 x 256 tokens)
RUN = [
    "train.steps=6",
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
needs_jemalloc = pytest.mark.skipif(
    jemalloc_library() is None, reason="needs jemalloc (Debian: apt-get install libjemalloc2)"
)


def run_train(run_dir: Path, choice: str) -> list[dict]:
    """`python -m msjax.train` on one CPU device, as a user starts it; its step records."""
    env = {
        "JAX_NUM_CPU_DEVICES": "1",
        TUNABLES_VAR: "",
        PRELOAD_VAR: "",
        JEMALLOC_CONF_VAR: "",
        REEXEC_MARKER_VAR: "",
        ALLOCATOR_VAR: choice,
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
        "temp_huge_pages": temp_bytes / HUGE_PAGE_BYTES,
        **{choice: (root / choice, run_train(root / choice, choice)) for choice in ALL_CHOICES},
    }


ALL_CHOICES = ("auto", "glibc", "off")


def steady_faults(records: list[dict]) -> list[int]:
    """Minor faults of the steps after the first (which includes compiling)."""
    return [record["minor_faults"] for record in records[1:]]


def test_without_msjax_s_settings_every_step_faults_its_whole_temp_buffer(runs):
    faults = steady_faults(runs["off"][1])
    assert runs["temp_pages"] > 5000  # the yardstick is big enough to tell them apart
    assert min(faults) > 0.5 * runs["temp_pages"], (faults, runs["temp_pages"])


def test_with_glibc_s_huge_pages_a_step_faults_a_small_share_of_its_temp_pages(runs):
    faults = steady_faults(runs["glibc"][1])
    assert max(faults) < 0.1 * runs["temp_pages"], (faults, runs["temp_pages"])


@needs_jemalloc
def test_with_jemalloc_a_step_gets_a_temp_buffer_already_faulted_in(runs):
    """Mapped afresh, the buffer takes at least one fault per huge page every step."""
    faults = steady_faults(runs["auto"][1])
    typical = sorted(faults)[len(faults) // 2]  # the heap grows in a step or two, then holds
    assert typical < 0.5 * runs["temp_huge_pages"], (faults, runs["temp_huge_pages"])


def test_the_run_dir_records_the_allocator(runs):
    def record(choice: str) -> dict:
        return json.loads((runs[choice][0] / "xla_flags.json").read_text())["allocator"]

    assert record("glibc") == {
        "malloc": "glibc",
        "choice": "glibc",
        TUNABLES_VAR: "glibc.malloc.hugetlb=1",
        "malloc_hugetlb": True,
        JEMALLOC_CONF_VAR: "",
    }
    off = record("off")
    assert off["malloc"] == "glibc" and off["choice"] == "off" and off["malloc_hugetlb"] is False
    auto = record("auto")
    if jemalloc_library() is not None:
        assert auto["malloc"] == "jemalloc" and auto[JEMALLOC_CONF_VAR] == JEMALLOC_CONF
    else:
        assert auto["malloc"] == "glibc" and auto["malloc_hugetlb"] is True


def test_msjax_launch_starts_its_workers_with_the_settings(tmp_path):
    from msjax.launch.workers import WorkerProcess

    show = "import os; print('env:', os.environ['GLIBC_TUNABLES'], os.environ.get('LD_PRELOAD'))"
    env = job_env(**{TUNABLES_VAR: "glibc.malloc.arena_max=2", ALLOCATOR_VAR: "auto"})
    env.pop(PRELOAD_VAR, None)
    worker = WorkerProcess(0, [sys.executable, "-c", show], env, tmp_path / "0.log", 1, None)
    assert worker.wait(timeout_s=60) and worker.exit_code == 0
    worker.close()
    wanted = f"env: glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1 {jemalloc_library()}"
    assert wanted in (tmp_path / "0.log").read_text()
