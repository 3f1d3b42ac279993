"""What per-rank timing and the flight recorder cost: msjax.train with them on against off.

Both runs train the default tiny config (8 simulated CPU devices) in this process, for the same
steps, and read tokens/s from their own metrics.jsonl. "Off" is `observe.rank_timing=false
observe.flight_recorder_events=0`. The two alternate for --rounds rounds and each keeps its best,
so a burst of load from elsewhere on a shared machine does not decide the ratio (target: the
observed run within 2% of the unobserved one). Which runs first alternates from round to round.
One lucky round of either still decides a best-of ratio, so the median of the rounds' own ratios
(each pair run back to back) is printed too.

    python benchmarks/observe_overhead.py [--steps 60] [--rounds 3]
    python benchmarks/observe_overhead.py --smoke   # a tiny model, 6 steps, 1 round: seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.smoke import SMOKE_LABEL, TINY_CORPUS, TINY_MODEL, TINY_SEQ_LEN  # noqa: E402
from msjax.config import load_config  # noqa: E402
from msjax.observe.metrics import read_metrics  # noqa: E402
from msjax.train import train  # noqa: E402

WARMUP_STEPS = 3  # left out: compilation and first dispatches
OFF = ["observe.rank_timing=false", "observe.flight_recorder_events=0"]


def tokens_per_s(steps: int, observed: bool, sizes: list[str]) -> float:
    """Median tokens/s of one run's steps after the warm-up."""
    with tempfile.TemporaryDirectory() as run_root:
        overrides = [
            f"train.steps={steps}",
            "train.eval_every=0",
            "checkpoint.enabled=false",
            f"run.dir={Path(run_root) / 'run'}",
            *sizes,
            *([] if observed else OFF),
        ]
        with open(os.devnull, "w") as quiet:
            train(load_config(None, overrides), progress_stream=quiet)
        records = read_metrics(Path(run_root) / "run" / "metrics.jsonl")
    rates = [record["tokens_per_s"] for record in records if "loss" in record]
    return statistics.median(rates[WARMUP_STEPS:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tinier model, 6 steps, 1 round")
    args = parser.parse_args()
    sizes = []
    if args.smoke:
        args.steps, args.rounds = WARMUP_STEPS + 3, 1
        sizes = [*TINY_MODEL, *TINY_CORPUS, f"data.seq_len={TINY_SEQ_LEN}"]
    print(
        f"tiny config{SMOKE_LABEL if args.smoke else ''}, 8 simulated CPU devices, "
        f"{args.steps} steps ({WARMUP_STEPS} left out)"
    )
    on_rounds, off_rounds = [], []
    for round_index in range(args.rounds):
        for observed in (False, True) if round_index % 2 == 0 else (True, False):
            rate = tokens_per_s(
                args.steps, observed, sizes
            )  # order alternates: no seat is favoured
            (on_rounds if observed else off_rounds).append(rate)
        print(
            f"  round {round_index + 1}: off {off_rounds[-1]:,.0f}, on {on_rounds[-1]:,.0f} "
            "tokens/s (median step)"
        )
    on, off = max(on_rounds), max(off_rounds)
    print(f"{'per-rank timing + flight recorder off':<40} {off:10,.0f} tokens/s")
    print(f"{'per-rank timing + flight recorder on':<40} {on:10,.0f} tokens/s")
    print(f"{'ratio (on / off)':<40} {on / off:10.3f}   (target >= 0.98)")
    # each round's pair ran back to back, so its own ratio shares that round's load
    paired = statistics.median(a / b for a, b in zip(on_rounds, off_rounds, strict=True))
    print(f"{'median of the rounds own ratios':<40} {paired:10.3f}")


if __name__ == "__main__":
    main()
