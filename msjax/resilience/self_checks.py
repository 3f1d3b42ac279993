"""The self-checks one worker process runs (`python -m msjax.resilience.self_checks`, started by
msjax.doctor): a known-answer program on each local device and its speed, host memory, the run
dir's disk, and an all-reduce over each mesh axis. Figures go to RUN_DIR/health/N/rank<R>.json as
they are measured; msjax.resilience.health judges them against the bounds and the other ranks.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from msjax.resilience import exit_codes

KNOWN_ANSWER_SEED = 23
# [batch, seq, embed], heads x head_dim: about 0.2 GFLOP, milliseconds on one CPU core
BATCH, SEQ, EMBED, HEADS, HEAD_DIM = 2, 128, 256, 8, 32
NORM_EPS = 1e-6
TIMED_RUNS = 10  # the speed figure is the fastest of these (the least disturbed by other work)
DISK_CHECK_BYTES = 16 * 2**20
ALL_REDUCE_RUNS = 5
REPORT_MARGIN_S = 3.0  # a wait on peers ends this long before the doctor's deadline, to report
AFTER_TIMEOUT_SHARE = 0.5  # the vote naming who is gone, after a collective that did not end


@dataclass(frozen=True)
class Waits:
    """How long one wait on peers may last: wait_s, and never past the doctor's deadline."""

    wait_s: float
    end_unix_s: float

    def timeout_s(self, share: float = 1.0) -> float:
        left_s = self.end_unix_s - REPORT_MARGIN_S - time.time()
        return max(min(self.wait_s * share, left_s), 0.5)


def known_answer_inputs() -> dict[str, np.ndarray]:
    """The known-answer program's seeded inputs, the same in every process."""
    rng = np.random.default_rng(KNOWN_ANSWER_SEED)
    normal = rng.standard_normal
    return {
        "x": normal((BATCH, SEQ, EMBED)).astype(np.float32),  # [batch, seq, embed]
        # [3 (query, key, value), embed, heads, head_dim]
        "qkv": (normal((3, EMBED, HEADS, HEAD_DIM)) / np.sqrt(EMBED)).astype(np.float32),
        # [heads, head_dim, embed]
        "out": (normal((HEADS, HEAD_DIM, EMBED)) / np.sqrt(HEADS * HEAD_DIM)).astype(np.float32),
        "scale": (1 + 0.1 * normal(EMBED)).astype(np.float32),  # [embed]
    }


def known_answer_program(x, qkv, out, scale):
    """matmul -> causal attention -> matmul -> RMSNorm, through msjax's own ops (a corrupted
    matmul path shows here as it would in training)."""
    from msjax.ops import attention, rms_norm
    from msjax.ops.matmul import einsum

    query, key, value = (einsum("bse,ehd->bshd", x, qkv[i]) for i in range(3))
    mixed = attention(query, key, value, impl="xla")  # [batch, seq, heads, head_dim]
    projected = einsum("bshd,hde->bse", mixed, out)  # [batch, seq, embed]
    return rms_norm(projected, scale, eps=NORM_EPS, impl="xla")


