"""How a worker joins its `jax.distributed` job: the environment msjax.launch sets for each
worker (`worker_env`), read back by the trainer (`JobEnv`, `initialize_distributed`).

MSJAX_COORDINATOR (host:port), MSJAX_NUM_PROCESSES and MSJAX_PROCESS_ID name the job explicitly;
MSJAX_DISTRIBUTED=auto lets JAX detect it (Slurm, Open MPI, Kubernetes with the `kubernetes`
package). MSJAX_ATTEMPT numbers the supervisor's restarts. Without any of them a run is one process.
MSJAX_JOB_SECRET seals what the job writes to its coordination service (msjax.parallel.agreement).
MSJAX_LOCAL_DEVICE_IDS ("0,1"): the devices of this worker's slot among those it sees (its
CUDA_VISIBLE_DEVICES), handed to jax.distributed.initialize; without it JAX's Slurm detection would
keep GPU SLURM_LOCALID alone (msjax.launch.devices).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from msjax.config import ResilienceConfig
from msjax.errors import MsjaxError
from msjax.parallel.agreement import JOB_SECRET

COORDINATOR = "MSJAX_COORDINATOR"
NUM_PROCESSES = "MSJAX_NUM_PROCESSES"
PROCESS_ID = "MSJAX_PROCESS_ID"
DISTRIBUTED = "MSJAX_DISTRIBUTED"
ATTEMPT = "MSJAX_ATTEMPT"
LOCAL_DEVICE_IDS = "MSJAX_LOCAL_DEVICE_IDS"
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"  # the GPUs a process sees (msjax.launch.devices)
INIT_TIMEOUT_S = 300
COORDINATOR_POLL_S = 0.01  # how often a process looks whether the coordinator listens yet
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class JobEnv:
    """One worker's place in the job, as the environment describes it."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    auto: bool
    attempt: int  # restarts before this one
    launched: bool  # started by msjax.launch
    local_device_ids: tuple[int, ...] | None = None  # its slot's devices; None: JAX decides

    @property
    def distributed(self) -> bool:
        return self.auto or self.coordinator is not None

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> JobEnv:
        explicit = [name for name in (COORDINATOR, NUM_PROCESSES, PROCESS_ID) if environ.get(name)]
        if explicit and len(explicit) < 3:
            missing = sorted({COORDINATOR, NUM_PROCESSES, PROCESS_ID} - set(explicit))
            raise MsjaxError(f"{', '.join(explicit)} set without {', '.join(missing)}")
        mode = environ.get(DISTRIBUTED, "")
        if mode not in ("", "auto"):
            raise MsjaxError(
                f"{DISTRIBUTED}={mode!r} is not accepted; use auto (or leave it unset)"
            )
        try:
            num = int(environ[NUM_PROCESSES]) if explicit else None
            rank = int(environ[PROCESS_ID]) if explicit else None
            attempt = int(environ.get(ATTEMPT, "0"))
        except ValueError as error:
            raise MsjaxError(f"a distributed-job variable is not a whole number: {error}") from None
        if num is not None and rank is not None and not 0 <= rank < num:
            raise MsjaxError(f"{PROCESS_ID}={rank} must be in [0, {NUM_PROCESSES}={num})")
        coordinator = environ.get(COORDINATOR)
        if coordinator:
            parse_host_port(coordinator, COORDINATOR)
        local_ids = parse_local_device_ids(environ.get(LOCAL_DEVICE_IDS, ""))
        return cls(coordinator, num, rank, mode == "auto", attempt, ATTEMPT in environ, local_ids)


def parse_local_device_ids(text: str) -> tuple[int, ...] | None:
    """MSJAX_LOCAL_DEVICE_IDS ("0,1") as device numbers; None when unset or empty."""
    if not text.strip():
        return None
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts):
        raise MsjaxError(
            f"{LOCAL_DEVICE_IDS}={text!r} is not a list of device numbers (e.g. 0,1,2,3)"
        )
    return tuple(int(part) for part in parts)


def parse_port(text: str, what: str) -> int:
    """A TCP port given as text: a whole number in [1, 65535]; MsjaxError naming `what`."""
    if not text.strip().isdigit() or not 1 <= int(text) <= 65535:
        raise MsjaxError(f"{what}={text!r} is not a port: a whole number in [1, 65535]")
    return int(text)


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    """`host:port` (an IPv6 host in brackets, `[::1]:29500`) as (host, port); MsjaxError naming
    `what` and the accepted form otherwise."""
    host, colon, port = text.rpartition(":")
    bare_host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    well_formed = (
        colon
        and bare_host
        and not any(character.isspace() for character in text)
        and ("[" not in bare_host and "]" not in bare_host)
        and (":" not in bare_host or host.startswith("["))  # a bare IPv6 address is ambiguous
    )
    if not well_formed:
        raise MsjaxError(
            f"{what}={text!r} is not HOST:PORT (e.g. node001:29500, 10.0.0.5:29500, [::1]:29500)"
        )
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise MsjaxError(f"{what}={text!r}: the port must be a whole number in [1, 65535]")
    return bare_host, int(port)


