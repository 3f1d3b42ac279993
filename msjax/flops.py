"""`python -m msjax.flops`: a config's parameter and FLOP counts, and the MFU of a step time.

Counting only: no devices are touched, so MFU needs the device count and peak given.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from msjax.cli import ArgumentParser, user_error
from msjax.config import load_config
from msjax.errors import MsjaxError
from msjax.observe.flops import (
    MFU_CONVENTION,
    count_params,
    flops_per_step,
    flops_per_token,
    mfu,
)

_PROG = "msjax.flops"


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=f"python -m {_PROG}",
        description="Parameters, training FLOPs per token and per step, and MFU of a step time.",
    )
    parser.add_argument("--config", help="YAML config file (default: the built-in tiny config)")
    parser.add_argument(
        "overrides", nargs="*", help="section.key=value, e.g. train.global_batch=768"
    )
    parser.add_argument("--devices", type=int, help="number of devices the step ran on")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help="dense peak TFLOP/s per device (default: train.peak_tflops)",
    )
    parser.add_argument("--step-time", type=float, help="seconds per training step; prints MFU")
    return parser


def _human_count(value: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.4g}{suffix}"
    return f"{value:.0f}"


def _human_flops(value: float) -> str:
    for prefix, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if abs(value) >= scale:
            return f"{value:.4g} = {value / scale:.4g} {prefix}FLOP"
    return f"{value:.0f} FLOP"


def report(args: argparse.Namespace) -> list[str]:
    """The lines to print for parsed command-line arguments."""
    config = load_config(args.config, args.overrides)
    model, seq_len, global_batch = config.model, config.data.seq_len, config.train.global_batch
    params = count_params(model)
    step_flops = flops_per_step(config)
    tokens_per_step = global_batch * seq_len
    window = model.attention_window
    context = "full causal" if window is None else f"sliding window {window}"
    rows = {
        "config": args.config or "defaults (tiny)",
        "parameters": (
            f"{_human_count(params.total)} total, {_human_count(params.embedding)} embedding, "
            f"{_human_count(params.matmul)} matmul"
            + (
                f", {_human_count(params.active_matmul)} active matmul (per token)"
                if params.active_matmul != params.matmul
                else ""
            )
        ),
        "FLOPs per token": (
            f"{_human_flops(flops_per_token(model, seq_len))} "
            f"(6 x {'active ' if params.active_matmul != params.matmul else ''}matmul params + "
            f"causal attention; seq_len {seq_len}, {context})"
        ),
        "FLOPs per step": (
            f"{_human_flops(step_flops)} (global_batch {global_batch} x seq_len {seq_len} = "
            f"{_human_count(tokens_per_step)} tokens)"
        ),
    }
    if args.step_time is not None:
        peak = args.peak_tflops if args.peak_tflops is not None else config.train.peak_tflops
        needed = {"--devices": args.devices, "--peak-tflops": peak}
        missing = [flag for flag, value in needed.items() if value is None]
        if missing:
            raise MsjaxError(f"--step-time needs {' and '.join(missing)} to compute MFU")
        utilisation = mfu(step_flops, args.step_time, args.devices, peak)
        achieved_tflops = step_flops / args.step_time / args.devices / 1e12
        rows["tokens/s"] = (
            f"{_human_count(tokens_per_step / args.step_time)} ({args.step_time:g} s per step)"
        )
        rows["MFU"] = (
            f"{100 * utilisation:.1f}% ({achieved_tflops:.1f} of {peak:g} TFLOP/s per device, "
            f"{args.devices} devices)"
        )
        rows["MFU convention"] = MFU_CONVENTION
    return [f"{label + ':':<17}{text}" for label, text in rows.items()]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; 0 on success, 2 (one line on stderr) on a user mistake."""
    try:
        args = _parser().parse_intermixed_args(argv)
        print("\n".join(report(args)))
    except MsjaxError as error:
        return user_error(_PROG, error)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
