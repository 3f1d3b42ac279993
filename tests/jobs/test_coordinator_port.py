"""A single-node job's coordination service listens on loopback only, never on the network."""

from __future__ import annotations

import socket
import subprocess
import sys

from harness import job_env

from msjax.distributed import coordinator_bind_address

# Joins a one-process job through msjax's own path, then lists the sockets listening on the port.
JOIN_AND_LIST = """
import sys
from msjax.distributed import JobEnv, initialize_distributed
assert initialize_distributed(JobEnv.read())
port = int(sys.argv[1])
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for row in open(table).read().splitlines()[1:]:
        local, state = row.split()[1], row.split()[3]
        address, port_hex = local.rsplit(":", 1)
        if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
            print(table, address)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_bind_address_is_loopback_for_a_loopback_coordinator_only() -> None:
    assert coordinator_bind_address("127.0.0.1:29500") == "127.0.0.1:29500"
    assert coordinator_bind_address("localhost:1234") == "localhost:1234"
    assert coordinator_bind_address("node001:29500") is None  # several nodes: JAX's default
    assert coordinator_bind_address(None) is None


def test_single_node_coordination_service_listens_on_127_0_0_1_only() -> None:
    port = free_port()
    env = job_env(
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES="1",
        MSJAX_COORDINATOR=f"127.0.0.1:{port}",
        MSJAX_NUM_PROCESSES="1",
        MSJAX_PROCESS_ID="0",
    )
    env.pop("JAX_COORDINATOR_BIND_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-c", JOIN_AND_LIST, str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    listening = [line.split() for line in result.stdout.splitlines() if line.startswith("/proc")]
    assert listening, f"nothing listens on {port}: {result.stdout}"
    # 127.0.0.1 in /proc/net's byte order, as IPv4 or IPv4-mapped IPv6 (::ffff:127.0.0.1);
    # JAX's default would be [::], every interface (all zeros)
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
    assert {address for _, address in listening} <= loopback, listening
