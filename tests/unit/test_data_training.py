"""The data path through the trainer: resuming with grain workers, one-line refusals of a missing
source or an oversized tokenizer, and a mixture of source kinds trained and recorded."""

import io

import numpy as np
import pytest

RESUME_RUN = [
    "train.steps=6",
    "train.global_batch=16",
    "train.eval_every=0",
    "train.peak_tflops=0.5",
    "data.max_corpus_mib=1",
    "data.seq_len=32",
    "model.num_layers=1",
    "checkpoint.every_steps=3",
]


def test_a_missing_source_is_one_line_exit_2_before_the_run_dir_exists(tmp_path, capsys):
    from msjax.train import main

    run_dir = tmp_path / "run"
    code = main([f"data.sources={tmp_path}/corpus/*.jsonl.gz", f"run.dir={run_dir}"])
    stderr = capsys.readouterr().err
    assert code == 2
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert "corpus/*.jsonl.gz" in stderr and "matches no file" in stderr
    assert not run_dir.exists()


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path, capsys):
    import tokenizers
    from tokenizers import models

    vocab = {f"w{i}": i for i in range(299)} | {"</s>": 299}  # 300 tokens > 264
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    from msjax.train import main

    code = main([f"data.tokenizer={tmp_path / 'tokenizer.json'}", f"run.dir={tmp_path / 'run'}"])
    stderr = capsys.readouterr().err
    assert code == 2
    assert "model.vocab_size=264" in stderr and "300 tokens" in stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_mixture_of_stdlib_text_and_token_files_trains_and_is_recorded(tmp_path):
    import json

    from msjax.config import load_config
    from msjax.train import train

    (tmp_path / "text").mkdir()
    for index in range(30):
        (tmp_path / "text" / f"{index}.txt").write_text(f"document {index}\n" * (index + 20))
    np.arange(5000, dtype=np.uint16).__mod__(256).tofile(tmp_path / "tokens.bin")
    sources = (
        f"[{{path: stdlib, weight: 2}}, {{path: '{tmp_path}/text/*.txt', weight: 1}}, "
        f"{{path: '{tmp_path}/tokens.bin', weight: 1}}]"
    )
    printed = io.StringIO()
    run_dir = tmp_path / "run"
    overrides = [*RESUME_RUN, "train.steps=2", f"data.sources={sources}", f"run.dir={run_dir}"]
    train(load_config(None, overrides), progress_stream=printed)
    facts = json.loads((run_dir / "data.json").read_text())
    assert [source["kind"] for source in facts["sources"]] == ["stdlib", "text", "tokens"]
    assert facts["sources"][1]["num_files"] == 30
    assert facts["sources"][2]["train_tokens"] + facts["sources"][2]["eval_tokens"] == 5000
    output = printed.getvalue()
    assert f"data: {tmp_path}/text/*.txt:" in output and "data: stdlib:" in output
