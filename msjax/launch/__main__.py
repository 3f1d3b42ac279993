"""`python -m msjax.launch --nprocs P --devices-per-proc D -- [train args]`: a supervised job.

Starts P `python -m msjax.train` workers of one `jax.distributed` job (per node; --nnodes and
--cluster slurm for several), restarts them from the newest checkpoint after a fault, and exits
with a code per outcome (msjax.resilience.exit_codes, docs/reference/exit-codes.md).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from msjax.allocator import allocator_choice
from msjax.cli import user_error
from msjax.errors import MsjaxError
from msjax.launch.job_options import parse_options
from msjax.launch.prepared_job import prepare_job
from msjax.resilience import exit_codes
from msjax.writable import WriteFailed


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options, prepare the job, supervise it; the exit code says how it ended."""
    try:
        allocator_choice(os.environ)  # a bad MSJAX_ALLOCATOR stops here, before any worker
        job = prepare_job(parse_options(sys.argv[1:] if argv is None else argv))
    except WriteFailed as error:  # a full disk, an I/O error: not the user's mistake
        print(f"msjax.launch: {' '.join(str(error).split())}", file=sys.stderr)
        return exit_codes.INFRASTRUCTURE  # retryable: the scheduler requeues it
    except MsjaxError as error:
        return user_error("msjax.launch", error)
    return job.run()


if __name__ == "__main__":
    raise SystemExit(main())
