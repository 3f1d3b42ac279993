"""A run resumes only on the corpus it was trained on: a changed file, an added file or another
tokenizer is refused with one line naming it, unless data.allow_changed=true, which is recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

from msjax.checkpoint.manager import Checkpointer, committed_steps
from msjax.config import CheckpointConfig
from msjax.data.identity import corpus_changes
from msjax.train import main
from tests.small_runs import QUICK_RUN


def write_corpus(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(3):
        lines = [f"document {index} line {line}: the quick brown fox" for line in range(200)]
        (directory / f"part{index}.txt").write_text("\n".join(lines))


def train_args(run_dir: Path, corpus: Path, *overrides: str) -> list[str]:
    return [
        *QUICK_RUN,
        f"data.sources={corpus}/*.txt",
        "data.eval_fraction=0",
        "train.eval_every=0",
        "checkpoint.every_steps=2",
        f"run.dir={run_dir}",
        *overrides,
    ]


def saved_data_record(run_dir: Path) -> dict:
    checkpoints = run_dir / "checkpoints"
    checkpointer = Checkpointer(checkpoints, CheckpointConfig(), read_only=True)
    try:
        return checkpointer.metadata(committed_steps(checkpoints)[-1])["data"]
    finally:
        checkpointer.close()


@pytest.fixture()
def trained(tmp_path: Path) -> tuple[Path, Path]:
    corpus, run_dir = tmp_path / "corpus", tmp_path / "run"
    write_corpus(corpus)
    assert main(train_args(run_dir, corpus, "train.steps=2")) == 0
    return corpus, run_dir


def test_a_changed_file_is_refused_with_one_line_naming_it(trained, capsys):
    corpus, run_dir = trained
    capsys.readouterr()
    (corpus / "part1.txt").write_text("another text altogether\n" * 300)
    assert main(train_args(run_dir, corpus, "train.steps=4")) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1
    assert "the corpus differs" in errors[0] and "file part1.txt changed" in errors[0]
    assert "data.allow_changed=true" in errors[0]
    assert committed_steps(run_dir / "checkpoints") == [2]


def test_an_allowed_change_is_recorded_in_later_checkpoints(trained, capsys):
    corpus, run_dir = trained
    (corpus / "part3.txt").write_text("a new document\n" * 300)
    assert main(train_args(run_dir, corpus, "train.steps=4", "data.allow_changed=true")) == 0
    assert "file part3.txt added" in capsys.readouterr().out
    record = saved_data_record(run_dir)
    assert record["allowed_changes"] == [
        {"at_step": 2, "changes": ["source " + f"{corpus}/*.txt: file part3.txt added"]}
    ]
    assert "part3.txt" in record["corpus"]["sources"][0]["files"]


def test_resume_from_another_run_on_changed_data_is_refused(trained, tmp_path, capsys):
    corpus, run_dir = trained
    (corpus / "part0.txt").unlink()
    other = tmp_path / "other"
    code = main(train_args(other, corpus, "train.steps=4", f"checkpoint.resume_from={run_dir}"))
    assert code == 2
    assert "file part0.txt removed" in capsys.readouterr().err


def test_the_same_corpus_has_no_changes_and_a_tokenizer_change_is_named():
    corpus = {"tokenizer": "byte", "sources": [{"path": "a", "kind": "text", "files": {"x": "1"}}]}
    assert corpus_changes(corpus, corpus) == []
    other = {**corpus, "tokenizer": "sentencepiece:ab"}
    assert corpus_changes(corpus, other) == ["tokenizer byte -> sentencepiece:ab"]
