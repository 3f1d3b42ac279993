"""Everything msjax claims about GPUs, measured by one command in under 8 minutes on one GPU.

Parts, each in its own process under its own time budget (a part that fails or runs out of time
is recorded and the next one runs):
- gpu_tests: the GPU-only tests (kernels against references, the Triton norm, the cuDNN path);
- kernels: benchmarks/kernels_gpu.py's rows (flash vs XLA and cuDNN, windows, RMSNorm share of
  bandwidth, fused cross-entropy), within a shortened time budget;
- llama_1b: configs/llama_1b.yaml on one GPU, bfloat16, tokens/s and MFU with
  train.xla_profile none and overlap (a fresh process each: XLA reads its flags once);
- checkpoint: benchmarks/checkpoint_overhead.py (saves every 5 steps vs none, restore MB/s;
  its `--smoke` form on CPU in the smoke run);
- async_collectives: with more than one GPU, whether the compiled step's collectives are async
  (start/done pairs with compute between them).

    python benchmarks/gpu_suite.py [--smoke] [--out gpu_suite.json]

`--smoke` (forced without a GPU) runs in under a minute on CPU: the GPU parts are marked skipped,
llama_1b trains the tiny config for a few steps and checkpoint runs its script's smoke form, both
marked smoke. Writes one JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
WARMUP_STEPS = 3  # left out of tokens/s and MFU: compile and first allocations
BUDGETS_S = {  # per part; 460 s in all, under 8 minutes with the processes' start-up
    "gpu_tests": 100,
    "kernels": 110,
    "llama_1b": 140,
    "checkpoint": 60,
    "async_collectives": 50,
}


def _environment(cpu_only: bool) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if cpu_only:
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = "1"  # the smoke run is one device, like the GPU runs
    return env


def _run(command: list[str], budget_s: float, cpu_only: bool) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        cwd=REPO,
        env=_environment(cpu_only),
        capture_output=True,
        text=True,
        timeout=budget_s,
        check=False,
    )


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def gpu_tests(smoke: bool, gpus: int, budget_s: float) -> dict[str, Any]:
    if smoke or gpus == 0:
        return {"status": "skipped", "reason": "needs a GPU"}
    files = ["tests/test_triton_kernels.py", "tests/test_kernels.py"]
    result = _run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], budget_s, False
    )
    summary = _tail(result.stdout, 1)
    counts = {
        kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)
    }
    return {
        "status": "ok" if result.returncode == 0 else "failed",
        "counts": counts,
        "summary": summary,
        "output_tail": "" if result.returncode == 0 else _tail(result.stdout, 30),
    }


def kernels(smoke: bool, gpus: int, budget_s: float) -> dict[str, Any]:
    if smoke or gpus == 0:
        return {"status": "skipped", "reason": "needs a GPU (the interpreter's times mean nothing)"}
    command = [sys.executable, "benchmarks/kernels_gpu.py", "--max-seconds", str(budget_s * 0.6)]
    result = _run(command, budget_s, False)
    return {
        "status": "ok" if result.returncode == 0 else "failed",
        "rows": [line for line in result.stdout.splitlines() if line.strip()][-60:],
        "error_tail": "" if result.returncode == 0 else _tail(result.stderr),
    }


def _train(overrides: list[str], budget_s: float, cpu_only: bool) -> dict[str, Any]:
    """One msjax.train run in a fresh process; median tokens/s and MFU past the warm-up."""
    with tempfile.TemporaryDirectory(prefix="msjax-gpu-suite-") as root:
        run_dir = Path(root) / "run"
        command = [sys.executable, "-m", "msjax.train", *overrides, f"run.dir={run_dir}"]
        result = _run(command, budget_s, cpu_only)
        if result.returncode != 0:
            return {"status": "failed", "error_tail": _tail(result.stderr)}
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        flags = json.loads((run_dir / "xla_flags.json").read_text())
    steps = [r for r in records if "tokens_per_s" in r]
    kept = steps[WARMUP_STEPS:] or steps
    mfu = [r["mfu"] for r in kept if r.get("mfu") is not None]
    return {
        "status": "ok",
        "steps_measured": len(kept),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in kept),
        "mfu": statistics.median(mfu) if mfu else None,
        "xla_flags": flags["xla_flags"],
        "xla_profile_applied": flags["applied"],
    }


def llama_1b(smoke: bool, gpus: int, budget_s: float) -> dict[str, Any]:
    from msjax.observe.flops import MFU_CONVENTION

    if smoke or gpus == 0:
        overrides = [
            "train.steps=2",
            "train.eval_every=0",
            "checkpoint.enabled=false",
            "data.max_corpus_mib=1",
            "train.peak_tflops=0.5",
            "mesh.data=1",
            "mesh.fsdp=1",
            "mesh.tensor=1",
            "observe.rank_timing=false",
        ]
        run = _train(overrides, budget_s, cpu_only=True)
        return {
            "status": "smoke" if run["status"] == "ok" else "failed",
            "mfu_convention": MFU_CONVENTION,
            "tiny": run,
        }
    base = [
        "--config",
        "configs/llama_1b.yaml",
        "train.steps=12",
        "train.eval_every=0",
        "checkpoint.enabled=false",
        "model.compute_dtype=bfloat16",
        "mesh.data=1",
    ]
    runs = {
        profile: _train([*base, f"train.xla_profile={profile}"], budget_s / 2, False)
        for profile in ("none", "overlap")
    }
    result: dict[str, Any] = {
        "status": "ok" if all(r["status"] == "ok" for r in runs.values()) else "failed",
        "mfu_convention": MFU_CONVENTION,
        **runs,
    }
    if result["status"] == "ok":
        result["overlap_over_none"] = runs["overlap"]["tokens_per_s"] / runs["none"]["tokens_per_s"]
    return result


def checkpoint(smoke: bool, gpus: int, budget_s: float) -> dict[str, Any]:
    cpu_only = smoke or gpus == 0
    command = [sys.executable, "benchmarks/checkpoint_overhead.py"]
    command += ["--smoke"] if cpu_only else ["--steps", "16"]  # smoke: the same script, tiny
    result = _run(command, budget_s, cpu_only)
    out = result.stdout

    def number(pattern: str) -> float | None:
        match = re.search(pattern, out)
        return float(match[1].replace(",", "")) if match else None

    return {
        "status": "failed" if result.returncode != 0 else "smoke" if cpu_only else "ok",
        "ratio_with_saves": number(r"ratio \(with saves / without\)\s+([\d.]+)"),
        "restore_mb_per_s": number(r"restore onto the mesh\s+([\d,.]+) MB/s"),
        "save_mb_per_s": number(r"save, start to finalized on disk\s+([\d,.]+) MB/s"),
        "output": _tail(out, 12),
        "error_tail": "" if result.returncode == 0 else _tail(result.stderr),
    }


ASYNC_CHECK = """
import json, re, jax
from msjax.config import load_config
from msjax.planner.aot import compile_step
from msjax.planner.candidates import MeshShape
n = jax.device_count()
KINDS = "all-gather|all-reduce|reduce-scatter|collective-permute"
config = load_config(None, ["model.compute_dtype=bfloat16", "train.global_batch=%d" % (4 * n)])
text = compile_step(config, MeshShape(1, n, 1)).compiled.as_text()
pairs, overlapped = 0, 0
for body in re.split(r"\\n\\n", text):
    lines = body.splitlines()
    for i, line in enumerate(lines):
        start = re.search(r"%([\\w.\\-]+) = .* (" + KINDS + r")-start\\(", line)
        if not start:
            continue
        pairs += 1
        marker = "-done(%" + start[1] + ")"
        done = next((j for j in range(i + 1, len(lines)) if marker in lines[j]), None)
        between = lines[i + 1 : done] if done else []
        if any(" fusion(" in l or "custom-call(" in l or " dot(" in l for l in between):
            overlapped += 1
