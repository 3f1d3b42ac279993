"""The parts of benchmarks/gpu_suite.py, each run in its own process by the suite:

    python benchmarks/gpu_parts.py PART --out-dir OUTDIR [--smoke] [--hang]

A part prints its results as `ROW {json}` lines, each flushed as soon as it is known, so the
suite keeps every finished row of a part it kills at its time budget. `--smoke` is the CPU form:
tiny shapes, the Pallas interpreter, seconds a part; its numbers mean nothing. `--hang` is the
suite's fault injector: the part prints its rows, then blocks until it is killed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
ROW_PREFIX = "ROW "
WARMUP_STEPS = 5  # left out of a llama run's tokens/s and MFU: compile and first allocations
LLAMA_STEPS = 20
# llama_1b's attention: batch, seq, heads, kv heads, head_dim; then the same heads at 16k tokens
# and llama_1b's shape again with 3 packed documents a row (segment ids), in this order
ATTENTION_CASES = {
    "llama_1b": ((8, 2048, 32, 8, 64), 1),
    "seq16k": ((1, 16384, 32, 8, 64), 1),
    "llama_1b_packed": ((8, 2048, 32, 8, 64), 3),
}
SMOKE_ATTENTION_CASES = {
    "llama_1b": ((1, 64, 4, 2, 16), 1),
    "llama_1b_packed": ((1, 64, 4, 2, 16), 3),
}
XLA_ATTENTION_MAX_SEQ = 8192  # XLA's reference holds f32 [seq, seq] scores: 34 GB a row at 16k
LLAMA_IMPLS = {  # model.{attention,norm,loss}_impl of each llama_1b run
    "xla": ("xla", "xla", "xla"),
    "pallas": ("pallas", "pallas", "pallas"),
    "cudnn": ("cudnn", "xla", "xla"),
}


def emit(**row: Any) -> None:
    """One result row for the suite, flushed at once."""
    print(ROW_PREFIX + json.dumps(row, default=str), flush=True)


def read_rows(out_dir: Path, part: str) -> list[dict[str, Any]]:
    """The rows an earlier part left in OUTDIR/gpu.jsonl (empty if it has none)."""
    path = out_dir / "gpu.jsonl"
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("part") == part:
            return record.get("rows", [])
    return []


# ---- versions and ceilings ----------------------------------------------------------------------


def versions(smoke: bool, out_dir: Path) -> None:
    import importlib.metadata

    import jax

    packages = ["jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax", "optax"]
    packages += ["orbax-checkpoint", "grain", "triton", "jax-triton", "numpy"]
    found = {}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    cudnn = None
    try:
        from jax._src.lib import cuda_versions

        cudnn = cuda_versions.cudnn_get_version() if cuda_versions else None
    except (ImportError, AttributeError, RuntimeError):
        pass
    device = jax.devices()[0]
    emit(
        kind="versions",
        python=sys.version.split()[0],
        packages=found,
        cudnn=cudnn,
        backend=jax.default_backend(),
        device_kind=device.device_kind,
        device_count=jax.device_count(),
    )
    query = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit"
    try:
        smi = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        smi = None
    emit(kind="nvidia_smi", query=query, values=smi)


def ceilings(smoke: bool, out_dir: Path) -> None:
    """Measured denominators: a bf16 matmul's TFLOP/s and a device copy's GB/s."""
    import jax
    import jax.numpy as jnp

    from benchmarks.kernel_timing import SMOKE_TIMING, Timing, time_ms

    timing = SMOKE_TIMING if smoke else Timing()
    n = 256 if smoke else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    ms = time_ms(jax.jit(jnp.dot), a, a, timing=timing)
    emit(kind="matmul_bf16", n=n, ms=ms, tflops=2 * n**3 / ms / 1e9)
    rows, cols = (256, 8192) if smoke else (32768, 65536)  # 4 GiB of bf16 on a GPU
    x = jnp.ones((rows, cols), jnp.bfloat16)
    ms = time_ms(jax.jit(lambda x: x * 2), x, timing=timing)
    emit(kind="copy", bytes=x.nbytes, ms=ms, gb_per_s=2 * x.nbytes / ms / 1e6)  # read + write


# ---- attention ----------------------------------------------------------------------------------


def attention(smoke: bool, out_dir: Path) -> None:
    """Flash attention against cuDNN and XLA: error, forward and backward TFLOP/s."""
    import jax

    from benchmarks.attention_timing import attention_rows
    from benchmarks.kernel_timing import SMOKE_TIMING, Timing

    on_gpu = jax.default_backend() == "gpu"
    cases = SMOKE_ATTENTION_CASES if smoke else ATTENTION_CASES
    timing = SMOKE_TIMING if smoke else Timing()
    for case, (shape, documents) in cases.items():
        impls = ["pallas", "cudnn"] if on_gpu else ["pallas"]
        if shape[1] < XLA_ATTENTION_MAX_SEQ and documents == 1:
            impls.append("xla")
        for row in attention_rows(shape, impls, timing, on_gpu, documents):
            emit(kind="attention", case=case, **row)


# ---- llama_1b -----------------------------------------------------------------------------------


def llama_overrides(smoke: bool, impls: tuple[str, str, str]) -> list[str]:
    attention_impl, norm_impl, loss_impl = impls
    common = [
        f"model.attention_impl={attention_impl}",
        f"model.norm_impl={norm_impl}",
        f"model.loss_impl={loss_impl}",
        "train.eval_every=0",
        "checkpoint.enabled=false",
        "train.xla_profile=none",
        "observe.rank_timing=false",
        "mesh.data=1",
        "mesh.fsdp=1",
        "mesh.tensor=1",
    ]
    if smoke:
        from benchmarks.smoke import TINY_CORPUS, TINY_MODEL, TINY_SEQ_LEN

        tiny = [*TINY_MODEL, *TINY_CORPUS, f"data.seq_len={TINY_SEQ_LEN}", "train.global_batch=2"]
        return [*common, *tiny, "train.steps=3", "train.peak_tflops=0.5"]
    return [
        "--config",
        "configs/llama_1b.yaml",
        *common,
        f"train.steps={LLAMA_STEPS}",
        "data.max_corpus_mib=4",
    ]


def llama_run(name: str) -> Callable[[bool, Path], None]:
    """A part that trains llama_1b (the tiny config in smoke) with LLAMA_IMPLS[name]."""

    def run(smoke: bool, out_dir: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="msjax-gpu-suite-") as root:
            run_dir = Path(root) / "run"
            emit(kind="run_dir", path=str(run_dir))  # read by the suite if this part times out
            command = [
                sys.executable,
                "-m",
                "msjax.train",
                *llama_overrides(smoke, LLAMA_IMPLS[name]),
            ]
            result = subprocess.run(
                [*command, f"run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True
            )
            if result.returncode != 0:
                emit(
                    kind="llama_1b",
                    impls=name,
                    exit_code=result.returncode,
                    stderr_tail=result.stderr[-3000:],
                )
                raise SystemExit(1)
            metrics = (run_dir / "metrics.jsonl").read_text()
        (out_dir / f"llama_{name}.metrics.jsonl").write_text(metrics)
        records = [json.loads(line) for line in metrics.splitlines()]
        emit(kind="llama_1b", impls=name, **llama_summary(records, smoke, out_dir))

    return run


def llama_summary(records: list[dict[str, Any]], smoke: bool, out_dir: Path) -> dict[str, Any]:
    """Median tokens/s (p10, p90) and MFU past the warm-up; MFU against the measured ceiling."""
    from msjax.observe.flops import peak_tflops_for_device_kind

    steps = [r for r in records if "tokens_per_s" in r]
    kept = steps[WARMUP_STEPS:] if len(steps) > WARMUP_STEPS else steps[-1:]
    rates = sorted(r["tokens_per_s"] for r in kept)
    mfu = statistics.median(r["mfu"] for r in kept) if kept[0].get("mfu") is not None else None
    summary: dict[str, Any] = {
        "steps_measured": len(kept),
        "first_step_s": steps[0]["step_time_s"],  # mostly compilation
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_p10": rates[len(rates) // 10],
        "tokens_per_s_p90": rates[(9 * len(rates)) // 10],
        "mfu_of_datasheet_peak": mfu,
        "losses": {r["step"]: r["loss"] for r in steps},
    }
    device = next((r for r in read_rows(out_dir, "versions") if r["kind"] == "versions"), None)
    peak = None if smoke or device is None else peak_tflops_for_device_kind(device["device_kind"])
    matmul = next((r for r in read_rows(out_dir, "ceilings") if r["kind"] == "matmul_bf16"), None)
    if mfu is not None and peak:
        summary["datasheet_peak_tflops"] = peak
        summary["model_tflops_per_s"] = mfu * peak
        if matmul:
            summary["measured_matmul_tflops"] = matmul["tflops"]
            summary["mfu_of_measured_matmul_ceiling"] = mfu * peak / matmul["tflops"]
    return summary


def loss_differences(out_dir: Path, name: str) -> dict[str, float] | None:
    """Per-step |loss - the all-XLA run's loss|: the end-to-end kernel check (same seed, data)."""
    xla = next((r for r in read_rows(out_dir, "llama_xla") if r["kind"] == "llama_1b"), None)
    this = out_dir / f"llama_{name}.metrics.jsonl"
    if xla is None or not this.exists():
        return None
    records = [json.loads(line) for line in this.read_text().splitlines()]
    losses = {str(r["step"]): r["loss"] for r in records if "loss" in r}
    return {
        step: abs(loss - xla["losses"][step])
        for step, loss in losses.items()
        if step in xla["losses"]
    }


