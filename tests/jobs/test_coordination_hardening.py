"""The coordination service is not a way in, and mistakes found after start-up are user errors.

A real two-process `jax.distributed` job, joined as msjax's workers join theirs: keys forged by
another client of its coordination service (an extra voter, an unsealed job-end record with a
code of the forger's choosing) are ignored, a genuine job end still ends it, and both processes
use process 0's skip list. Around it: a bad coordinator, port, skip list or XLA flag is one line
and exit 2 on the first attempt, never a crash the supervisor retries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import Job, free_port, job_env, kill_all, run_to_end
from small_runs import QUICK_RUN
from test_bad_inputs import check_one_line

from msjax.distributed import JOB_SECRET, ensure_job_secret, worker_env
from msjax.resilience import exit_codes

TIMEOUT_S = 300

# One worker of the job. argv: the folder holding each process's own view of two run dirs.
WORKER = r"""
import json, sys, time
from pathlib import Path
from msjax.distributed import JobEnv, initialize_distributed
initialize_distributed(JobEnv.read())
import jax
from jax._src.distributed import global_state
from msjax.errors import MsjaxError
from msjax.parallel.agreement import ProcessVote, agree_any
from msjax.resilience.job_end import ERROR_KEY, leave_job_now, watch_for_peer_exit
from msjax.resilience.skips import read_skipped_steps

rank = jax.process_index()
views = Path(sys.argv[1]) / f"rank{rank}"  # this process's view of the run dirs
watch_for_peer_exit("worker")
seen = {}

def attempt(name, read):
    try:
        seen[name] = read()
    except MsjaxError as error:
        seen[name] = "MsjaxError: " + str(error)
    except Exception as error:
        seen[name] = f"{type(error).__name__}: {error}"

attempt("differing skip lists", lambda: sorted(read_skipped_steps(views / "differing")))
attempt("skip list garbled at process 0", lambda: sorted(read_skipped_steps(views / "garbled")))

client = global_state.client  # the same client any other local user could build
if rank == 1:
    client.key_value_set(ERROR_KEY, json.dumps({"code": 42, "rank": 1, "reason": "forged"}))
    client.key_value_set("msjax/vote/forged/0/7", "1")  # an eighth voter in a 2-process job
    client.key_value_set("msjax/vote/forged/0/1/extra", "1")
vote = ProcessVote("forged")
attempt("vote with forged keys", lambda: agree_any(vote, False))
attempt("next vote", lambda: agree_any(vote, rank == 1))
time.sleep(3)  # the job-end watch looks every second: a forged record would have ended us
print(json.dumps(seen), flush=True)
if rank == 1:
    time.sleep(1)
    leave_job_now(9, "a real failure")  # sealed: process 0 must leave with 9
time.sleep(60)
print("process 0 was not ended by process 1's job end", flush=True)
"""


def write_skip_list(run_dir: Path, content: str | list[int]) -> None:
    run_dir.mkdir(parents=True)
    text = (
        content
        if isinstance(content, str)
        else json.dumps(
            {
                "skipped": [
                    {"step": step, "reason": "test", "recorded_unix_s": 0} for step in content
                ]
            }
        )
    )
    (run_dir / "skipped_steps.json").write_text(text)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, str]]:
    """The two processes' (exit code, output)."""
    views = tmp_path_factory.mktemp("views")
    # as a stale mount would show them: process 1 sees another skip list than process 0
    write_skip_list(views / "rank0" / "differing", [3, 5])
    write_skip_list(views / "rank1" / "differing", [4])
    write_skip_list(views / "rank0" / "garbled", '{"skipped": [{"step": "three"}]}')
    write_skip_list(views / "rank1" / "garbled", [2])
    port = free_port()
    processes = []
    for rank in range(2):
        env = job_env(
            JAX_NUM_CPU_DEVICES="1",
            **worker_env(f"127.0.0.1:{port}", 2, rank, 0),
            **{JOB_SECRET: "the secret msjax.launch hands its workers"},
        )
        command = [sys.executable, "-c", WORKER, str(views)]
        processes.append(Job(command, views, views / f"process{rank}.log", env))
    try:
        ended = [process.finish(TIMEOUT_S) for process in processes]
    finally:
        kill_all(processes)
    return [(process.exit_code, process.output) for process in ended]


def seen_by(job: list[tuple[int, str]], rank: int) -> dict:
    output = job[rank][1]
    records = [line for line in output.splitlines() if line.startswith("{")]
    assert records, f"process {rank} printed no results:\n{output[-3000:]}"
    return json.loads(records[-1])


def test_votes_count_only_the_job_s_own_ranks(job):
    for rank in range(2):
        seen = seen_by(job, rank)
        assert seen["vote with forged keys"] is False, (rank, seen)
        assert seen["next vote"] is True, (rank, seen)


def test_a_forged_job_end_record_is_ignored_and_a_genuine_one_still_ends_the_job(job):
    (code_0, output_0), (code_1, _) = job
    assert "vote with forged keys" in seen_by(job, 0)  # process 0 lived past the forgery
    assert "ignored a job-end record" in output_0
    assert "exit code 42" not in output_0
    assert (code_0, code_1) == (9, 9), output_0[-3000:]
    assert "process 1 ended the job with exit code 9: a real failure" in output_0
    assert "was not ended" not in output_0


def test_every_process_uses_process_0s_skip_list(job):
    assert seen_by(job, 0)["differing skip lists"] == [3, 5]
    assert seen_by(job, 1)["differing skip lists"] == [3, 5]
    assert "process 1's skip list (steps [4]) differs from process 0's (steps [3, 5])" in job[1][1]


