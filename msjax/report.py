"""`python -m msjax.report RUN_DIR`: what a run directory says about its run -- steps, throughput,
MFU, loss, goodput, incidents, stragglers, the flight recorder's verdict and a per-rank heat map
-- as a terminal summary and PNGs in RUN_DIR/report/. It reads files only; nothing runs on devices.
"""

from __future__ import annotations

import argparse
import statistics
import textwrap
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from msjax.cli import ArgumentParser, user_error
from msjax.errors import MsjaxError
from msjax.launch.launches import REQUEUE
from msjax.observe.expert_load import expert_load, expert_load_lines
from msjax.observe.flight_recorder import diagnose
from msjax.observe.flops import MFU_CONVENTION
from msjax.observe.goodput import step_time_split
from msjax.observe.plots import text_heatmap
from msjax.observe.run_files import Run, is_step, load_run
from msjax.planner.save_cadence import DEFAULT_MTBF_HOURS, cadence_texts, nothing_to_recommend
from msjax.run_dir import RunDir

_PROG = "msjax.report"
PLOTS = ("loss.png", "throughput.png", "heatmap.png", "goodput.png")
EXPERT_LOAD_PLOT = "expert_load.png"  # beside PLOTS, for a run with a mixture of experts


# --- the summary ---------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def throughput(run: Run) -> tuple[float | None, float | None, list[int]]:
    """Median tokens/s and MFU over the kept steps past each attempt's warm-up (all kept steps
    if every one is warm-up), and the steps they are over."""
    steady = [step for step in run.steps if step not in run.warmup_steps] or list(run.steps)
    tokens = [
        run.steps[s]["tokens_per_s"] for s in steady if run.steps[s].get("tokens_per_s") is not None
    ]
    mfu = [run.steps[s]["mfu"] for s in steady if run.steps[s].get("mfu") is not None]
    return _median(tokens), _median(mfu), steady


def goodput_breakdown(run: Run) -> tuple[dict[str, float], float | None, str]:
    """Seconds by cause, the ratio, and where they come from (honestly labelled)."""
    if run.goodput is not None and "breakdown_s" in run.goodput:
        ratio = run.goodput.get("effective_training_time_ratio")
        wall = run.goodput.get("wall_s", 0.0)
        source = (
            f"goodput.json (supervised run, outcome {run.goodput.get('outcome', '?')}): "
            f"effective training time ratio {_percent(ratio)} of {wall:.1f} s wall"
        )
        return dict(run.goodput["breakdown_s"]), ratio, source
    split = step_time_split(run.records)
    recorded_step_s = sum(
        record["step_time_s"] for record in run.records if is_step(record)
    )  # every attempt's every step, as measured
    breakdown = {
        "step_s": split["kept_step_s"] - split["data_s"],
        "data_s": split["data_s"],
        "checkpoint_s": split["checkpoint_s"],
        "lost_progress_s": split["superseded_step_s"],
    }
    # what the split does not count as a step: the first step of an attempt waits for compilation
    first_steps_s = recorded_step_s - split["kept_step_s"] - split["superseded_step_s"]
    if first_steps_s > 1e-6:
        breakdown["compile_s"] = first_steps_s
    recorded = sum(breakdown.values())
    ratio = split["kept_step_s"] / recorded if recorded > 0 else None
    source = (
        "metrics.jsonl only (no goodput.json: not run under msjax.launch): kept steps are "
        f"{_percent(ratio)} of the {recorded:.1f} s of steps and checkpoint pauses it records; "
        "start-up, compilation before the first step, evaluation and restarts are not in it, so "
        "this is not the effective training time ratio"
    )
    return breakdown, ratio, source


def _percent(ratio: float | None) -> str:
    return "?" if ratio is None else f"{100 * ratio:.1f}%"


def _steps_text(steps: Sequence[int]) -> str:
    """[1, 2, 3, 7] -> 1-3, 7."""
    parts, start = [], None
    for index, step in enumerate(steps):
        if start is None:
            start = step
        if index + 1 == len(steps) or steps[index + 1] != step + 1:
            parts.append(str(start) if start == step else f"{start}-{step}")
            start = None
    return ", ".join(parts)


def _mesh_text(mesh: dict[str, list[int]]) -> str:
    return ", ".join(f"{axis} {','.join(map(str, values))}" for axis, values in mesh.items())


