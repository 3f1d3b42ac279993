"""One process's fatal error ends the whole job within seconds, with that error's exit code.

The failing process publishes its exit code in jax.distributed's key-value store and leaves at
once (JAX's exit-time shutdown would wait for peers blocked in a collective with it); a thread in
every process waits on that key and leaves with the same code, so no peer is left to hang. The
record is sealed with the job's secret (msjax.parallel.agreement), so that another local user who
reaches the store cannot end the job with a code of their choosing: a forged record is ignored.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from typing import Any

from msjax.parallel.agreement import ForgedValue, job_secret, seal, unseal

ERROR_KEY = "msjax/job_end"
ACK_PREFIX = "msjax/job_end_seen"
ACK_WAIT_S = 5.0  # how long process 0 waits for its peers to leave before it does
# the watch asks again this often, so that it can end with its process (a thread still blocked
# in the key-value client when Python finalizes aborts the process)
WATCH_POLL_MS = 1000
FORGED_POLL_S = 0.2  # how often the watch looks again while a forged record holds the key


def _client() -> Any:
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return None
    from jax._src.distributed import global_state

    return global_state.client


def in_job() -> bool:
    """Whether this process is one of a multi-process jax.distributed job."""
    return _client() is not None


def leave_job_now(code: int, reason: str = "") -> None:
    """In a multi-process job: tell every peer to leave with `code`, then exit at once.
    One process: return (the caller exits normally)."""
    client = _client()
    if client is None:
        return
    import jax

    record = json.dumps({"code": code, "rank": jax.process_index(), "reason": reason})
    sealed = seal(ERROR_KEY, record, job_secret())
    with contextlib.suppress(Exception):  # another process published first: its code wins
        try:
            client.key_value_set(ERROR_KEY, sealed)
        except Exception:
            if _published_record(client.key_value_try_get(ERROR_KEY)) is not None:
                raise
            client.key_value_delete(ERROR_KEY)  # a forged record holds the key: replace it
            client.key_value_set(ERROR_KEY, sealed)
    _exit_in_order(client, code)


def _published_record(sealed: str) -> dict[str, Any] | None:
    """The job-end record a peer of this job published, or None if these bytes are not one (no
    valid seal, or not a record): another local user's client wrote them."""
    try:
        record = json.loads(unseal(ERROR_KEY, sealed, job_secret()))
        return (
            record if isinstance(record["code"], int) and isinstance(record["rank"], int) else None
        )
    except (ForgedValue, ValueError, KeyError, TypeError):
        return None


def _exit_in_order(client: Any, code: int) -> None:
    """Exit with code; process 0 last, once every peer has said it is leaving: process 0 hosts
    the coordination service, and a peer that loses it mid-call aborts instead of exiting."""
    import jax

    rank, peers = jax.process_index(), jax.process_count()
    if rank != 0:
        with contextlib.suppress(Exception):
            client.key_value_set(f"{ACK_PREFIX}/{rank}", "1")
    else:
        deadline = time.monotonic() + ACK_WAIT_S
        while time.monotonic() < deadline:
            try:
                acks = {key for key, _ in client.key_value_dir_get(ACK_PREFIX + "/")}
                if {f"{ACK_PREFIX}/{peer}" for peer in range(1, peers)} <= acks:
                    break
            except Exception:
                break
            time.sleep(0.02)
        time.sleep(0.2)  # the peers' own exits, after their last call
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def peer_exit_code(wait_s: float) -> int | None:
    """The exit code a peer published, waiting up to wait_s for it (None if none did)."""
    client = _client()
    if client is None:
        return None
    try:
        record = _published_record(client.blocking_key_value_get(ERROR_KEY, int(wait_s * 1000)))
    except Exception:
        return None
    return None if record is None else int(record["code"])


def watch_for_peer_exit(program: str) -> threading.Thread | None:
    """In a multi-process job, a daemon thread that leaves with a peer's published exit code."""
    client = _client()
    if client is None:
        return None
    import jax

    rank = jax.process_index()
    leaving = threading.Event()

    def watch() -> None:
        warned = False
        while not leaving.is_set():
            try:
                text = client.blocking_key_value_get(ERROR_KEY, WATCH_POLL_MS)
            except Exception as error:
                if "DEADLINE_EXCEEDED" not in str(error):
                    return  # the coordination service is gone: JAX itself ends this process
                continue
            record = _published_record(text)
            if record is not None:
                break
            if not warned:  # a peer that fails replaces it (leave_job_now); wait for that
                print(
                    f"{program}: ignored a job-end record in the coordination service that "
                    "this job did not write (no valid seal)",
                    file=sys.stderr,
                )
                warned = True
            time.sleep(FORGED_POLL_S)
        else:
            return
        if record["rank"] == rank:
            return  # this process published it and is leaving already
        reason = f": {record['reason']}" if record.get("reason") else ""
        print(
            f"{program}: stopping: process {record['rank']} ended the job with exit code "
            f"{record['code']}{reason}",
            file=sys.stderr,
        )
        _exit_in_order(client, int(record["code"]))

    def stop_watching() -> None:  # runs before JAX's own exit-time shutdown (registered later)
        leaving.set()
        thread.join(timeout=2 * WATCH_POLL_MS / 1000)

    thread = threading.Thread(target=watch, name="msjax-job-end-watch", daemon=True)
    thread.start()
    atexit.register(stop_watching)
    return thread
