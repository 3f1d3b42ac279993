"""Files someone hands msjax are not trusted: Hugging Face directories stay inside themselves and
are type-checked, the compile cache's key and folders must be this user's own, generation checks
its inputs, and a garbled checkpoint record or a bad export target is one line."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from harness import job_env, run_to_end, train_command
from test_handed_files import TINY, tiny_params, write_hf
from test_handed_files import saved_run as saved_run  # a fixture, re-exported for pytest

from msjax.resilience import exit_codes


def test_training_from_non_finite_weights_exits_2_at_once(tmp_path: Path) -> None:
    """A worker that finds NaN weights ends with one line and the user-error code, having saved
    nothing (not a crash to restart, nor a "skip this batch" at every restart)."""
    byte_vocab = dataclasses.replace(TINY, vocab_size=264)  # the byte tokenizer's
    params = tiny_params(byte_vocab)
    params["embedding"][7, 1] = np.nan
    model = write_hf(tmp_path / "model", params, byte_vocab)
    run_dir = tmp_path / "run"
    overrides = [
        f"model.init_from=hf:{model}",
        "model.from_hf=true",
        "mesh.data=1",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "data.seq_len=16",
        "data.max_corpus_mib=1",
        "train.global_batch=2",
        "train.steps=2",
        "train.eval_every=0",
        f"run.dir={run_dir}",
    ]
    result = run_to_end(train_command(None, overrides), JAX_NUM_CPU_DEVICES="1")
    assert result.returncode == exit_codes.USER_ERROR, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "model.embed_tokens.weight holds non-finite" in lines[0], lines
    assert not list((run_dir / "checkpoints").glob("[0-9]*"))


# One process for JAX's cache settings (they hold for the rest of a process).
CACHE_PROBE = """
import json, sys
from pathlib import Path
import jax
from msjax.config import ResilienceConfig
from msjax.resilience.compile_cache import enable_compile_cache
folder, run_dir = sys.argv[1], Path(sys.argv[2])
chosen = enable_compile_cache(ResilienceConfig(compile_cache_dir=folder or None), run_dir, True)
print(json.dumps([chosen and str(chosen), jax.config.jax_compilation_cache_dir]))
"""


def probe_cache(folder: str, run_dir: Path, user_cache: Path) -> tuple[list, str]:
    env = job_env(MSJAX_CACHE_DIR=str(user_cache))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # conftest.py's for the tests' jobs: JAX's default
    result = subprocess.run(
        [sys.executable, "-c", CACHE_PROBE, folder, str(run_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1]), result.stderr


def test_jax_native_cache_is_kept_out_of_the_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "compile_cache").mkdir(parents=True)
    (chosen, native), _ = probe_cache("", run_dir, tmp_path / "user_cache")
    assert chosen == str(run_dir / "compile_cache")  # signed entries: checked before loading
    assert Path(native) == (tmp_path / "user_cache" / "jax_compile_cache").absolute()
    assert (tmp_path / "user_cache" / "jax_compile_cache").stat().st_mode & 0o777 == 0o700


def test_a_cache_folder_others_can_write_turns_the_cache_off(tmp_path: Path) -> None:
    shared = tmp_path / "shared_cache"
    shared.mkdir()
    shared.chmod(0o777)
    (chosen, native), stderr = probe_cache(str(shared), tmp_path / "run", tmp_path / "user_cache")
    assert chosen is None and native is None
    lines = [line for line in stderr.splitlines() if line.startswith("msjax:")]
    assert lines == [
        f"msjax: compile cache off: {shared} is writable by others (mode 777); chmod go-w it to "
        "cache there"
    ]


def test_export_on_a_full_disk_is_one_line_and_leaves_nothing(
    saved_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "exports" / "model"
    # files past 16 KiB cannot be written, as on a full disk: EFBIG, SIGXFSZ ignored
    limited = 'trap "" XFSZ; ulimit -f 16; exec "$@"'
    result = subprocess.run(
        ["bash", "-c", limited, "bash", sys.executable, "-m", "msjax.hf", "export", saved_run, out],
        # without the tests' shared JAX compile cache, which JAX would warn it cannot write
        env={
            name: value
            for name, value in job_env(
                JAX_COMPILATION_CACHE_DIR="", PYTHONDONTWRITEBYTECODE="1"
            ).items()
            if not name.startswith("JAX_PERSISTENT_CACHE")
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == exit_codes.WRITE_FAILED == 74, result.stderr[-2000:]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"msjax.hf: error: writing {out} failed (")
    assert "File too large" in lines[0] and "nothing was left there" in lines[0]
    assert list((tmp_path / "exports").iterdir()) == [], "no half-written export, no staging"
    assert result.stdout == ""