# ---- checkpoint ---------------------------------------------------------------------------------


def checkpoint(smoke: bool, out_dir: Path) -> None:
    """llama_1b's whole state (14.8 GB) saved, restored and saved again, in GB/s: one row per
    phase, passed on as it ends."""
    from benchmarks.smoke import TINY_MODEL

    config = "configs/tiny.yaml" if smoke else "configs/llama_1b.yaml"
    overrides = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", *(TINY_MODEL if smoke else [])]
    command = [sys.executable, "benchmarks/checkpoint_overhead.py", "--save-restore-only", config]
    other_lines: collections.deque[str] = collections.deque(maxlen=40)
    with subprocess.Popen(
        [*command, *overrides],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one pipe, read to its end: neither can fill up and block
        text=True,
    ) as process:
        for line in process.stdout:
            if line.startswith('{"config"'):
                emit(kind="checkpoint", **json.loads(line))
            else:
                other_lines.append(line)
    if process.returncode != 0:
        tail = "".join(other_lines)[-3000:]
        emit(kind="checkpoint", exit_code=process.returncode, output_tail=tail)
        raise SystemExit(1)


# ---- the compiled kernels' tests ----------------------------------------------------------------


def gpu_tests(smoke: bool, out_dir: Path) -> None:
    # in this process alone, without the repository's addopts (two xdist workers, a plugin the
    # kit's wheels do not carry; one GPU is not for two processes)
    command = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-m", "gpu"]
    command += ["-p", "no:cacheprovider"]
    result = subprocess.run(
        [*command, "tests/unit/test_gpu_kernels.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    emit(kind="pytest", exit_code=result.returncode, tail=result.stdout[-3000:])


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


def async_collectives(smoke: bool, out_dir: Path) -> None:
    """With more than one GPU: whether the compiled step's collectives are async (start/done
    pairs with compute between them)."""
    result = subprocess.run(
        [sys.executable, "-c", ASYNC_CHECK], cwd=REPO, capture_output=True, text=True
    )
    if result.returncode != 0:
        emit(
            kind="async_collectives", exit_code=result.returncode, stderr_tail=result.stderr[-3000:]
        )
        raise SystemExit(1)
    emit(kind="async_collectives", **json.loads(result.stdout.strip().splitlines()[-1]))


PARTS: dict[str, Callable[[bool, Path], None]] = {
    "versions": versions,
    "ceilings": ceilings,
    "attention": attention,
    "llama_xla": llama_run("xla"),
    "llama_pallas": llama_run("pallas"),
    "checkpoint": checkpoint,
    "llama_cudnn": llama_run("cudnn"),
    "gpu_tests": gpu_tests,
    "async_collectives": async_collectives,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=list(PARTS))
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--hang", action="store_true", help="block after the rows (tests)")
    args = parser.parse_args(argv)
    emit(kind="started", part=args.part, pid=os.getpid())
    PARTS[args.part](args.smoke, args.out_dir)
    if args.part.startswith("llama_") and args.part != "llama_xla":
        emit(kind="loss_vs_xla", abs_difference=loss_differences(args.out_dir, args.part[6:]))
    if args.hang:
        signal.pause()  # until the suite kills this part at its budget


if __name__ == "__main__":
    main()
