"""FLOP counts and MFU: MegaScale's Table 2 from configs/megascale_175b.yaml, and the CLI."""

from __future__ import annotations

import subprocess
import sys

from harness import REPO, job_env


def test_cli_never_loads_jax():
    script = (
        "import sys; from msjax.flops import main; "
        "assert main(['--step-time', '1', '--devices', '8', '--peak-tflops', '100']) == 0; "
        "assert 'jax' not in sys.modules"
    )
    env = job_env()
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