def _field(label: str, text: str, width: int) -> list[str]:
    """`  label       text`, wrapped under the text."""
    return textwrap.wrap(text, width, initial_indent=f"  {label:<12}", subsequent_indent=" " * 14)


def summary_lines(run: Run, width: int = 80, mtbf_hours: float | None = None) -> list[str]:
    """The terminal summary; `mtbf_hours`: the job's mean time between failures for the save
    cadence (None: DEFAULT_MTBF_HOURS, said to be assumed)."""
    lines = [f"run {run.name}  ({run.path})"]
    lines += _progress_lines(run, width)
    lines += _goodput_lines(run, width)
    lines += save_cadence_lines(run, mtbf_hours, width)
    lines += _launch_lines(run, width)
    lines += ["", f"incidents: {len(run.incidents) or 'none'}"]
    for incident in run.incidents:
        lines += textwrap.wrap(
            _incident_text(incident), width, initial_indent="  ", subsequent_indent="      "
        )

    lines += health_lines(run.path, width)
    lines.append("")
    lines += _straggler_lines(run, width)
    moe_lines = expert_load_lines(run.steps, width)
    lines += ["", *moe_lines] if moe_lines else []
    lines.append("")
    lines += _flight_lines(run, width)
    lines += _profile_lines(run)

    heatmap = run.ranks.heatmap() if run.ranks is not None else None
    if heatmap is not None:
        lines += ["", "per-rank work time (ranks.jsonl)"]
        lines += ["  " + line for line in text_heatmap(heatmap, width - 2)]
    return lines


def _progress_lines(run: Run, width: int) -> list[str]:
    """Steps done, wall time, throughput and MFU, loss, and the lines of records skipped."""
    lines: list[str] = []
    done = len(run.steps) + len(run.skipped)
    last = max(run.steps) if run.steps else None
    of = f" of {run.total_steps}" if run.total_steps is not None else ""
    attempts = len(run.attempt_starts)
    if run.goodput is not None and "attempts" in run.goodput:
        attempts = run.goodput["attempts"]  # it also counts attempts that ended before a step
    text = f"{done}{of} done" + (f" (last step {last})" if last is not None else "")
    if attempts > 1:
        text += f", in {attempts} attempts"
    if len(run.attempt_starts) > 1:
        text += f"; training started at steps {_steps_text(run.attempt_starts)}"
    if run.skipped:
        text += f"; skipped (non-finite loss): {_steps_text(run.skipped)}"
    lines += _field("steps", text, width)
    step_s = sum(record["step_time_s"] for record in run.steps.values())
    if run.goodput is not None and "wall_s" in run.goodput:
        wall = f"{run.goodput['wall_s']:.1f} s (goodput.json); kept steps took {step_s:.1f} s"
    else:
        wall = f"not recorded (no goodput.json); kept steps took {step_s:.1f} s"
    lines += _field("wall time", wall, width)
    tokens, mfu, steady = throughput(run)
    if tokens is not None:
        excluded = "" if len(steady) == len(run.steps) else ", each attempt's warm-up excluded"
        if not steady or (len(steady) == len(run.steps) and run.warmup_steps):
            excluded = ", warm-up included: no other steps"
        mfu_text = "?" if mfu is None else f"{100 * mfu:.3g}%"
        lines += _field(
            "throughput",
            f"median {tokens:,.0f} tokens/s, MFU {mfu_text} (over {len(steady)} steps{excluded})",
            width,
        )
        lines += _field("MFU counts", MFU_CONVENTION, width)
    if run.steps:
        first, final = min(run.steps), max(run.steps)
        text = (
            f"{run.steps[first]['loss']:.4f} (step {first}) -> "
            f"{run.steps[final]['loss']:.4f} (step {final})"
        )
        if run.eval_loss:
            eval_step = max(run.eval_loss)
            text += f"; eval loss {run.eval_loss[eval_step]:.4f} (step {eval_step})"
        lines += _field("loss", text, width)
    else:
        lines += _field("loss", "no training step recorded yet", width)
    for name, count in run.unreadable_lines.items():
        lines.append(f"  note: {count} unreadable line(s) in {name} skipped")
    return lines


