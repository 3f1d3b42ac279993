"""Bad input to every msjax command: exit code 2, one line on stderr, no traceback, no file made.

Each case runs the real command as a subprocess (the commands answer before JAX starts, so each
costs well under a second of CPU), except msjax.plan and msjax.sweep, whose modules import JAX:
their cases share one interpreter per command, stderr captured at the file-descriptor level.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness import job_env

# (command, arguments, what the one line must say); {tmp} is the test's folder.
CASES: list[tuple[str, list[str], str]] = [
    ("msjax.train", ["--no-such-flag"], "unrecognized arguments"),
    ("msjax.train", ["--config", "{tmp}/missing.yaml"], "not found"),
    ("msjax.train", ["--config", "{tmp}/latin1.yaml"], "not UTF-8"),
    ("msjax.train", ["--config", "{tmp}/list.yaml"], "mapping of sections"),
    ("msjax.train", ["--config", "{tmp}/broken.yaml"], "not valid YAML"),
    ("msjax.train", ["nosection.key=1"], "unknown config section"),
    ("msjax.train", ["model.no_such_key=1"], "unknown config key"),
    ("msjax.train", ["model.rope_theta=0.5"], "model.rope_theta=0.5 must be greater than 1"),
    ("msjax.train", ["model.norm_eps=0"], "model.norm_eps=0.0 must be in (0, 1)"),
    ("msjax.train", ["model.init_std=-0.02"], "model.init_std=-0.02 must be in (0, 1]"),
    ("msjax.train", ["optim.b1=1"], "optim.b1=1.0 must be in [0, 1)"),
    ("msjax.train", ["optim.b2=-0.5"], "optim.b2=-0.5 must be in [0, 1)"),
    ("msjax.train", ["optim.eps=0"], "optim.eps=0.0 must be positive"),
    ("msjax.train", ["optim.weight_decay=-1"], "optim.weight_decay=-1.0 must be >= 0"),
    ("msjax.train", ["optim.final_lr_fraction=2"], "optim.final_lr_fraction=2.0 must be in"),
    ("msjax.train", ["optim.grad_clip_norm=0"], "optim.grad_clip_norm=0.0 must be positive"),
    ("msjax.train", ["run.seed=-1"], "run.seed=-1 must be in [0, 4294967295]"),
    ("msjax.train", ["train.steps=3000000000"], "train.steps=3000000000 is out of range"),
    ("msjax.train", ["train.global_batch=1e3"], "must be an integer"),
    ("msjax.train", ["optim.learning_rate=nan"], "must be a finite number"),
    ("msjax.train", ["run.dir={tmp}/a_file"], "exists and is not a directory"),
    ("msjax.train", ["run.dir={tmp}/a_file/run"], "which is a file, not a directory"),
    ("msjax.train", ["data.cache_dir=/proc/msjax-cache"], "/proc is not writable"),
    ("msjax.train", ["run.dir={tmp}/foreign"], "holds no msjax run"),
    ("msjax.train", ["run.name=../escape"], "run.name='../escape' must be a plain name"),
    ("msjax.train", ["data.sources={tmp}/nowhere/*.jsonl"], "matches no files"),
    ("msjax.train", ["data.tokenizer={tmp}/missing.model"], "data.tokenizer="),
    (
        "msjax.train",
        ["checkpoint.resume_from={tmp}/foreign", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"],
        "no finished checkpoint in",
    ),
    ("msjax.launch", ["--nprocs", "0"], "need nprocs >= 1"),
    ("msjax.launch", ["--", "data.sources={tmp}/missing.txt"], "no such file"),
    ("msjax.launch", ["--nprocs", "two"], "invalid int value: 'two'"),
    ("msjax.launch", ["--", "optim.b1=2"], "optim.b1=2.0 must be in [0, 1)"),
    ("msjax.launch", ["--", "--config", "{tmp}/latin1.yaml"], "not UTF-8"),
    ("msjax.launch", ["--", "run.dir={tmp}/a_file/run"], "which is a file"),
    ("msjax.launch", ["--", "run.dir={tmp}/foreign"], "holds no msjax run"),
    (
        "msjax.launch",
        ["--", "resilience.compile_cache_dir=/proc/msjax-compile"],
        "resilience.compile_cache_dir=/proc/msjax-compile cannot be created",
    ),
    ("msjax.launch", ["--fault", "explode@never"], "must look like KIND@step=K,rank=R"),
    ("msjax.checkpoint", [], "required: command"),
    ("msjax.checkpoint", ["frobnicate"], "invalid choice: 'frobnicate'"),
    ("msjax.checkpoint", ["list"], "required: run_dir"),
    ("msjax.checkpoint", ["list", "{tmp}/nowhere"], "no checkpoints directory"),
    ("msjax.checkpoint", ["inspect", "{tmp}/foreign"], "not a checkpoint step directory"),
    ("msjax.report", [], "required: RUN_DIR"),
    ("msjax.report", ["{tmp}/nowhere"], "nowhere"),
    ("msjax.flops", ["--devices", "x"], "invalid int value: 'x'"),
    ("msjax.flops", ["--step-time", "1.0"], "--step-time needs --devices"),
    ("msjax.flops", ["optim.eps=-1"], "optim.eps=-1.0 must be positive"),
    # the coordinator address (a mistake there is no crash for the supervisor to retry)
    (
        "msjax.launch",
        ["--nnodes", "2", "--coordinator", "node001", "--max-restarts", "0"],
        "--coordinator='node001' is not HOST:PORT",
    ),
    (
        "msjax.launch",
        ["--coordinator", "127.0.0.1:99999", "--max-restarts", "0"],
        "the port must be a whole number in [1, 65535]",
    ),
    # supervisor: restarts without progress, and one run dir for every node
    (
        "msjax.launch",
        ["--", "resilience.max_attempts_without_progress=0"],
        "resilience.max_attempts_without_progress=0 must be >= 1",
    ),
    (
        "msjax.launch",
        ["--nnodes=2", "--node-rank=1", "--coordinator=127.0.0.1:29999"],
        "--nnodes=2 needs run.dir=PATH, the same on every node",
    ),
    # run directories msjax did not write, or with links in them
    ("msjax.train", ["run.dir={tmp}/run_config_folder"], "its config.yaml is a folder"),
    ("msjax.launch", ["--", "run.dir={tmp}/run_config_folder"], "its config.yaml is a folder"),
    ("msjax.train", ["run.dir={tmp}/run_latin1"], "its config.yaml is not UTF-8"),
    ("msjax.launch", ["--", "run.dir={tmp}/run_latin1"], "its config.yaml is not UTF-8"),
    (
        "msjax.train",
        ["run.dir={tmp}/run_foreign_config", "run.overwrite=true"],
        "holds a config.yaml that msjax did not write",
    ),
    ("msjax.train", ["run.dir={tmp}/run_link"], "metrics.jsonl is a symbolic link"),
    ("msjax.launch", ["--", "run.dir={tmp}/run_link"], "metrics.jsonl is a symbolic link"),
    ("msjax.report", ["{tmp}/run_link"], "metrics.jsonl: it is a symbolic link"),
    # heartbeats: more often than every phase's hang deadline
    (
        "msjax.train",
        ["resilience.heartbeat_every_s=5", "resilience.data_deadline_s=2"],
        "resilience.heartbeat_every_s=5.0 must be shorter than resilience.data_deadline_s=2.0",
    ),
    (
        "msjax.launch",
        ["--", "resilience.heartbeat_every_s=5", "resilience.restore_deadline_s=5"],
        "resilience.heartbeat_every_s=5.0 must be shorter than resilience.restore_deadline_s=5.0",
    ),
    # files someone hands msjax: Hugging Face directories, generation inputs, export targets
    (
        "msjax.train",
        ["model.init_from=hf:{tmp}/hf_half_layer", "model.from_hf=true"],
        "num_hidden_layers=2.5; it must be a positive integer",
    ),
    (
        "msjax.train",
        ["model.init_from=hf:{tmp}/hf_fifo", "model.from_hf=true"],
        "which is not a regular file",
    ),
    (
        "msjax.launch",
        ["--", "model.init_from=hf:{tmp}/hf_escape", "model.from_hf=true"],
        'weight_map names "../outside.safetensors"; each entry must be a plain file name',
    ),
    (
        "msjax.launch",
        ["--", "model.init_from=hf:{tmp}/hf_string_bool", "model.from_hf=true"],
        'tie_word_embeddings="false"; it must be true or false',
    ),
    ("msjax.generate", ["{tmp}/foreign", "--prompt", "x", "--temperature", "inf"], "finite"),
    ("msjax.generate", ["{tmp}/foreign", "--prompt", "x", "--temperature", "nan"], "finite"),
    (
        "msjax.generate",
        ["{tmp}/foreign", "--prompt", "x", "--seed", "4294967296"],
        "--seed=4294967296 must be in [0, 4294967295]",
    ),
    ("msjax.generate", ["{tmp}/foreign", "--prompt", "x", "--top-k", "-3"], "--top-k=-3 must be"),
    ("msjax.generate", ["{tmp}/foreign", "--prompt", "caf\udce9"], "--prompt is not UTF-8"),
    ("msjax.hf", ["export", "{tmp}/foreign", "{tmp}/link_out"], "is a symbolic link"),
    # gradient accumulation (tiny's mesh: 16 / (data 2 x fsdp 2) = 4 rows per replica)
    ("msjax.train", ["train.grad_accum_steps=3"], "train.grad_accum_steps=3 does not divide"),
    (
        "msjax.train",
        ["mesh.tensor=1", "mesh.pipe=2", "train.grad_accum_steps=4", "pipeline.microbatches=2"],
        "/ train.grad_accum_steps = 1) is not divisible by pipeline.microbatches=2",
    ),
    # measured hang deadlines
    (
        "msjax.launch",
        ["--", "resilience.measured_deadline_factor=0.5"],
        "measured_deadline_factor=0.5 must be 0 (configured deadlines only) or at least 1",
    ),
    (
        "msjax.train",
        ["resilience.measured_deadline_after_steps=0"],
        "resilience.measured_deadline_after_steps=0 must be at least 1",
    ),
    # bad slots
    (
        "msjax.launch",
        ["--", "resilience.max_faults_per_slot=0"],
        "resilience.max_faults_per_slot=0 must be >= 1",
    ),
    ("msjax.launch", ["--", "resilience.on_bad_node=drop"], "resilience.on_bad_node"),
    # self-checks (msjax.doctor, resilience.check_budget_s)
    ("msjax.doctor", ["--nprocs", "0"], "--nprocs=0 must be at least 1"),
    ("msjax.doctor", ["--fault", "corrupt_compute@rank=x"], "needs a number"),
    ("msjax.doctor", ["--nprocs", "2", "--devices-per-proc", "2"], "has 8 devices but 4"),
    ("msjax.doctor", ["--", "resilience.check_budget_s=-1"], "check_budget_s=-1.0 must be >= 0"),
    ("msjax.train", ["resilience.slow_device_factor=1"], "slow_device_factor=1.0 must be a"),
    # excluding a bad slot on one node: spares, re-admission
    ("msjax.launch", ["--spares", "-1"], "--spares=-1: give a count >= 0"),
    ("msjax.launch", ["--spares", "1", "--nnodes", "2"], "on one node (--nnodes 1)"),
    ("msjax.train", ["resilience.readmit_after_s=-1"], "readmit_after_s=-1.0 must be >= 0"),
    # the corruption guard
    ("msjax.train", ["resilience.replica_check_every=-1"], "replica_check_every=-1 must be >= 0"),
    ("msjax.train", ["resilience.on_corruption=retry"], "resilience.on_corruption"),
    ("msjax.train", ["resilience.compute_check_every=-1"], "compute_check_every=-1 must be >= 0"),
]
# Commands whose module imports JAX: their cases share one interpreter.
IN_ONE_INTERPRETER: dict[str, list[tuple[list[str], str]]] = {
    "msjax.planner.plan": [
        (["--devices", "0"], "--devices=0 must be positive"),
        (["--devices", "eight"], "invalid int value: 'eight'"),
        (["--devices", "8", "model.rope_theta=1"], "model.rope_theta=1.0 must be greater"),
        (["--devices", "8", "--config", "{tmp}/latin1.yaml"], "not UTF-8"),
    ],
    "msjax.planner.sweep": [
        (["--steps", "0"], "--steps=0 must be at least 1"),
        (["--no-such-flag"], "unrecognized arguments"),
        (["optim.b2=1.5"], "optim.b2=1.5 must be in [0, 1)"),
    ],
}

# Runs main(argv) for each case; prints [exit code, stderr] per case as JSON.
DRIVER = """
import importlib, json, os, sys, tempfile, traceback
main = importlib.import_module(sys.argv[1]).main
results = []
for argv in json.loads(sys.argv[2]):
    captured = tempfile.TemporaryFile()
    saved = os.dup(2)
    os.dup2(captured.fileno(), 2)
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        traceback.print_exc()
        code = "raised"
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
    captured.seek(0)
    results.append([code, captured.read().decode(errors="replace")])