def float64_answer(inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The known-answer program in float64 NumPy: what a sound device computes, within rounding."""
    x, qkv, out, scale = (inputs[name].astype(np.float64) for name in ("x", "qkv", "out", "scale"))
    query, key, value = (np.einsum("bse,ehd->bshd", x, qkv[i]) for i in range(3))
    scores = np.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(HEAD_DIM)  # [b, heads, q, k]
    scores = np.where(np.tril(np.ones((SEQ, SEQ), dtype=bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    mixed = np.einsum("bhqk,bkhd->bqhd", weights, value)
    projected = np.einsum("bshd,hde->bse", mixed, out)
    rms = np.sqrt(np.mean(projected * projected, axis=-1, keepdims=True) + NORM_EPS)
    return projected / rms * scale


def fingerprint(array: np.ndarray) -> str:
    """A short hash of an array's bytes: equal results, equal fingerprints."""
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def check_compute(devices: Sequence[Any]) -> list[dict[str, Any]]:
    """Per local device: the known-answer result's fingerprint, its error against float64
    (max |difference| / max |answer|) and the program's fastest time of TIMED_RUNS."""
    import jax

    inputs = known_answer_inputs()
    expected = float64_answer(inputs)
    names = ("x", "qkv", "out", "scale")
    # full float32 matmuls everywhere (no TF32 on GPUs), so the float64 answer is within 1e-5
    with jax.default_matmul_precision("highest"):
        program = jax.jit(known_answer_program)
        placed = [[jax.device_put(inputs[name], device) for name in names] for device in devices]
        results = [np.asarray(program(*args)) for args in placed]  # compiled once per device
        seconds: list[list[float]] = [[] for _ in devices]
        for _ in range(TIMED_RUNS):  # devices in turn, so a burst of other work hits them alike
            for index, args in enumerate(placed):
                started = time.perf_counter()
                program(*args).block_until_ready()
                seconds[index].append(time.perf_counter() - started)
    return [
        {
            "device": int(device.id),
            "kind": str(device.device_kind),
            "fingerprint": fingerprint(result),
            "error": float(np.max(np.abs(result - expected)) / np.max(np.abs(expected))),
            "seconds": min(timed),
        }
        for device, result, timed in zip(devices, results, seconds, strict=True)
    ]


def check_host_memory() -> dict[str, Any]:
    """The host memory available to new work, in MiB (Linux MemAvailable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return {"available_mib": int(line.split()[1]) / 1024}
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {"available_mib": pages / 2**20}


def check_disk(folder: Path, rank: int) -> dict[str, Any]:
    """Write DISK_CHECK_BYTES into folder, fsync, read them back: MB/s each way, and whether the
    bytes came back as written. The file's name is this check's own: checks that share the
    folder at once (a spare checked alone as rank 0 beside the job's rank 0) never touch each
    other's file."""
    data = os.urandom(DISK_CHECK_BYTES)
    path = (
        folder
        / f".disk-check-rank{rank}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    )
    started = time.perf_counter()
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as error:
        return {"error": f"{path}: {error}"}
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(descriptor, view) :]
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        write_s = time.perf_counter() - started
        started = time.perf_counter()
        back = path.read_bytes()
        read_s = time.perf_counter() - started
    except OSError as error:
        return {"error": f"{path}: {error}"}
    finally:
        path.unlink(missing_ok=True)
    megabytes = DISK_CHECK_BYTES / 1e6
    return {
        "write_mb_s": megabytes / max(write_s, 1e-9),
        "read_mb_s": megabytes / max(read_s, 1e-9),
        "intact": back == data,
    }


def bounded(work: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """(True, work()) if it returns within timeout_s, else (False, None): a collective stuck on a
    peer that never comes stays stuck in its own thread, and the process exits past it."""
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(work()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    return (bool(outcome), outcome[0] if outcome else None)


def check_collectives(mesh_config: Any, waits: Waits) -> list[dict[str, Any]]:
    """Per mesh axis of size > 1: every process arrives (a vote with a deadline), then, group by
    group (the devices along that axis at one place on the others), an all-reduce of known
    values (each device its place in the mesh + 1), checked and timed on each group this process
    holds a device of, so a wrong or slow link is named. The first axis that fails ends it."""
    from msjax.parallel.agreement import VoteTimeout, process_vote
    from msjax.parallel.mesh import MESH_AXES, build_mesh

    mesh = build_mesh(mesh_config)
    values = np.arange(1, mesh.devices.size + 1, dtype=np.float32).reshape(mesh.devices.shape)
    results = []
    for position, axis in enumerate(MESH_AXES):
        if mesh.shape[axis] == 1:
            continue
        entry: dict[str, Any] = {"axis": axis, "size": int(mesh.shape[axis]), "groups": []}
        results.append(entry)
        started = time.monotonic()
        try:
            vote = process_vote(f"health.arrive.{axis}", waits.timeout_s())
            if vote is not None:
                vote.gather([1])
        except VoteTimeout as timeout:
            entry.update(ok=False, missing=timeout.missing, waited_s=time.monotonic() - started)
            return results
        devices = np.moveaxis(mesh.devices, position, -1)  # [..., the axis]
        known = np.moveaxis(values, position, -1)
        for place in np.ndindex(devices.shape[:-1]):  # the same order in every process
            group = _all_reduce_group(devices[place], known[place], waits)
            if group is None:
                entry.update(ok=False, timed_out=True, waited_s=time.monotonic() - started)
                entry["missing"] = _who_is_missing(
                    f"health.alive.{axis}", waits.timeout_s(AFTER_TIMEOUT_SHARE)
                )
                return results
            if group:
                entry["groups"].append(group)
        entry["wrong"] = [wrong for group in entry["groups"] for wrong in group.pop("wrong")]
        entry["ok"] = not entry["wrong"]
        entry["seconds"] = max(group["seconds"] for group in entry["groups"])
    return results


def _all_reduce_group(
    devices: np.ndarray, known: np.ndarray, waits: Waits
) -> dict[str, Any] | None:
    """The all-reduce over one group of devices, if this process holds one of them: its time
    and its wrong sums ({} when it holds none; None when it did not end within its wait)."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if all(device.process_index != jax.process_index() for device in devices):
        return {}
    group_mesh = Mesh(devices, ("group",))
    sharding = NamedSharding(group_mesh, P("group"))  # [group]: one value per device
    placed = jax.make_array_from_callback(known.shape, sharding, lambda index: known[index])
    program = jax.jit(
        jax.shard_map(
            lambda block: jax.lax.psum(block, "group"),
            mesh=group_mesh,
            in_specs=P("group"),
            out_specs=P("group"),
        )
    )
    done, outcome = bounded(functools.partial(_timed, program, placed), waits.timeout_s())
    if not done:
        return None
    seconds, summed = outcome
    expected = float(known.sum())
    wrong = [
        {
            "device": int(shard.device.id),
            "got": np.asarray(shard.data).ravel().tolist(),
            "expected": [expected],
            "group_ranks": sorted({int(device.process_index) for device in devices}),
        }
        for shard in summed.addressable_shards
        if not np.array_equal(np.asarray(shard.data), [expected])
    ]
    return {
        "devices": [int(device.id) for device in devices],
        "ranks": sorted({int(device.process_index) for device in devices}),
        "seconds": seconds,
        "wrong": wrong,
    }


def _timed(program: Callable, placed: Any) -> tuple[float, Any]:
    """The fastest of ALL_REDUCE_RUNS runs after one to compile, and the last result."""
    summed = program(placed).block_until_ready()
    seconds = []
    for _ in range(ALL_REDUCE_RUNS):
        started = time.perf_counter()
        summed = program(placed).block_until_ready()
        seconds.append(time.perf_counter() - started)
    return min(seconds), summed


def _who_is_missing(name: str, timeout_s: float) -> list[int]:
    """After a collective did not finish: the ranks that cannot even vote (stopped, gone)."""
    from msjax.parallel.agreement import VoteTimeout, process_vote

    try:
        vote = process_vote(name, timeout_s)
        if vote is not None:
            vote.gather([1])
    except VoteTimeout as timeout:
        return timeout.missing
    return []


class RankReport:
    """This rank's figures, rewritten whole (atomically) after each check."""

    def __init__(self, path: Path, rank: int, attempt: int):
        self.path = path
        started = time.time()  # joined the job, imports done
        self.figures: dict[str, Any] = {
            "rank": rank,
            "attempt": attempt,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_unix_s": started,
            "unix_s": started,
            "phase": "start",
        }

    def update(self, **figures: Any) -> None:
        import json

        from msjax.writable import write_text_atomically

        now = time.time()
        if figures.get("phase", self.figures["phase"]) != self.figures["phase"]:
            phases_s = self.figures.setdefault("phases_s", {})  # seconds each phase took
            phases_s[self.figures["phase"]] = round(now - self.figures.get("unix_s", now), 4)
        self.figures.update(figures, unix_s=now)
        write_text_atomically(self.path, json.dumps(self.figures, indent=1), durable=False)


def local_failures(figures: dict[str, Any], tolerance: float) -> list[str]:
    """What this rank can tell alone: an error past tolerance, a bad disk, a failed collective."""
    failed = [
        f"compute on device {d['device']}" for d in figures["compute"] if d["error"] > tolerance
    ]
    disk = figures["disk"]
    if "error" in disk or not disk["intact"]:
        failed.append("disk")
    failed += [f"collectives over {c['axis']}" for c in figures["collectives"] if not c["ok"]]
    return failed


def run_checks(config_path: Path, number: int, waits: Waits, collectives: bool = True) -> int:
    """Every check of this process, its figures written as they come; exit code 0 or 10.
    collectives=False: no all-reduce (a slot checked alone whose devices hold no whole mesh)."""
    import jax

    from msjax.config import load_config
    from msjax.distributed import JobEnv, announce_devices, initialize_distributed
    from msjax.resilience.faults import FaultInjector
    from msjax.resilience.health import KNOWN_ANSWER_TOLERANCE
    from msjax.resolve import check_device_count
    from msjax.run_dir import RunDir

    job = JobEnv.read()
    config = load_config(config_path)
    initialize_distributed(job, config.resilience.peer_timeout_s)
    announce_devices(job)
    run_dir = RunDir(Path(config.run.dir))
    rank = jax.process_index()
    report = RankReport(run_dir.health_rank(number, rank), rank, job.attempt)
    FaultInjector.from_env(run_dir.path, rank, job.attempt)  # corrupt_compute, if injected
    report.update(phase="compute")
    report.update(phase="memory", compute=check_compute(jax.local_devices()))
    report.update(phase="disk", memory=check_host_memory())
    report.update(phase="collectives", disk=check_disk(run_dir.health, rank))
    reduced = []
    if collectives:
        reduced = check_collectives(check_device_count(config, jax.device_count()).mesh, waits)
    missing = sorted({rank for entry in reduced for rank in entry.get("missing", [])})
    report.update(phase="end", collectives=reduced, missing=missing)
    failed = local_failures(report.figures, KNOWN_ANSWER_TOLERANCE)
    report.update(phase="done", local_failures=failed)
    if not missing:  # every peer answers: end together, so none outlives the coordinator
        _who_is_missing("health.end", waits.timeout_s(AFTER_TIMEOUT_SHARE))
    print(f"msjax.self_checks: rank {rank}: {', '.join(failed) or 'passed'}", flush=True)
    return exit_codes.SELF_CHECK_FAILED if failed else exit_codes.OK


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m msjax.resilience.self_checks")
    parser.add_argument("--config", type=Path, required=True, help="the job's resolved config")
    parser.add_argument("--number", type=int, required=True, help="RUN_DIR/health/NUMBER")
    parser.add_argument("--wait-s", type=float, required=True, help="each wait on peers")
    parser.add_argument("--end-unix-s", type=float, required=True, help="the doctor's deadline")
    parser.add_argument("--no-collectives", action="store_true", help="skip the all-reduces")
    args = parser.parse_args(argv)
    waits = Waits(args.wait_s, args.end_unix_s)
    code = run_checks(args.config, args.number, waits, collectives=not args.no_collectives)
    # A peer may be stuck in a collective or gone; jax.distributed's shutdown would wait for it.
    os._exit(code)


if __name__ == "__main__":
    main()