def _goodput_lines(run: Run, width: int) -> list[str]:
    """Where the run's time went (goodput.json, or the step records without it), with bars."""
    breakdown, _, source = goodput_breakdown(run)
    lines = ["", *textwrap.wrap(f"goodput from {source}", width, subsequent_indent="  ")]
    total = sum(breakdown.values()) or 1.0
    for key, seconds in breakdown.items():
        bar = "#" * round(40 * seconds / total)
        share = 100 * seconds / total
        lines.append(
            f"  {key.removesuffix('_s'):<15}{seconds:9.2f} s {share:5.1f}%  {bar}".rstrip()
        )
    return lines


def save_cadence_lines(run: Run, mtbf_hours: float | None, width: int = 80) -> list[str]:
    """Young's save intervals (msjax.planner.save_cadence) from the run's measured save costs
    and median steady step time, for disk checkpoints and in-memory snapshots."""
    _, _, steady = throughput(run)
    step_s = _median([run.steps[step]["step_time_s"] for step in steady])
    hours = DEFAULT_MTBF_HOURS if mtbf_hours is None else mtbf_hours
    why_not = nothing_to_recommend(run.records, step_s)
    if why_not is not None:
        return ["", why_not]
    assumed = ", assumed (--mtbf-hours)" if mtbf_hours is None else " (--mtbf-hours)"
    head = f"save cadence (Young: interval sqrt(2 x save cost x MTBF), MTBF {hours:g} h{assumed})"
    lines = ["", *textwrap.wrap(head, width, subsequent_indent="  ", break_on_hyphens=False)]
    lines += _field("step time", f"median {step_s:.4g} s over {len(steady)} steps", width)
    for label, text in cadence_texts(run.records, run.checkpoint, step_s, hours * 3600.0):
        lines += _field(label, text, width)
    return lines


def _launch_lines(run: Run, width: int) -> list[str]:
    """Each launcher session (a scheduler's run of the job) with its nodes and attempts."""
    if not run.launches:
        return []
    lines = ["", f"launches: {len(run.launches)} (launches.jsonl)"]
    previous_end = None
    for launch in run.launches:
        text = f"#{launch.get('launch', '?')} on {launch.get('nodes', '?')}"
        if launch.get("nnodes"):
            text += f" ({launch['nnodes']} node{'s' if launch['nnodes'] > 1 else ''})"
        if launch.get("slurm_job_id"):
            text += (
                f", Slurm job {launch['slurm_job_id']} run "
                f"{(launch.get('slurm_restart_count') or 0) + 1}"
            )
        started, ended = launch.get("started_unix_s"), launch.get("ended_unix_s")
        if previous_end is not None and started is not None:
            text += f", {started - previous_end:.1f} s after the launch before"
        if started is not None and ended is not None:
            text += f": {ended - started:.1f} s, {launch.get('outcome', '?')}"
        lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="      ")
        for attempt in launch.get("attempts", []):
            first, last = attempt.get("start_step"), attempt.get("max_step")
            steps = "no step" if first is None else f"steps {first}-{last}"
            lines.append(
                f"    attempt {attempt.get('attempt', '?')} on {launch.get('nodes', '?')}: "
                f"{steps}, {attempt.get('outcome') or '?'}"
            )
        previous_end = ended
    return lines


def _incident_text(incident: dict[str, Any]) -> str:
    if incident.get("cause") == REQUEUE:
        text = (
            f"#{incident.get('incident', '?')} requeue after step {incident.get('step', '?')}: "
            f"{incident.get('detail', '')}; stopping took {incident.get('stop_s', 0.0):.1f} s, "
            f"the scheduler {incident.get('scheduler_s', 0.0):.1f} s"
        )
    else:
        text = (
            f"#{incident.get('incident', '?')} {incident.get('cause', '?')} of rank "
            f"{incident.get('rank', '?')} at step {incident.get('step', '?')}"
            f" (phase {incident.get('phase', '?')}): {incident.get('detail', '')}"
        )
    latency = incident.get("detection_latency_s")
    if latency is not None:
        text += f"; detected after {latency:.2f} s"
    lost = incident.get("steps_lost")
    text += "; steps lost ?" if lost is None else f"; {lost} step(s) lost"
    action = incident.get("action")
    if action == "restart" and incident.get("resumed_from_step") is not None:
        text += f"; restarted from step {incident['resumed_from_step']}"
    elif action == "stop":
        text += f"; stopped: {incident.get('stop_reason', '')}"
    if incident.get("catch_up_s") is not None:
        text += f"; caught up {incident['catch_up_s']:.1f} s after detection"
    return text


