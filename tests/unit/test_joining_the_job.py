"""Joining a job: a process other than 0 waits until the coordinator listens before it calls
jax.distributed.initialize (one refused connection makes gRPC back off for about a second)."""

from __future__ import annotations

import socket
import threading

from msjax.distributed import wait_for_coordinator


def unused_socket() -> socket.socket:
    """A socket bound to a free loopback port, not (yet) listening."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def test_a_coordinator_that_listens_is_found():
    with unused_socket() as sock:
        sock.listen()
        assert wait_for_coordinator(f"127.0.0.1:{sock.getsockname()[1]}", timeout_s=10.0)
        connection, _ = sock.accept()  # the probe's own connection, closed by now
        assert connection.recv(1) == b""
        connection.close()


def test_the_wait_ends_once_the_coordinator_starts_listening():
    with unused_socket() as sock:
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        found: list[bool] = []
        waiter = threading.Thread(target=lambda: found.append(wait_for_coordinator(address, 60)))
        waiter.start()
        sock.listen()  # process 0's coordinator comes up while the other process waits
        waiter.join()
        assert found == [True]


def test_a_coordinator_that_never_listens_ends_the_wait_at_its_timeout():
    with unused_socket() as sock:
        assert not wait_for_coordinator(f"127.0.0.1:{sock.getsockname()[1]}", timeout_s=0.2)