print(json.dumps({"devices": n, "async_pairs": pairs, "with_compute_between": overlapped}))
"""


def async_collectives(smoke: bool, gpus: int, budget_s: float) -> dict[str, Any]:
    if smoke or gpus < 2:
        return {"status": "skipped", "reason": "needs more than one GPU"}
    result = _run([sys.executable, "-c", ASYNC_CHECK], budget_s, False)
    if result.returncode != 0:
        return {"status": "failed", "error_tail": _tail(result.stderr)}
    found = json.loads(result.stdout.strip().splitlines()[-1])
    ok = found["async_pairs"] > 0 and found["with_compute_between"] > 0
    return {"status": "ok" if ok else "failed", **found}


PARTS: dict[str, Callable[[bool, int, float], dict[str, Any]]] = {
    "gpu_tests": gpu_tests,
    "kernels": kernels,
    "llama_1b": llama_1b,
    "checkpoint": checkpoint,
    "async_collectives": async_collectives,
}


def count_gpus() -> tuple[int, str]:
    """GPUs and their kind, asked of a child process so this one never holds the devices."""
    probe = (
        "import jax, json; gpus = [d for d in jax.devices() if d.platform == 'gpu'] "
        "if jax.default_backend() == 'gpu' else []; "
        "print(json.dumps([len(gpus), gpus[0].device_kind if gpus else 'cpu']))"
    )
    try:
        result = _run([sys.executable, "-c", probe], 120, False)
        count, kind = json.loads(result.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, ValueError):
        return 0, "unknown"
    return int(count), str(kind)


def run_part(name: str, smoke: bool, gpus: int) -> dict[str, Any]:
    """One part under its budget; an exception or a timeout is its result, not the suite's end."""
    # the budgets are set for a GPU; a smoke run's CPU (shared, in CI) gets three times as long
    budget_s = BUDGETS_S[name] * (3 if smoke else 1)
    started = time.perf_counter()
    try:
        result = PARTS[name](smoke, gpus, budget_s)
    except subprocess.TimeoutExpired:
        result = {"status": "timeout", "reason": f"over its {budget_s} s budget"}
    except Exception as error:  # a broken part is reported; the others still run
        result = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
    return {**result, "seconds": round(time.perf_counter() - started, 1), "budget_s": budget_s}


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{'part':<18} {'status':<8} {'s':>6}  result"]
    for name, part in report["parts"].items():
        if name == "llama_1b" and part["status"] == "ok":
            detail = (
                "; ".join(
                    f"{profile}: {part[profile]['tokens_per_s']:,.0f} tokens/s, MFU "
                    + (
                        "?"
                        if part[profile]["mfu"] is None
                        else f"{100 * part[profile]['mfu']:.1f}%"
                    )
                    for profile in ("none", "overlap")
                )
                + f"; overlap/none {part['overlap_over_none']:.3f}"
            )
        elif name == "llama_1b" and part["status"] == "smoke":
            detail = f"tiny config on CPU: {part['tiny']['tokens_per_s']:,.0f} tokens/s"
        elif name == "gpu_tests" and "summary" in part:
            detail = part["summary"]
        elif name == "checkpoint" and part["status"] in ("ok", "smoke"):
            detail = (
                f"tokens/s with saves / without {part['ratio_with_saves']}; restore "
                f"{part['restore_mb_per_s']} MB/s"
            )
        elif name == "async_collectives" and "async_pairs" in part:
            detail = (
                f"{part['with_compute_between']} of {part['async_pairs']} start/done pairs "
                "have compute between them"
            )
        else:
            detail = part.get("reason") or part.get("error") or ""
        lines.append(f"{name:<18} {part['status']:<8} {part['seconds']:>6.1f}  {detail}")
    if "mfu_convention" in report["parts"].get("llama_1b", {}):
        lines.append(f"MFU: {report['parts']['llama_1b']['mfu_convention']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU form; forced without a GPU")
    parser.add_argument("--out", type=Path, default=Path("gpu_suite.json"), help="the JSON")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset")
    args = parser.parse_args(argv)
    unknown = [name for name in args.parts.split(",") if name not in PARTS]
    if unknown:
        parser.error(f"unknown part {unknown[0]!r}; accepted: {', '.join(PARTS)}")
    started = time.perf_counter()
    gpus, kind = (0, "cpu") if args.smoke else count_gpus()
    smoke = args.smoke or gpus == 0
    report: dict[str, Any] = {"smoke": smoke, "gpus": gpus, "device_kind": kind, "parts": {}}
    for name in args.parts.split(","):
        report["parts"][name] = run_part(name, smoke, gpus)
        print(f"{name}: {report['parts'][name]['status']}", flush=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    print(f"{report['seconds']:.0f} s; JSON in {args.out}")
    return report


if __name__ == "__main__":
    main()
