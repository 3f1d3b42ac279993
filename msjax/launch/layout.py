"""Where one supervisor's workers sit in the job: how many, on which node of how many."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class JobLayout:
    """Where this supervisor's workers sit in the job."""

    nprocs: int  # workers started by this supervisor
    devices_per_proc: int | None  # CPU devices each (JAX_NUM_CPU_DEVICES); None: leave as is
    nnodes: int = 1
    node_rank: int = 0
    coordinator: str | None = None  # host:port; None on one node: 127.0.0.1 and a free port

    @property
    def num_processes(self) -> int:
        return self.nprocs * self.nnodes

    def process_id(self, local_rank: int) -> int:
        return self.node_rank * self.nprocs + local_rank
