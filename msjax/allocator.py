"""The training processes' malloc: jemalloc keeping what is freed where it is installed, glibc on
huge pages elsewhere.

XLA:CPU mallocs its temp buffer on every execution (2.96 GB a step at the side-by-side shape).
glibc serves a block that large with a mapping of its own and unmaps it on free, so every step
faults the whole buffer back in: one minor fault per 4 KiB, or per 2 MiB with huge pages. msjax
picks, in this order (`MSJAX_ALLOCATOR`: `auto`, the default; `glibc`; `off`):
- jemalloc (Debian's `libjemalloc2`, preloaded) with one arena, no separate arena for large
  blocks and no purging: the buffer a step frees is a later step's, already faulted in, and a
  step takes no faults once the heap has grown. The heap holds what the process once used: with
  the next step dispatched while one runs, two temp buffers;
- glibc with `glibc.malloc.hugetlb=1`: transparent huge pages for its large blocks, so the
  re-faulting takes a 512th of the faults (always added, and all there is without jemalloc).
A setting already in the environment (a GLIBC_TUNABLES entry, MALLOC_CONF, jemalloc in
LD_PRELOAD) wins. Both are read once, at process start: `msjax.launch` sets them in its workers'
environment, and `python -m msjax.train` re-executes itself once with them.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from msjax.errors import ConfigError

ALLOCATOR_VAR = "MSJAX_ALLOCATOR"  # auto (jemalloc if installed, else glibc) | glibc | off
ALLOCATOR_CHOICES = ("auto", "glibc", "off")
FORMER_OPT_OUT_VAR = "MSJAX_MALLOC_HUGETLB"  # "0": the same as MSJAX_ALLOCATOR=off
TUNABLES_VAR = "GLIBC_TUNABLES"
HUGETLB_TUNABLE = "glibc.malloc.hugetlb"
HUGETLB_SETTING = f"{HUGETLB_TUNABLE}=1"  # madvise(MADV_HUGEPAGE) on glibc's mmapped blocks
PRELOAD_VAR = "LD_PRELOAD"
JEMALLOC_NAMES = ("libjemalloc.so.2", "libjemalloc.so")  # the files looked for in library_dirs()
JEMALLOC_CONF_VAR = "MALLOC_CONF"
# huge pages for the heap and jemalloc's own tables; large blocks in the one arena; never purge
JEMALLOC_CONF = (
    "thp:always,metadata_thp:auto,narenas:1,oversize_threshold:0,"
    "dirty_decay_ms:-1,muzzy_decay_ms:-1"
)
ALLOCATOR_VARS = (TUNABLES_VAR, PRELOAD_VAR, JEMALLOC_CONF_VAR)
REEXEC_MARKER_VAR = "MSJAX_ALLOCATOR_REEXEC"  # set in a re-executed process: never twice


def on_glibc() -> bool:
    """Whether this is Linux with glibc (the only place these settings mean anything)."""
    return sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def allocator_choice(env: Mapping[str, str]) -> str:
    """What the environment asks for: auto, glibc or off (a ConfigError naming them if not)."""
    if env.get(FORMER_OPT_OUT_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        return "off"
    choice = env.get(ALLOCATOR_VAR, "auto").strip().lower() or "auto"
    if choice not in ALLOCATOR_CHOICES:
        raise ConfigError(
            f"{ALLOCATOR_VAR}={choice!r}: expected one of {', '.join(ALLOCATOR_CHOICES)}"
        )
    return choice


def library_dirs() -> list[Path]:
    """Where distributions install shared libraries (Debian's multiarch folder first)."""
    multiarch = f"/usr/lib/{platform.machine()}-linux-gnu"
    return [Path(folder) for folder in (multiarch, "/usr/lib64", "/usr/lib", "/usr/local/lib")]


@functools.cache
def jemalloc_library() -> str | None:
    """The installed jemalloc's path for LD_PRELOAD, or None."""
    for folder in library_dirs():
        for name in JEMALLOC_NAMES:
            if (folder / name).is_file():
                return str(folder / name)
    return None


def _tunables_with_hugetlb(tunables: str) -> str:
    """GLIBC_TUNABLES with the huge-page setting added; a hugetlb value already there wins."""
    entries = [entry for entry in tunables.split(":") if entry]
    if any(entry.partition("=")[0] == HUGETLB_TUNABLE for entry in entries):
        return tunables
    return ":".join([*entries, HUGETLB_SETTING])


def allocator_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with msjax's malloc settings, keeping what the environment already sets."""
    env = dict(env)
    choice = allocator_choice(env)
    if not on_glibc() or choice == "off":
        return env
    env[TUNABLES_VAR] = _tunables_with_hugetlb(env.get(TUNABLES_VAR, ""))
    library = jemalloc_library() if choice == "auto" else None
    preload = env.get(PRELOAD_VAR, "")
    if library is not None and "jemalloc" not in preload:
        env[PRELOAD_VAR] = ":".join(entry for entry in (library, preload) if entry)
        if not env.get(JEMALLOC_CONF_VAR):
            env[JEMALLOC_CONF_VAR] = JEMALLOC_CONF
    return env


def reexec_with_allocator(environ: Mapping[str, str] = os.environ) -> None:
    """Re-execute this process with the allocator settings, if it lacks them; returns otherwise.

    Same pid, argv and interpreter options (`sys.orig_argv`), so exit codes and signals reach
    whoever started it unchanged. The marker variable makes a second re-exec impossible.
    """
    if environ.get(REEXEC_MARKER_VAR):
        return
    wanted = allocator_env(environ)
    if all(wanted.get(name) == environ.get(name) for name in ALLOCATOR_VARS):
        return
    wanted[REEXEC_MARKER_VAR] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    argv: Sequence[str] = sys.orig_argv
    os.execve(sys.executable, list(argv), wanted)


def malloc_in_use(maps: Path = Path("/proc/self/maps")) -> str:
    """`jemalloc` if this process has it loaded, else `glibc` (or `system` off Linux/glibc)."""
    if not on_glibc():
        return "system"
    try:
        loaded = maps.read_text()
    except OSError:
        return "glibc"
    return "jemalloc" if "libjemalloc" in loaded else "glibc"


def allocator_record(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """What this process's allocator runs with, for the run dir."""
    tunables = environ.get(TUNABLES_VAR, "")
    return {
        "malloc": malloc_in_use(),
        "choice": allocator_choice(environ),
        TUNABLES_VAR: tunables,
        "malloc_hugetlb": on_glibc() and HUGETLB_SETTING in tunables.split(":"),
        JEMALLOC_CONF_VAR: environ.get(JEMALLOC_CONF_VAR, ""),
    }