def test_a_skip_list_garbled_at_process_0_stops_every_process_with_a_user_error(job):
    at_0, at_1 = (seen_by(job, rank)["skip list garbled at process 0"] for rank in range(2))
    assert at_0.startswith("MsjaxError: ") and "skipped_steps.json is garbled" in at_0
    assert "whole-number steps" in at_0
    assert at_1.startswith("MsjaxError: process 0 found ") and "garbled" in at_1


def test_the_launcher_gives_each_attempt_its_own_secret_derived_from_the_jobs():
    environ: dict[str, str] = {}
    assert ensure_job_secret(1, environ) and len(environ[JOB_SECRET]) == 64
    assert not ensure_job_secret(2, {})  # several nodes must share one: MSJAX_JOB_SECRET
    shared = {JOB_SECRET: "exported once for the whole job"}
    assert ensure_job_secret(2, shared) and shared[JOB_SECRET] == "exported once for the whole job"
    saved = os.environ.get(JOB_SECRET)
    os.environ[JOB_SECRET] = "the launcher's"
    try:
        first, again, second = (
            worker_env("127.0.0.1:1234", 2, rank, attempt)[JOB_SECRET]
            for rank, attempt in ((0, 0), (1, 0), (0, 1))
        )
    finally:
        if saved is None:
            del os.environ[JOB_SECRET]
        else:
            os.environ[JOB_SECRET] = saved
    assert first == again != second  # the same for every rank of an attempt
    assert "the launcher's" not in first


def run(module: str, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1", **env}
    return run_to_end([sys.executable, "-m", module, *args], TIMEOUT_S, cwd, **environ)


def test_a_bad_coordinator_or_port_in_the_environment_is_one_line_and_exit_2(tmp_path):
    slurm = {"SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost"}
    cases = [
        (
            "msjax.launch",
            ["--cluster", "slurm", "--max-restarts", "0"],
            {**slurm, "MSJAX_COORDINATOR_PORT": "29500x"},
            "MSJAX_COORDINATOR_PORT='29500x' is not a port: a whole number in [1, 65535]",
        ),
        (
            "msjax.launch",
            ["--cluster", "slurm", "--max-restarts", "0"],
            {**slurm, "MSJAX_COORDINATOR_PORT": "70000"},
            "MSJAX_COORDINATOR_PORT='70000' is not a port",
        ),
        (
            "msjax.train",
            ["train.steps=1", f"run.dir={tmp_path}/run"],
            {"MSJAX_COORDINATOR": "node001", "MSJAX_NUM_PROCESSES": "1", "MSJAX_PROCESS_ID": "0"},
            "MSJAX_COORDINATOR='node001' is not HOST:PORT",
        ),
    ]
    for module, args, env, expected in cases:
        result = run(module, args, tmp_path, **env)
        check_one_line(result.returncode, result.stderr, expected, f"{module} {args} {env}")
    assert sorted(path.name for path in tmp_path.iterdir()) == []  # nothing written


@pytest.mark.slow
def test_a_rejected_xla_flag_or_garbled_skip_list_is_exit_2_on_the_first_attempt(tmp_path):
    run_dir = tmp_path / "run"
    train_args = [*QUICK_RUN, "train.eval_every=0", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
    first = run("msjax.train", [*train_args, "train.steps=2", f"run.dir={run_dir}"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]

    (run_dir / "skipped_steps.json").write_text('{"skipped": [{"step": 1}, ')  # cut short
    garbled = run("msjax.train", [*train_args, "train.steps=4", f"run.dir={run_dir}"], tmp_path)
    check_one_line(
        garbled.returncode, garbled.stderr, "skipped_steps.json is garbled: not JSON", "msjax.train"
    )
    (run_dir / "skipped_steps.json").unlink()

    for flags, expected in [
        ("--xla_no_such_flag=1", "Unknown flag in XLA_FLAGS: --xla_no_such_flag=1"),
        ("--xla_cpu_enable_fast_math=maybe", "Couldn't interpret value maybe"),
    ]:
        launched = run(
            "msjax.launch",
            ["--max-restarts", "2", "--", *train_args, "train.steps=4", f"run.dir={run_dir}"],
            tmp_path,
            XLA_FLAGS=flags,
        )
        output = launched.stdout + launched.stderr
        assert launched.returncode == exit_codes.USER_ERROR, output[-3000:]
        assert f"XLA rejects XLA_FLAGS='{flags}': {expected}" in output
        assert "attempt 0:" in output and "attempt 1:" not in output  # no restart


def test_a_value_sealed_for_another_key_attempt_or_job_is_refused():
    from msjax.parallel.agreement import ForgedValue, seal, unseal

    secret = b"attempt 1's secret"
    sealed = seal("msjax/job_end", '{"code": 2, "rank": 1}', secret)
    assert unseal("msjax/job_end", sealed, secret) == '{"code": 2, "rank": 1}'
    forgeries = [
        ("msjax/job_end", sealed, b"attempt 0's secret"),  # replayed from another attempt
        ("msjax/vote/decide/0/1", sealed, secret),  # moved under another key
        ("msjax/job_end", sealed.replace('"code": 2', '"code": 0'), secret),  # altered
        ("msjax/job_end", '{"code": 2, "rank": 1}', secret),  # never sealed
    ]
    for key, value, key_secret in forgeries:
        with pytest.raises(ForgedValue):
            unseal(key, value, key_secret)
