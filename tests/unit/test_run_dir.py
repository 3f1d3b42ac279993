"""A run directory is never mixed with what is not msjax's, and nothing of the user's is moved."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from small_runs import QUICK_RUN

from msjax.config import load_config
from msjax.launch.__main__ import main as launch_main
from msjax.run_dir import RunDir
from msjax.train import main as train_main
from msjax.train import train

SHORT = [
    *QUICK_RUN,
    "train.steps=2",
    "train.eval_every=0",
]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def one_line_exit_2(capsys, code: int, *needles: str) -> str:
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.mark.parametrize("command", ["train", "launch"])
def test_a_non_empty_directory_that_is_not_a_run_is_refused_and_left_untouched(
    tmp_path, capsys, command
):
    foreign = tmp_path / "photos"
    (foreign / "2025").mkdir(parents=True)
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8 not a run")
    before = snapshot(foreign)
    args = [*SHORT, f"run.dir={foreign}"]
    code = train_main(args) if command == "train" else launch_main(["--nprocs", "1", "--", *args])
    one_line_exit_2(capsys, code, f"run.dir={foreign} is not empty and holds no msjax run")
    assert snapshot(foreign) == before
    assert sorted(p.name for p in foreign.iterdir()) == ["2025", "cat.jpg"]


@pytest.mark.parametrize("name", ["../elsewhere", "a/b", "..", "a\\b"])
def test_run_name_cannot_lead_out_of_the_runs_folder(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    code = train_main([*SHORT, f"run.name={name}"])
    one_line_exit_2(capsys, code, "run.name=", "must be a plain name")
    assert list(tmp_path.iterdir()) == []


def test_a_command_line_mistake_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line_exit_2(capsys, train_main(["--bogus"]), "unrecognized arguments: --bogus")
    one_line_exit_2(capsys, train_main(["--config"]), "--config")
    assert list(tmp_path.iterdir()) == []


def test_overwrite_sets_aside_msjax_files_only(tmp_path):
    run_dir = tmp_path / "run"
    train(load_config(None, [*SHORT, f"run.dir={run_dir}"]), io.StringIO())
    (run_dir / "notes.txt").write_text("mine")
    first_metrics = (run_dir / "metrics.jsonl").read_text()
    again = [*SHORT, "run.seed=1", "run.overwrite=true", f"run.dir={run_dir}"]
    train(load_config(None, again), io.StringIO())
    (aside,) = [p for p in run_dir.iterdir() if p.name.startswith("previous-")]
    assert (run_dir / "notes.txt").read_text() == "mine"  # the user's file stays put
    assert not (aside / "notes.txt").exists()
    assert (aside / "metrics.jsonl").read_text() == first_metrics
    assert {"config.yaml", "checkpoints", "metrics.jsonl"} <= {p.name for p in aside.iterdir()}
    assert {p.name for p in aside.iterdir()} <= RunDir(run_dir).own_names()
    assert RunDir(run_dir).lock.exists() and not (aside / RunDir(run_dir).lock.name).exists()
    assert load_config(run_dir / "config.yaml").run.seed == 1


def test_another_nodes_launcher_writing_its_job_config_is_not_a_foreign_file(tmp_path):
    """Two nodes' launchers start one run in a shared run dir: one may be writing a run file
    (through msjax's temporary name) while node 0 checks the directory."""
    from msjax.resolve import resolve_run_dir
    from msjax.run_dir import plan_run_dir
    from msjax.writable import temporary_path

    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    temporary_path(run_dir.job_config).write_text("model: {}\n")
    config = resolve_run_dir(load_config(None, [*SHORT, f"run.dir={run_dir.path}"]))
    assert run_dir.foreign_entries() == []
    assert not plan_run_dir(config).continues_run
    (run_dir.path / ".notes.tmp1").write_text("")  # a file msjax does not write is foreign
    assert run_dir.foreign_entries() == [".notes.tmp1"]
