"""The start-up watch and failed saves, piece by piece: per-phase deadlines, heartbeat progress,
abandoned token-store writes, the save retry pause and the bound on unsaved time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from harness import job_env

from msjax.data.token_store import (
    TokenStoreWriter,
    open_token_store,
    remove_abandoned_writes,
)


def test_a_killed_writers_temporary_file_is_removed_and_a_live_ones_kept(tmp_path):
    code = (
        "import sys, numpy as np; from pathlib import Path;"
        "from msjax.data.token_store import TokenStoreWriter;"
        "w = TokenStoreWriter(Path(sys.argv[1]), 'uint16'); w.append(np.arange(10));"
        "w._file.flush(); import os; os._exit(0)"  # dies before commit, like a killed worker
    )
    env = job_env()
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "train.bin")], check=True, env=env)
    (abandoned,) = tmp_path.iterdir()
    with TokenStoreWriter(tmp_path / "train.bin", "uint16") as live:
        live.append(np.arange(4))
        assert remove_abandoned_writes(tmp_path) == [abandoned]
        assert not abandoned.exists() and Path(live._file.name).exists()
        live.commit({})
    assert open_token_store(tmp_path / "train.bin")[0].num_tokens == 4
