"""The training processes' malloc setting: glibc backs large blocks with transparent huge pages.

XLA:CPU mallocs its temp buffer on every execution and glibc mmaps and unmaps it, so without
this every step takes one minor page fault per 4 KiB of temp.
glibc reads GLIBC_TUNABLES once, at process start: `msjax.launch` sets it in its workers'
environment, and `python -m msjax.train` re-executes itself once with it.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, Sequence
from typing import Any

TUNABLES_VAR = "GLIBC_TUNABLES"
HUGETLB_TUNABLE = "glibc.malloc.hugetlb"
HUGETLB_SETTING = f"{HUGETLB_TUNABLE}=1"  # madvise(MADV_HUGEPAGE) on glibc's mmapped blocks
OPT_OUT_VAR = "MSJAX_MALLOC_HUGETLB"  # "0": leave glibc's allocator as the environment has it
REEXEC_MARKER_VAR = "MSJAX_ALLOCATOR_REEXEC"  # set in a re-executed process: never twice


def on_glibc() -> bool:
    """Whether this is Linux with glibc (the only place GLIBC_TUNABLES means anything)."""
    return sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def opted_out(env: Mapping[str, str]) -> bool:
    """Whether the environment asks msjax to leave the allocator alone."""
    return env.get(OPT_OUT_VAR, "1").strip().lower() in ("0", "false", "no", "off")


def _tunables_with_hugetlb(tunables: str) -> str:
    """GLIBC_TUNABLES with the huge-page setting added; a hugetlb value already there wins."""
    entries = [entry for entry in tunables.split(":") if entry]
    if any(entry.partition("=")[0] == HUGETLB_TUNABLE for entry in entries):
        return tunables
    return ":".join([*entries, HUGETLB_SETTING])


def allocator_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with huge pages for glibc's large blocks, keeping any other GLIBC_TUNABLES entries."""
    env = dict(env)
    if on_glibc() and not opted_out(env):
        env[TUNABLES_VAR] = _tunables_with_hugetlb(env.get(TUNABLES_VAR, ""))
    return env


def reexec_with_allocator(environ: Mapping[str, str] = os.environ) -> None:
    """Re-execute this process with the allocator setting, if it lacks it; returns otherwise.

    Same pid, argv and interpreter options (`sys.orig_argv`), so exit codes and signals reach
    whoever started it unchanged. The marker variable makes a second re-exec impossible.
    """
    if environ.get(REEXEC_MARKER_VAR):
        return
    wanted = allocator_env(environ)
    if wanted.get(TUNABLES_VAR) == environ.get(TUNABLES_VAR):
        return
    wanted[REEXEC_MARKER_VAR] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    argv: Sequence[str] = sys.orig_argv
    os.execve(sys.executable, list(argv), wanted)


def allocator_record(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """What this process's allocator runs with, for the run dir."""
    tunables = environ.get(TUNABLES_VAR, "")
    return {
        TUNABLES_VAR: tunables,
        "malloc_hugetlb": on_glibc() and HUGETLB_SETTING in tunables.split(":"),
        "opted_out": opted_out(environ),
    }