def worker_env(coordinator: str, num_processes: int, process_id: int, attempt: int) -> dict:
    """The variables the launcher sets for one worker. The job secret they get is derived
    from the launcher's (MSJAX_JOB_SECRET) and the attempt, so that a sealed value one attempt
    wrote is not accepted by the next (each starts a fresh coordination service)."""
    env = {
        COORDINATOR: coordinator,
        NUM_PROCESSES: str(num_processes),
        PROCESS_ID: str(process_id),
        ATTEMPT: str(attempt),
    }
    launcher_secret = os.environ.get(JOB_SECRET, "")
    if launcher_secret:
        message = f"msjax attempt {attempt}".encode()
        env[JOB_SECRET] = hmac.new(launcher_secret.encode(), message, hashlib.sha256).hexdigest()
    return env


def ensure_job_secret(nnodes: int, environ: MutableMapping[str, str] = os.environ) -> bool:
    """Give this launcher a job secret: MSJAX_JOB_SECRET when set (several nodes need the same
    one: the Slurm script exports it), else a fresh random one on a single node. False when
    the job has none (several nodes, none given): its job-end records are then not sealed."""
    if environ.get(JOB_SECRET):
        return True
    if nnodes > 1:
        return False
    environ[JOB_SECRET] = secrets.token_hex(32)
    return True


def initialize_distributed(
    job: JobEnv, peer_timeout_s: int = ResilienceConfig.peer_timeout_s
) -> bool:
    """Join the job the environment names (before any JAX computation); False for one process.
    A process whose coordination heartbeats stop for peer_timeout_s ends the job everywhere."""
    import jax

    if not job.distributed or jax.distributed.is_initialized():
        return False
    # gloo carries CPU collectives across processes (the default in newer JAX); GPUs use NCCL
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service installs its own SIGTERM handler, which swallows the signal;
    # msjax answers SIGTERM itself (msjax.training.decisions) and never asks that service
    with contextlib.suppress(AttributeError):  # a JAX without the option has no such handler
        jax.config.update("jax_enable_preemption_service", False)
    # the slot's own devices; None lets JAX choose (under Slurm: GPU SLURM_LOCALID alone)
    local_ids = list(job.local_device_ids) if job.local_device_ids is not None else None
    if job.auto:
        jax.distributed.initialize(
            local_device_ids=local_ids,
            initialization_timeout=INIT_TIMEOUT_S,
            heartbeat_timeout_seconds=peer_timeout_s,
        )
    else:
        deadline = time.monotonic() + INIT_TIMEOUT_S  # the wait and the join share it
        if job.process_id:  # process 0 starts the coordinator inside initialize
            wait_for_coordinator(job.coordinator, INIT_TIMEOUT_S)
        jax.distributed.initialize(
            coordinator_address=job.coordinator,
            num_processes=job.num_processes,
            process_id=job.process_id,
            local_device_ids=local_ids,
            initialization_timeout=max(1, int(deadline - time.monotonic())),
            heartbeat_timeout_seconds=peer_timeout_s,
            coordinator_bind_address=coordinator_bind_address(job.coordinator),
        )
    return True


def announce_devices(job: JobEnv) -> None:
    """Print the device line of a distributed process given its slot's devices (after
    initialize_distributed; it starts JAX's backend, so only once the CPU device count is set)."""
    if job.distributed and job.local_device_ids is not None:
        print(describe_devices(), flush=True)


def describe_devices() -> str:
    """One line: the devices this process sees (CUDA_VISIBLE_DEVICES) and those JAX was told
    to use among them (its jax_cuda_visible_devices, as jax.distributed.initialize set it)."""
    import jax

    visible = os.environ.get(VISIBLE_DEVICES, "(unset: every GPU)")
    return (
        f"msjax: process {jax.process_index()}: devices {VISIBLE_DEVICES}={visible}, "
        f"local devices {jax.config.values.get('jax_cuda_visible_devices', 'all')}"
    )


def wait_for_coordinator(coordinator: str, timeout_s: float) -> bool:
    """Whether the coordinator (host:port) accepted a connection within timeout_s. A process
    that joins before process 0's coordinator listens is refused, and gRPC then backs off for
    about a second before it tries again: every (re)start of a job would wait for it."""
    host, port = coordinator.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(COORDINATOR_POLL_S)


def coordinator_bind_address(coordinator: str | None) -> str | None:
    """Where process 0's coordination service listens: only on loopback when the job's
    coordinator is a loopback address (one node), so a single-node job opens no port to the
    network. None otherwise: JAX's default, every interface on the coordinator's port, unless
    JAX_COORDINATOR_BIND_ADDRESS says otherwise (docs/recovery.md, "Ports")."""
    if coordinator is None:
        return None
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    return coordinator if host in LOOPBACK_HOSTS else None