def health_lines(run_dir: Path, width: int = 80) -> list[str]:
    """Each round of self-checks (RUN_DIR/health/N.json, msjax.doctor): passed with its figures,
    or the failing ranks with each check's figure against its bound."""
    import json

    health = RunDir(run_dir).health
    rounds = sorted(
        (p for p in health.glob("*.json") if p.stem.isdigit()), key=lambda p: int(p.stem)
    )
    if not rounds:
        return []
    lines = ["", f"self-checks: {len(rounds)} round(s) (health/)"]
    for path in rounds:
        try:
            verdict = json.loads(path.read_text())
            if verdict["passed"]:
                text = f"#{path.stem} attempt {verdict['attempt']}: passed in "
                text += f"{verdict['wall_s']:.1f} s; {verdict['summary']}"
            else:
                ranks = ", ".join(str(rank) for rank in verdict["failed_ranks"])
                text = f"#{path.stem} attempt {verdict['attempt']}: FAILED rank(s) {ranks}: "
                text += "; ".join(
                    f"rank {f['rank']} {f['check']}: {f['detail']}" for f in verdict["failures"]
                )
        except (OSError, ValueError, KeyError, TypeError):
            text = f"#{path.stem}: unreadable ({path.name})"
        lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="      ")
    return lines


def _straggler_lines(run: Run, width: int) -> list[str]:
    if run.ranks is None:
        return ["stragglers: no ranks.jsonl (per-rank timing was not recorded)"]
    events = run.ranks.stragglers
    steps = len(run.ranks.work_by_step)
    if not events:
        return [f"stragglers: none flagged over {steps} steps of per-rank timing"]
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for event in events:
        by_rank.setdefault(event.get("rank", -1), []).append(event)
    lines = [f"stragglers: {len(by_rank)} rank(s) flagged over {steps} steps of per-rank timing"]
    for rank, flagged in sorted(by_rank.items(), key=lambda item: -len(item[1])):
        newest = flagged[-1]
        phases = Counter(event.get("phase", "?") for event in flagged)
        windows = [w for event in flagged if len(w := event.get("window") or []) == 2]
        span = (
            f"steps {min(w[0] for w in windows)}-{max(w[1] for w in windows)}, " if windows else ""
        )
        excess = max(event.get("excess_s", 0.0) for event in flagged)
        score = max(event.get("score", 0.0) for event in flagged)
        text = (
            f"rank {rank} on {newest.get('host', '?')} ({_mesh_text(newest.get('mesh', {}))}): "
            f"flagged {len(flagged)} time(s), {span}phase "
            + ", ".join(f"{phase} x{count}" for phase, count in phases.most_common())
            + f"; up to {excess:.3g} s/step over the median rank, score up to {score:.3g}"
        )
        lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="      ")
    return lines


def _profile_lines(run: Run) -> list[str]:
    """Where the profiler traces are (observe.profile_steps), one line per rank."""
    files = RunDir(run.path)
    if not files.profiles.is_dir():
        return []
    traces = sorted(path for path in files.profiles.iterdir() if path.is_dir())
    lines = ["", "profiles (observe.profile_steps; TensorBoard's profile plugin or Perfetto):"]
    for trace in traces:
        count = sum(1 for path in trace.rglob("*") if path.is_file())
        lines.append(f"  {trace}: {count} file(s)")
    return lines


