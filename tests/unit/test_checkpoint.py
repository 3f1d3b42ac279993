"""Checkpoints: exact resume, resume on another mesh, fallback past damaged ones, inspection."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msjax.checkpoint.__main__ import main as checkpoint_cli
from msjax.checkpoint.fingerprint import fingerprints
from msjax.checkpoint.manager import Checkpointer, committed_steps
from msjax.config import CheckpointConfig, load_config
from msjax.errors import MsjaxError
from msjax.observe.metrics import read_metrics
from msjax.train import train

STEPS = 8


RUN = [
    f"train.steps={STEPS}",
    "train.global_batch=16",
    "train.eval_every=0",
    "train.peak_tflops=0.5",
    "data.max_corpus_mib=2",
    "data.seq_len=64",
    "model.num_layers=2",
    "optim.warmup_steps=2",
    "checkpoint.every_steps=4",
]


def run(run_dir: Path, *overrides: str) -> str:
    """Train in-process; returns what the run printed."""
    printed = io.StringIO()
    train(load_config(None, [*RUN, f"run.dir={run_dir}", *overrides]), progress_stream=printed)
    return printed.getvalue()


def step_losses(run_dir: Path) -> dict[int, float]:
    """The loss of each step, the latest record winning (a resumed run appends)."""
    return {
        record["step"]: record["loss"]
        for record in read_metrics(run_dir / "metrics.jsonl")
        if "loss" in record
    }


def saved_fingerprints(run_dir: Path, step: int) -> dict[str, int]:
    config = load_config(None, RUN)
    checkpointer = Checkpointer(run_dir / "checkpoints", config.checkpoint, read_only=True)
    try:
        return checkpointer.metadata(step)["fingerprints"]
    finally:
        checkpointer.close()


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    run(run_dir)
    return run_dir


def largest_array_file(step_dir: Path) -> Path:
    files = [path for path in (step_dir / "state").rglob("*") if path.is_file()]
    return max(files, key=lambda path: path.stat().st_size)


def test_a_run_saves_every_n_steps_and_at_the_end(straight_run: Path):
    assert committed_steps(straight_run / "checkpoints") == [4, 8]
    assert sorted(step_losses(straight_run)) == list(range(STEPS))


def test_resume_from_a_checkpoint_repeats_the_uninterrupted_run_bit_for_bit(
    straight_run: Path, tmp_path: Path
):
    printed = run(tmp_path / "resumed", f"checkpoint.resume_from={straight_run}/checkpoints/4")
    assert f"resumed from {straight_run}/checkpoints/4 (step 4)" in printed
    resumed = step_losses(tmp_path / "resumed")
    straight = step_losses(straight_run)
    assert sorted(resumed) == list(range(4, STEPS))
    assert all(resumed[step] == straight[step] for step in resumed)
    # the fingerprints cover parameters, optimizer state and step: equal means bitwise equal
    assert saved_fingerprints(tmp_path / "resumed", STEPS) == saved_fingerprints(
        straight_run, STEPS
    )


def test_resume_on_another_mesh_continues_the_same_loss_curve(straight_run: Path, tmp_path: Path):
    run(
        tmp_path / "resharded",
        f"checkpoint.resume_from={straight_run}/4",
        "mesh.data=1",
        "mesh.fsdp=1",
        "mesh.tensor=8",
    )
    resumed = step_losses(tmp_path / "resharded")
    straight = step_losses(straight_run)
    assert sorted(resumed) == list(range(4, STEPS))
    for step in resumed:
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6)


def test_rerunning_a_finished_run_does_nothing_and_keeps_its_checkpoints(
    straight_run: Path, tmp_path: Path
):
    copy = tmp_path / "copy"
    shutil.copytree(straight_run, copy)
    printed = run(copy)
    assert f"resumed from {copy}/checkpoints/8 (step 8)" in printed
    assert f"nothing to do: the run is already at step {STEPS}" in printed
    assert committed_steps(copy / "checkpoints") == [4, 8]


@pytest.mark.parametrize("damage", ["truncate", "garble"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(
    straight_run: Path, tmp_path: Path, damage: str
):
    copy = tmp_path / "copy"
    shutil.copytree(straight_run, copy)
    target = largest_array_file(copy / "checkpoints" / "8")
    data = bytearray(target.read_bytes())
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    else:
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(byte ^ 0xFF for byte in data[middle : middle + 64])
        target.write_bytes(data)
    printed = run(copy)
    assert f"skipped checkpoint {copy}/checkpoints/8" in printed
    assert f"resumed from {copy}/checkpoints/4 (step 4)" in printed
    losses = step_losses(copy)
    straight = step_losses(straight_run)
    assert all(losses[step] == straight[step] for step in range(STEPS))


def test_fingerprints_fetched_in_the_background_are_of_the_state_as_saved(tmp_path: Path):
    values = np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32)
    state = {"weights": jnp.asarray(values), "step": jnp.int32(3)}
    expected = fingerprints(state)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    checkpointer = Checkpointer(tmp_path, CheckpointConfig())
    checkpointer.save(3, state, {})
    # like the next train step: overwrite the saved arrays in place before the save finishes
    bump = jax.jit(lambda tree: jax.tree.map(lambda x: x + 1, tree), donate_argnums=0)
    bumped = bump(state)
    checkpointer.wait()
    assert checkpointer.metadata(3)["fingerprints"] == expected
    assert fingerprints(bumped) != expected
    restored = checkpointer.restore(3, abstract)
    np.testing.assert_array_equal(np.asarray(restored.state["weights"]), values)

    target = largest_array_file(tmp_path / "3")
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(byte ^ 0xFF for byte in data[middle : middle + 64])
    target.write_bytes(data)
    with pytest.raises(MsjaxError, match=f"checkpoint {tmp_path / '3'}"):
        checkpointer.restore(3, abstract)
    checkpointer.close()


def test_list_marks_damaged_checkpoints_and_inspect_shows_the_tree(
    straight_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    copy = tmp_path / "copy"
    shutil.copytree(straight_run, copy)
    target = largest_array_file(copy / "checkpoints" / "8")
    data = bytearray(target.read_bytes())
    data[100:164] = bytes(byte ^ 0xFF for byte in data[100:164])
    target.write_bytes(data)
    assert checkpoint_cli(["list", str(copy)]) == 0
    lines = capsys.readouterr().out.splitlines()
    status = {line.split()[0]: line for line in lines[1:]}
    assert "valid (arrays match their fingerprints)" in status["4"]
    assert "invalid" in status["8"]

    assert checkpoint_cli(["inspect", str(straight_run / "checkpoints" / "4")]) == 0
    out = capsys.readouterr().out
    assert "step 4; next data step 4 (64 samples seen)" in out
    assert "params/layers/mlp/gate" in out and "2x128x384" in out
    assert "num_layers: 2" in out


def test_a_run_dir_of_another_config_is_refused_unless_overwrite_keeps_it_aside(
    straight_run: Path, tmp_path: Path
):
    copy = tmp_path / "copy"
    shutil.copytree(straight_run, copy)
    before = sorted(path.relative_to(copy) for path in copy.rglob("*"))
    with pytest.raises(MsjaxError, match=r"model\.num_layers: 2 -> 1"):
        run(copy, "model.num_layers=1")
    assert sorted(path.relative_to(copy) for path in copy.rglob("*")) == before

    printed = run(copy, "model.num_layers=1", "run.overwrite=true", "train.steps=2")
    aside = [path for path in copy.iterdir() if path.name.startswith("previous-")]
    assert len(aside) == 1 and f"moved to {aside[0]}" in printed
    assert committed_steps(aside[0] / "checkpoints") == [4, 8]
    assert sorted(step_losses(copy)) == [0, 1]
