"""The data path through the trainer: resuming with grain workers, one-line refusals of a missing
source or an oversized tokenizer, and a mixture of source kinds trained and recorded."""

import io
from pathlib import Path

import pytest
from test_data_training import RESUME_RUN


@pytest.mark.slow
def test_a_run_resumed_with_grain_workers_sees_the_batches_of_a_run_without(tmp_path):
    from msjax.config import load_config
    from msjax.observe.metrics import read_metrics
    from msjax.train import train

    def losses(run_dir: Path) -> dict[int, float]:
        records = read_metrics(run_dir / "metrics.jsonl")
        return {record["step"]: record["loss"] for record in records if "loss" in record}

    straight = tmp_path / "straight"
    train(load_config(None, [*RESUME_RUN, f"run.dir={straight}"]), progress_stream=io.StringIO())
    resumed = tmp_path / "resumed"
    train(
        load_config(
            None,
            [
                *RESUME_RUN,
                f"run.dir={resumed}",
                f"checkpoint.resume_from={straight}/checkpoints/3",
                "data.num_workers=2",
            ],
        ),
        progress_stream=io.StringIO(),
    )
    expected = losses(straight)
    assert sorted(losses(resumed)) == [3, 4, 5]
    assert all(loss == expected[step] for step, loss in losses(resumed).items())