def _flight_lines(run: Run, width: int) -> list[str]:
    """The flight recorder's verdict: which rank did not reach the point the others reached."""
    files = RunDir(run.path)
    dumps = files.flight_records()
    if not dumps:
        return [f"flight recorder: no dumps in {files.flight.name}/"]
    try:
        verdict = diagnose(run.path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        return [f"flight recorder: the dumps could not be compared ({error!r})"]
    if verdict is None:
        return [f"flight recorder: {len(dumps)} dump(s); no rank stopped short of the others"]
    lines = textwrap.wrap(f"flight recorder: {verdict.summary}", width, subsequent_indent="  ")
    for line in verdict.details:
        lines += textwrap.wrap(line, width, initial_indent="  ", subsequent_indent="      ")
    return lines


# --- PNGs ----------------------------------------------------------------------------------


def write_plots(run: Run, out_dir: Path) -> list[str]:
    """Write every PNG whose data is there; one line per PNG written or skipped."""
    from msjax.observe import plots

    out_dir.mkdir(parents=True, exist_ok=True)
    written, notes = [], []
    steps = list(run.steps)
    if steps:
        plots.plot_loss(
            out_dir / "loss.png",
            steps,
            [run.steps[step]["loss"] for step in steps],
            list(run.eval_loss),
            list(run.eval_loss.values()),
            run.attempt_starts,
        )
        plots.plot_throughput(
            out_dir / "throughput.png",
            steps,
            [run.steps[step].get("tokens_per_s", float("nan")) for step in steps],
            [run.steps[step].get("mfu", float("nan")) for step in steps],
            run.warmup_steps,
            run.attempt_starts,
        )
        written += ["loss.png", "throughput.png"]
    else:
        notes.append("skipped loss.png and throughput.png: no training step in metrics.jsonl")
    heatmap = run.ranks.heatmap() if run.ranks is not None else None
    if heatmap is not None:
        assert run.ranks is not None
        windows = [
            (event["rank"], *event["window"])
            for event in run.ranks.stragglers
            if "rank" in event and len(event.get("window") or []) == 2
        ]
        plots.plot_heatmap(out_dir / "heatmap.png", heatmap, windows)
        written.append("heatmap.png")
    else:
        why = "no ranks.jsonl" if run.ranks is None else "no per-step records in ranks.jsonl"
        notes.append(f"skipped heatmap.png: {why}")
    breakdown, ratio, _ = goodput_breakdown(run)
    if sum(breakdown.values()) > 0:
        if run.goodput is not None:
            title = f"effective training time ratio {_percent(ratio)} (goodput.json)"
        else:
            title = (
                f"recorded time only, from metrics.jsonl (no goodput.json): kept steps "
                f"{_percent(ratio)}"
            )
        plots.plot_goodput(out_dir / "goodput.png", breakdown, title)
        written.append("goodput.png")
    else:
        notes.append("skipped goodput.png: no time recorded yet")
    load = expert_load(run.steps)
    if load is not None:  # a dense run has no experts to draw, and no note about them
        hot = [item.expert for item in load.hot_experts()]
        plots.plot_expert_load(out_dir / EXPERT_LOAD_PLOT, load.steps, load.shares, hot)
        written.append(EXPERT_LOAD_PLOT)
    lines = [f"plots in {out_dir}: {', '.join(written)}"] if written else []
    return lines + notes


# --- the command ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=f"python -m {_PROG}",
        description="Summarise a run directory: throughput, MFU, loss, goodput, incidents, "
        "stragglers, flight-recorder verdict, per-rank heat map, expert load of a mixture of "
        "experts; and write PNG charts.",
        epilog="example: python -m msjax.report runs/tiny-20260101-120000",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, help="where the PNGs go (default: RUN_DIR/report)")
    parser.add_argument("--no-plots", action="store_true", help="print the summary only")
    parser.add_argument(
        "--mtbf-hours",
        type=float,
        metavar="H",
        help="the job's mean time between failures, for the recommended save intervals "
        f"(default: {DEFAULT_MTBF_HOURS:g}, assumed)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; 0 on success, 2 (one line on stderr) on a user mistake."""
    try:
        args = _parser().parse_args(argv)
        if not RunDir(args.run_dir).metrics.exists() and health_lines(args.run_dir):
            print(f"run {args.run_dir}: no training yet", *health_lines(args.run_dir), sep="\n")
            return 0  # a run dir only msjax.doctor has written to
        if args.mtbf_hours is not None and not 0 < args.mtbf_hours < float("inf"):
            raise MsjaxError(f"--mtbf-hours={args.mtbf_hours:g} must be a positive number")
        run = load_run(args.run_dir)
        lines = summary_lines(run, mtbf_hours=args.mtbf_hours)
        if not args.no_plots:
            out_dir = args.out if args.out is not None else RunDir(run.path).report
            try:
                lines += ["", *write_plots(run, out_dir)]
            except OSError as error:
                raise MsjaxError(f"cannot write the plots to {out_dir}: {error}") from None
    except MsjaxError as error:
        return user_error(_PROG, error)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
