"""Specifications of the data path: byte tokenizer, stdlib corpus, the global sample order of a
weighted mixture, batches placed on devices by any process count, and validation batches."""

import subprocess
import sys

import pytest
from harness import free_port, job_env
from test_data import (
    assert_batches_equal,
    batches_of,
    token_store,
)
from test_data import batch_sharding as batch_sharding  # fixtures, re-exported for pytest
from test_data import corpus as corpus
from test_data import store_dir as store_dir
from test_data import train_source as train_source

from msjax.data.pipeline import sharded_batches


@pytest.mark.slow
def test_grain_worker_processes_give_the_same_batches_as_none(train_source, batch_sharding):
    batches = batches_of(train_source, seed=9)
    start = 3
    with sharded_batches(batches, batch_sharding, start, prefetch=2, num_workers=2) as workers:
        from_workers = [next(workers)[0] for _ in range(21)]  # steps 3..23
    for offset, batch in enumerate(from_workers):
        assert_batches_equal(batch, batches.global_batch_at(start + offset))


TWO_PROCESS_WORKER = """
import sys
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from msjax.data.batches import GlobalBatches
from msjax.data.batches import PackedSource
from msjax.data.pipeline import local_row_blocks, sharded_batches
from msjax.data.token_store import TokenStore

port, process_id, tokens_path, count = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
source = PackedSource([TokenStore(tokens_path, "uint16", 0, count)], 32)
batches = GlobalBatches([source], [1.0], 16, 0, 256, False)
axis_types = (jax.sharding.AxisType.Auto,) * 3
mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=axis_types)
sharding = NamedSharding(mesh, P(("data", "fsdp"), None))
print("msjax rows", local_row_blocks(sharding, (16, 32)))
with sharded_batches(batches, sharding, start_step=2, prefetch=2) as iterator:
    for step in range(2, 23):
        batch, _ = next(iterator)
        for key, value in batch.items():
            gathered = multihost_utils.process_allgather(value, tiled=True)
            assert np.array_equal(gathered, batches.global_batch_at(step)[key]), (step, key)
print("msjax batches equal")
"""


@pytest.mark.slow
def test_two_processes_each_read_half_the_rows_and_build_the_same_global_batch(corpus, store_dir):
    port = free_port()
    store = token_store(corpus.train_tokens, store_dir, "two-process")
    env = job_env(JAX_NUM_CPU_DEVICES="4")
    arguments = [str(port), "PROCESS", str(store.path), str(store.num_tokens)]
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_PROCESS_WORKER]
            + [str(process_id) if a == "PROCESS" else a for a in arguments],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for process_id in (0, 1)
    ]
    outputs = [worker.communicate(timeout=180) for worker in workers]
    for worker, (_stdout, stderr) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, stderr[-2000:]
    ours = [
        [line for line in stdout.splitlines() if line.startswith("msjax")] for stdout, _ in outputs
    ]
    assert ours == [
        ["msjax rows [(0, 8)]", "msjax batches equal"],
        ["msjax rows [(8, 16)]", "msjax batches equal"],
    ]
