"""The worker processes of one attempt, as the supervisor sees them: spawn, watch, signal, stop.

Each worker's stdout and stderr go to RUN_DIR/logs/rank<r>.log (rank 0's also to the
supervisor's stdout). Each worker leads its own process group (its Grain data processes are in
it): signals go to the whole group, and when an attempt ends nothing of the group is left.
Workers die with the supervisor (PR_SET_PDEATHSIG), so a killed supervisor leaves no orphan.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from msjax.allocator import allocator_env
from msjax.writable import AppendLog

_PR_SET_PDEATHSIG = 1
LOG_HEADER = "=== msjax.launch: attempt"  # the line that opens each attempt's part of a log
GROUP_GONE_WAIT_S = 10.0  # after SIGKILL to a worker's group, until its last process is gone


def _die_with_parent() -> None:
    # not Linux: no prctl, and workers may outlive a killed supervisor
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def group_states(pgid: int) -> dict[int, str]:
    """Each process of group pgid, by pid: its kernel state letter (R, S, T, Z, ...)."""
    states = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        if int(fields[2]) == pgid:  # state, ppid, pgrp, ...
            states[int(entry.name)] = fields[0]
    return states


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (a coordinator's, for one node)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class WorkerProcess:
    """One `python -m msjax.train` worker of an attempt."""

    def __init__(
        self,
        rank: int,
        command: list[str],
        env: dict[str, str],
        log_path: Path,
        attempt: int,
        echo: IO[str] | None,
    ):
        self.rank = rank
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = AppendLog(log_path)  # no link followed; a full disk drops lines, warning once
        role = f"rank {rank}" if rank >= 0 else "waiting for a rank"  # rank -1: msjax.launch.spare
        self._log.write(f"{LOG_HEADER} {attempt}, {role} ===\n".encode())
        self._log.flush()
        self.spawned_unix_s = time.time()
        self.process = subprocess.Popen(
            command,
            env=allocator_env(env),  # malloc reads it at start (msjax.allocator)
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # a waiting process (rank -1) is handed its rank over this pipe (hand_over)
            stdin=subprocess.PIPE if rank < 0 else subprocess.DEVNULL,
            start_new_session=True,  # the supervisor alone decides which signals reach workers
            preexec_fn=_die_with_parent,
        )
        self.pid = self.process.pid
        self.exit_code: int | None = None
        self.exited_unix_s: float | None = None
        self._ended_unix_s: float | None = None  # when the process ended, seen by _note_end
        self._echo = echo
        self._output_lock = threading.Lock()  # assign() changes where the output goes
        self._forward = threading.Thread(target=self._forward_output, daemon=True)
        self._forward.start()
        threading.Thread(target=self._note_end, daemon=True).start()

    def _note_end(self) -> None:
        """Note the moment the process ends, without reaping it (poll does): the workers of an
        attempt are ordered by it, so that the one that failed first is named as the cause even
        when the supervisor sees several exits in one poll (the others' followed from it)."""
        with contextlib.suppress(OSError, AttributeError):  # reaped already; not Linux
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
            self._ended_unix_s = time.time()

    def _forward_output(self) -> None:
        assert self.process.stdout is not None
        for line in iter(self.process.stdout.readline, b""):  # b"": no process holds the pipe
            with self._output_lock:
                self._log.write(line)
                self._log.flush()
                if self._echo is not None:
                    self._echo.write(line.decode(errors="replace"))
                    self._echo.flush()

    def assign(self, rank: int, log_path: Path, attempt: int, echo: IO[str] | None) -> None:
        """A waiting process (msjax.launch.spare) takes `rank` in `attempt`: from now on its
        output goes to that rank's log (and to echo), as a fresh worker's would. Call before
        handing it the assignment, so that all it prints as that rank lands there."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = AppendLog(log_path)
        waited_s = time.time() - self.spawned_unix_s
        log.write(
            f"{LOG_HEADER} {attempt}, rank {rank}, pid {self.pid} waited {waited_s:.1f} s ===\n"
        )
        log.flush()
        with self._output_lock:
            self._log.close()
            self._log, self.log_path, self._echo = log, log_path, echo
        self.rank, self.spawned_unix_s = rank, time.time()

    def hand_over(self, rank: int, env: dict[str, str], args: list[str]) -> None:
        """Tell a waiting process (msjax.launch.spare) its rank, worker environment and trainer
        arguments over its stdin, a pipe only this process holds: nothing of it is on disk,
        where another user could read the job's secret or write an assignment of their own."""
        assert self.process.stdin is not None, "only a waiting process is handed a rank"
        line = json.dumps({"rank": rank, "env": env, "args": args}) + "\n"
        with contextlib.suppress(BrokenPipeError):  # it ended meanwhile: its exit tells
            self.process.stdin.write(line.encode())
            self.process.stdin.flush()
        with contextlib.suppress(OSError):
            self.process.stdin.close()

    def poll(self) -> int | None:
        """The exit code once the process has ended (noting when it was first seen ended)."""
        if self.exit_code is None:
            code = self.process.poll()
            if code is not None:
                self.exit_code = code
                self.exited_unix_s = self._ended_unix_s or time.time()
        return self.exit_code

    @property
    def alive(self) -> bool:
        return self.poll() is None

    def state(self) -> str:
        """The kernel's one-letter state: R running, S sleeping, T stopped, Z zombie, ..."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return "?"
        return stat.rsplit(")", 1)[1].split()[0]

    @property
    def stopped(self) -> bool:
        return self.alive and self.state() in ("T", "t")

    def signal(self, signum: int) -> None:
        """signum to the worker's whole process group (its data processes leave SIGTERM and
        SIGINT to it); SIGUSR1, a request for the worker's stacks, to the worker alone."""
        if not self.alive:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if signum == signal.SIGUSR1:
                os.kill(self.pid, signum)
            else:
                os.killpg(self.pid, signum)  # start_new_session: the group's id is the pid

    def group_alive(self) -> bool:
        """Whether any process of the worker's group is still running (zombies do not count:
        they are dead, and on a node whose init does not reap, orphans stay zombies)."""
        return any(state != "Z" for state in group_states(self.pid).values())

    def end_group(self) -> bool:
        """SIGKILL what is left of the worker's process group once the worker has ended (children
        it left behind), then wait until none is left; whether none is."""
        self.poll()
        if self.exit_code is None:
            return False
        deadline = time.monotonic() + GROUP_GONE_WAIT_S
        while self.group_alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def wait(self, timeout_s: float) -> bool:
        """Whether the process ended within timeout_s."""
        try:
            self.process.wait(timeout=max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            return False
        self.poll()
        return True

    def close(self) -> None:
        """After the worker ended: no process of its group left, its output forwarded to the
        end (the pipe closes once no process holds it), the pipe and the log closed."""
        if not self.end_group():
            print(
                f"msjax.launch: processes of rank {self.rank}'s group {self.pid} did not die",
                file=sys.stderr,
            )
        self._forward.join(timeout=5.0)
        if self._forward.is_alive():
            return  # a process that SIGKILL cannot end (stuck in the kernel) still holds the pipe
        if self.process.stdout is not None:
            self.process.stdout.close()
        if self.process.stdin is not None:  # a waiting process never handed a rank
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        self._log.close()

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_bytes()[-64 * 1024 :].decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:]) + "\n"


def stop_workers(workers: list[WorkerProcess], grace_s: float) -> tuple[float, list[int]]:
    """SIGTERM every live worker's group (SIGCONT too, so a stopped one can act on it), SIGKILL
    those still alive after grace_s (named in one line), then end what is left of each group
    and close its pipe; returns the seconds it took and the ranks SIGKILLed after the grace.
    Workers that have all exited already are only cleaned up."""
    started = time.monotonic()
    for worker in workers:
        worker.signal(signal.SIGTERM)
        worker.signal(signal.SIGCONT)
    deadline = started + grace_s
    killed = []
    for worker in workers:
        if not worker.wait(deadline - time.monotonic()):
            worker.signal(signal.SIGKILL)
            killed.append(worker)
    if killed:
        names = ", ".join(f"{worker.rank} (pid {worker.pid})" for worker in killed)
        print(
            f"msjax.launch: rank(s) {names} did not stop within {grace_s:g} s; SIGKILLed",
            file=sys.stderr,
        )
    for worker in workers:
        if not worker.wait(10.0):
            print(
                f"msjax.launch: rank {worker.rank} (pid {worker.pid}) did not die", file=sys.stderr
            )
        worker.close()
    return time.monotonic() - started, [worker.rank for worker in killed]
