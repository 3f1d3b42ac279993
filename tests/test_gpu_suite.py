"""benchmarks/gpu_suite.py in its CPU smoke form: one JSON with every part skipped or smoke."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = {"gpu_tests", "kernels", "llama_1b", "checkpoint", "async_collectives"}


def test_gpu_suite_smoke_runs_on_cpu_and_marks_every_part(tmp_path: Path) -> None:
    out = tmp_path / "suite.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--smoke", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["smoke"] is True and set(report["parts"]) == PARTS
    statuses = {name: part["status"] for name, part in report["parts"].items()}
    assert set(statuses.values()) <= {"skipped", "smoke"}, statuses
    tiny = report["parts"]["llama_1b"]
    assert statuses["llama_1b"] == "smoke" and tiny["tiny"]["tokens_per_s"] > 0
    assert tiny["tiny"]["xla_profile_applied"] is False  # overlap is a no-op on CPU
    assert report["seconds"] < 90  # under a minute on an idle machine
    assert "llama_1b" in result.stdout and "JSON in" in result.stdout


def test_gpu_suite_rejects_an_unknown_part_with_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--smoke", "--parts", "kernels,speed"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "unknown part 'speed'; accepted: gpu_tests, kernels" in result.stderr
