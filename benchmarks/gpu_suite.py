"""Trusted GPU figures for msjax in one call of at most 9 minutes on one GPU.

    python benchmarks/gpu_suite.py --out OUTDIR [--smoke] [--parts a,b] [--budget part=s]

Each part runs in its own process (benchmarks/gpu_parts.py) under its own time budget, in this
order: versions and device; measured ceilings (bf16 matmul TFLOP/s, device copy GB/s); flash
attention at llama_1b's shape, at 16k and with packed documents against cuDNN and XLA, forward
and backward;
configs/llama_1b.yaml with every kernel on XLA, then on Pallas (same seed and data: the per-step
loss difference is the end-to-end kernel check), MFU against the datasheet peak and the measured
ceiling; llama_1b's 14.8 GB state saved and restored in GB/s; then, while time is left, cuDNN
attention with XLA norm and loss, the `gpu` tests of the compiled kernels and, with more than
one GPU, whether the step's collectives are async (start/done pairs with compute between).

After each part one JSON line is appended to OUTDIR/gpu.jsonl and flushed: a part's rows, its
status (ok, failed, timeout, skipped), seconds and budget. A part killed at its budget keeps the
rows it had printed; a run killed from outside keeps every finished part. Each llama run's
metrics.jsonl is copied to OUTDIR.

Wheels in .whl/ (benchmarks/gpu_kit.sh fetches them: grain and its needs, jax-triton) whose
package this Python lacks are installed first with `pip install --no-index --no-deps --target`
into a scratch folder, which goes on PYTHONPATH: the GPU image has neither grain nor a network.

`--smoke` (forced without a GPU) is the CPU form: tiny shapes, the Pallas interpreter, the tiny
config; its numbers mean nothing, the parts that need a GPU are skipped.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.gpu_parts import ROW_PREFIX  # noqa: E402  (its top imports no jax)

WHEELS = REPO / ".whl"
# seconds per part on the GPU, in order; 475 s for the parts every call runs
BUDGETS_S = {
    "versions": 20,
    "ceilings": 35,
    "attention": 100,
    "llama_xla": 120,
    "llama_pallas": 120,
    "checkpoint": 80,
    "llama_cudnn": 110,  # only while time is left
    "gpu_tests": 90,  # only while time is left
    "async_collectives": 50,  # only while time is left, with more than one GPU
}
WHILE_TIME_IS_LEFT = {"llama_cudnn", "gpu_tests", "async_collectives"}
GPU_ONLY = {"llama_cudnn", "gpu_tests", "async_collectives"}
SMOKE_BUDGET_S = 900  # a part's limit on a shared CPU: its own records end it, not the clock
TOTAL_S = 530  # within one 9-minute call, after start-up


def install_wheels(wheels: Path, scratch: Path) -> dict[str, Any]:
    """pip install --no-index --no-deps --target scratch each wheel in `wheels` whose package
    this Python lacks (one the image has is left as it is, not shadowed)."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        return {"status": "skipped", "reason": f"no wheels in {wheels}"}
    missing = [path for path in found if not installed(path.name.split("-")[0])]
    if not missing:
        return {"status": "skipped", "reason": "every wheel's package is installed already"}
    command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet"]
    command += ["--target", str(scratch), *map(str, missing)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    return {
        "status": "ok" if result.returncode == 0 else "failed",
        "installed": [path.name for path in missing],
        "already_there": [path.name for path in found if path not in missing],
        "target": str(scratch),
        "stderr_tail": result.stderr[-2000:],
    }


def installed(project: str) -> bool:
    """Whether this Python has the distribution a wheel's file name starts with."""
    try:
        importlib.metadata.distribution(project.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def child_environment(smoke: bool, scratch: Path | None) -> dict[str, str]:
    paths = [str(REPO), *([str(scratch)] if scratch else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}
    if smoke:
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = "1"  # one device, like the GPU runs
    return env


def parse_rows(lines: list[str]) -> list[dict[str, Any]]:
    """The part's rows; a last line cut short by the kill is left out."""
    rows = []
    for line in lines:
        if line.startswith(ROW_PREFIX):
            try:
                rows.append(json.loads(line[len(ROW_PREFIX) :]))
            except json.JSONDecodeError:
                continue
    return rows


def keep_partial_metrics(name: str, rows: list[dict[str, Any]], out: Path) -> str | None:
    """A training run cut off by its part's budget: its metrics.jsonl so far, copied to OUTDIR."""
    for row in rows:
        metrics = Path(row["path"]) / "metrics.jsonl" if row.get("kind") == "run_dir" else None
        if metrics and metrics.exists():
            copy = out / f"{name}.partial.metrics.jsonl"
            copy.write_bytes(metrics.read_bytes())
            return copy.name
    return None


def run_part(name: str, budget_s: float, args: argparse.Namespace, env: dict) -> dict[str, Any]:
    """One part in its own process group, killed at its budget; its rows either way."""
    log = args.out / f"{name}.out"
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_parts.py"), name]
    command += ["--out-dir", str(args.out), *(["--smoke"] if args.smoke else [])]
    command += ["--hang"] if name in args.hang else []
    started = time.perf_counter()
    with log.open("w") as output:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT,
            start_new_session=True,  # its children (msjax.train) go with it at a timeout
        )  # fmt: skip
        try:
            status = "ok" if process.wait(timeout=budget_s) == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = "timeout"
    lines = log.read_text(errors="replace").splitlines()
    result = {"part": name, "status": status, "rows": parse_rows(lines)}
    if status == "timeout":
        result["partial_metrics"] = keep_partial_metrics(name, result["rows"], args.out)
    if status != "ok":
        result["output_tail"] = "\n".join(line for line in lines[-30:] if line.strip())
    seconds = round(time.perf_counter() - started, 1)
    return {**result, "seconds": seconds, "budget_s": budget_s, "exit_code": process.returncode}


def append_line(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, flushed and synced: it survives a kill of this process right after."""
    with path.open("a") as out:
        out.write(json.dumps(record, default=str) + "\n")
        out.flush()
        os.fsync(out.fileno())


def count_gpus() -> int:
    """GPUs, asked of a child process so this one never holds the devices."""
    probe = "import jax; print(jax.device_count() if jax.default_backend() == 'gpu' else 0)"
    try:
        result = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
        )
        return int(result.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, ValueError):
        return 0


def skip_reason(name: str, smoke: bool, gpus: int, left_s: float, budget_s: float) -> str | None:
    """Why a part does not run: it needs a GPU (smoke) or two, or the call's time is spent."""
    if smoke:
        return "needs a GPU" if name in GPU_ONLY else None
    if name == "async_collectives" and gpus < 2:
        return "needs more than one GPU"
    if left_s < 10 or (name in WHILE_TIME_IS_LEFT and left_s < budget_s):
        return f"{left_s:.0f} s of the call left"
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="OUTDIR: gpu.jsonl and copies")
    parser.add_argument("--smoke", action="store_true", help="CPU form; forced without a GPU")
    parser.add_argument("--parts", default=",".join(BUDGETS_S), help="comma-separated subset")
    parser.add_argument("--budget", action="append", default=[], help="part=seconds, to change")
    parser.add_argument("--total-seconds", type=float, default=TOTAL_S)
    parser.add_argument("--wheels", type=Path, default=WHEELS)
    parser.add_argument("--hang", default="", help="fault: these parts block after their rows")
    args = parser.parse_args(argv)
    args.parts = args.parts.split(",")
    args.hang = {part for part in args.hang.split(",") if part}
    for name in [*args.parts, *args.hang]:
        if name not in BUDGETS_S:
            parser.error(f"unknown part {name!r}; accepted: {', '.join(BUDGETS_S)}")
    args.budgets = {}
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in BUDGETS_S or not seconds.replace(".", "", 1).isdigit():
            parser.error(
                f"--budget {item!r}: give part=seconds with a part of {', '.join(BUDGETS_S)}"
            )
        args.budgets[name] = float(seconds)
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    journal = args.out / "gpu.jsonl"
    started = time.perf_counter()
    gpus = 0 if args.smoke else count_gpus()
    args.smoke = args.smoke or gpus == 0
    scratch = None
    if not args.smoke:
        scratch = Path(tempfile.mkdtemp(prefix="msjax-gpu-wheels-"))
        setup = install_wheels(args.wheels, scratch)
        append_line(journal, {"part": "setup", **setup})
        scratch = scratch if setup.get("installed") else None
    env = child_environment(args.smoke, scratch)
    records = []
    for name in args.parts:
        left_s = args.total_seconds - (time.perf_counter() - started)
        budget_s = args.budgets.get(name, SMOKE_BUDGET_S if args.smoke else BUDGETS_S[name])
        reason = skip_reason(name, args.smoke, gpus, left_s, budget_s)
        if reason:
            record = {"part": name, "status": "skipped", "reason": reason, "rows": []}
        else:
            record = run_part(name, budget_s if args.smoke else min(budget_s, left_s), args, env)
        append_line(journal, {**record, "smoke": args.smoke})
        records.append(record)
        print(f"{name}: {record['status']}", flush=True)
    print(f"{time.perf_counter() - started:.0f} s; one line per part in {journal}")
    return records


if __name__ == "__main__":
    main()
