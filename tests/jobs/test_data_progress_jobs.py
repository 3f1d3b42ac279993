"""Every long step of reading a corpus reports progress: hashing text files, scanning token files,
tokenizing one large file piece by piece; a supervised start-up that reads a large corpus under a
short data deadline is therefore not a hang."""

from __future__ import annotations

import json

import pytest
from harness import launch_command, run_to_end
from small_runs import QUICK_RUN
from test_data_progress import MIB, text_corpus

from msjax.data.token_store import open_token_store
from msjax.run_dir import RunDir


@pytest.mark.slow
def test_a_large_corpus_under_a_short_data_deadline_is_not_killed_as_a_hang(tmp_path):
    """The data phase lasts several deadlines (hashing, reading and tokenizing 192 MiB of text);
    its progress reports come far more often than the 1 s deadline."""
    text_corpus(tmp_path / "corpus.txt", 192 * MIB)
    run_dir = tmp_path / "run"
    overrides = [
        *QUICK_RUN,
        "train.steps=2", "train.eval_every=0", "checkpoint.enabled=false",
        "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1",
        f"data.sources={tmp_path}/corpus.txt", "data.eval_fraction=0",
        f"data.cache_dir={tmp_path}/cache",
        "resilience.heartbeat_every_s=0.05", "resilience.data_deadline_s=1",
    ]  # fmt: skip
    flags = ["--max-restarts=0"]
    result = run_to_end(launch_command(run_dir, overrides, launch_flags=flags))
    incidents_log = RunDir(run_dir).incidents_log
    incidents = (
        [json.loads(line) for line in incidents_log.read_text().splitlines()]
        if incidents_log.exists()
        else []
    )
    assert incidents == [], result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, result.stderr[-3000:]
    store = open_token_store(next((tmp_path / "cache" / "tokens").glob("*/train.bin")))
    assert store is not None and store[0].num_tokens == 192 * MIB + 1  # the whole corpus