print(json.dumps(results))
"""


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and modification time."""
    found = {}
    for path in sorted(root.rglob("*")):
        stat = path.lstat()
        found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return found


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A folder with the inputs the cases refer to, and an environment that keeps every default
    output location (runs/, the corpus cache, home) inside it."""
    tmp = tmp_path_factory.mktemp("bad_inputs")
    (tmp / "latin1.yaml").write_bytes("model:\n  name: caf\xe9\n".encode("latin-1"))
    (tmp / "list.yaml").write_text("- model\n- data\n")
    (tmp / "broken.yaml").write_text("model: {embed_dim: 64\n")
    (tmp / "a_file").write_text("not a directory\n")
    (tmp / "foreign").mkdir()
    (tmp / "foreign" / "notes.txt").write_text("someone else's\n")
    (tmp / "run_config_folder" / "config.yaml").mkdir(parents=True)
    (tmp / "run_latin1").mkdir()
    (tmp / "run_latin1" / "config.yaml").write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    (tmp / "run_foreign_config").mkdir()
    (tmp / "run_foreign_config" / "config.yaml").write_text("services: {web: {image: nginx}}\n")
    (tmp / "run_link").mkdir()
    (tmp / "run_link" / "metrics.jsonl").symlink_to(tmp / "a_file")
    llama = {
        "model_type": "llama",
        "vocab_size": 264,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
    }
    hf_dirs = {
        "hf_half_layer": ({"num_hidden_layers": 2.5}, None),
        "hf_string_bool": ({"tie_word_embeddings": "false"}, None),
        "hf_escape": ({}, "../outside.safetensors"),
        "hf_fifo": ({}, "weights.safetensors"),
    }
    for name, (change, weight_file) in hf_dirs.items():
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps({**llama, **change}))
        if weight_file is not None:
            index = {"weight_map": {"model.embed_tokens.weight": weight_file}}
            (tmp / name / "model.safetensors.index.json").write_text(json.dumps(index))
    os.mkfifo(tmp / "hf_fifo" / "weights.safetensors")
    (tmp / "link_out").symlink_to(tmp / "no_export_here")
    env = job_env(HOME=str(tmp / "home"), MSJAX_CACHE_DIR=str(tmp / "cache"), JAX_PLATFORMS="cpu")
    return tmp, env


def check_one_line(code: object, stderr: str, expected: str, label: str) -> None:
    lines = stderr.splitlines()
    assert code == 2, f"{label}: exit code {code}, stderr {stderr!r}"
    assert len(lines) == 1, f"{label}: {len(lines)} stderr lines: {stderr!r}"
    assert "Traceback" not in stderr, f"{label}: {stderr!r}"
    assert lines[0].startswith(label.split()[0] + ": error: "), f"{label}: {lines[0]!r}"
    assert expected in lines[0], f"{label}: {expected!r} not in {lines[0]!r}"


def run_case(command: str, argv: list[str], tmp: Path, env: dict[str, str]) -> tuple[int, str]:
    """One case as its own process: (exit code, stderr); stdout must stay empty."""
    result = subprocess.run(
        [sys.executable, "-m", command, *argv],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.stdout == "", f"{command} {argv}: stdout {result.stdout!r}"
    return result.returncode, result.stderr


def run_in_one_interpreter(
    module: str, argvs: list[list[str]], tmp: Path, env: dict[str, str]
) -> list[tuple[int, str]]:
    """Several cases of one command in one process: [(exit code, stderr)] per case."""
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, module, json.dumps(argvs)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [tuple(outcome) for outcome in json.loads(result.stdout.splitlines()[-1])]


def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    workspace: tuple[Path, dict[str, str]],
) -> None:
    """Every case, the processes run a few at a time (they mostly wait for imports)."""
    tmp, env = workspace
    fill = lambda argv: [argument.replace("{tmp}", str(tmp)) for argument in argv]  # noqa: E731
    before = tree(tmp)
    with ThreadPoolExecutor(max_workers=4) as pool:
        batched = {
            module: pool.submit(
                run_in_one_interpreter, module, [fill(argv) for argv, _ in cases], tmp, env
            )
            for module, cases in IN_ONE_INTERPRETER.items()
        }
        single = [
            (
                command,
                fill(arguments),
                expected,
                pool.submit(run_case, command, fill(arguments), tmp, env),
            )
            for command, arguments, expected in CASES
        ]
        failures = []
        for command, argv, expected, outcome in single:
            try:
                check_one_line(*outcome.result(), expected, f"{command} {' '.join(argv)}")
            except AssertionError as error:
                failures.append(str(error).splitlines()[0])
        for module, outcomes in batched.items():
            command = module.replace("planner.", "")
            for (argv, expected), (code, stderr) in zip(
                IN_ONE_INTERPRETER[module], outcomes.result(), strict=True
            ):
                try:
                    check_one_line(code, stderr, expected, f"{command} {' '.join(fill(argv))}")
                except AssertionError as error:
                    failures.append(str(error).splitlines()[0])
    assert not failures, "\n".join(failures)
    assert tree(tmp) == before


def test_the_table_covers_every_command() -> None:
    commands = {command for command, _, _ in CASES}
    commands |= {module.replace("planner.", "") for module in IN_ONE_INTERPRETER}
    assert commands == {f"msjax.{name}" for name in (
        "train", "launch", "checkpoint", "report", "flops", "plan", "sweep", "generate", "hf",
        "doctor",
    )}  # fmt: skip
    assert len(CASES) + sum(map(len, IN_ONE_INTERPRETER.values())) >= 25
