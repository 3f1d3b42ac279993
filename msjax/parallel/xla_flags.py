"""`train.xla_profile`: the XLA flags that overlap GPU collectives with compute, as spelled by the
installed jaxlib; set in XLA_FLAGS before JAX's backend starts, the user's own XLA_FLAGS winning.
Then XLA_FLAGS is checked by XLA itself, so a flag it rejects is a user error, not an abort.
"""

from __future__ import annotations

import functools
import importlib.util
import mmap
import os
import re
import select
import signal
import sys
import time
from collections.abc import Iterable, MutableMapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from msjax.errors import MsjaxError

PROFILES = ("none", "overlap")

# What the overlap profile asks of XLA, one entry per purpose; each lists its spellings, newest
# release's first, and the first one the installed jaxlib knows is passed.
OVERLAP: dict[str, tuple[tuple[str, str], ...]] = {
    "latency-hiding scheduler": (("xla_gpu_enable_latency_hiding_scheduler", "true"),),
    "pipelined all-gather": (
        ("xla_gpu_pipeline_all_gather", "on"),
        ("xla_gpu_enable_pipelined_all_gather", "true"),
    ),
    "pipelined reduce-scatter": (
        ("xla_gpu_pipeline_reduce_scatter", "on"),
        ("xla_gpu_enable_pipelined_reduce_scatter", "true"),
    ),
    "pipelined all-reduce": (
        ("xla_gpu_pipeline_all_reduce", "on"),
        ("xla_gpu_enable_pipelined_all_reduce", "true"),
    ),
    "pipelined point-to-point": (
        ("xla_gpu_pipeline_p2p", "on"),
        ("xla_gpu_enable_pipelined_p2p", "true"),
    ),
    "while-loop double buffering": (("xla_gpu_enable_while_loop_double_buffering", "true"),),
    "collective matmul streams": (("xla_gpu_multi_streamed_windowed_einsum", "true"),),
    "collective matmul threshold": (("xla_gpu_threshold_for_windowed_einsum_mib", "0"),),
    "collectives on the highest-priority stream": (
        ("xla_gpu_enable_highest_priority_async_stream", "true"),
    ),
}

_FLAG_NAME = re.compile(rb"xla_[a-z0-9_]+")
_CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13", "jax_cuda12_plugin")


def jaxlib_libraries() -> list[Path]:
    """The shared libraries of the installed jaxlib (and CUDA plugin) that define XLA's flags."""
    spec = importlib.util.find_spec("jaxlib")
    roots = [Path(spec.origin).parent] if spec and spec.origin else []
    for name in _CUDA_PLUGINS:
        try:
            plugin = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            plugin = None
        if plugin and plugin.submodule_search_locations:
            roots += [Path(location) for location in plugin.submodule_search_locations]
    return sorted({path for root in roots for path in root.glob("*.so")})


@functools.lru_cache(maxsize=8)
def known_xla_flags(libraries: tuple[Path, ...] | None = None) -> frozenset[str]:
    """Every `xla_*` name compiled into the libraries: the flags this jaxlib's XLA accepts.

    XLA registers its flags from the DebugOptions fields it was built with, so their names sit
    in the binary as strings; a flag missing here would abort XLA when it parses XLA_FLAGS.
    """
    names: set[str] = set()
    for library in libraries if libraries is not None else tuple(jaxlib_libraries()):
        with library.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m:
            names.update(match.decode() for match in _FLAG_NAME.findall(m))
    return frozenset(names)


def profile_flags(profile: str, known: Iterable[str]) -> tuple[list[str], list[str]]:
    """(`--name=value` flags for the profile, purposes this jaxlib has no flag for)."""
    if profile not in PROFILES:
        raise ValueError(f"xla_profile {profile!r}; accepted: {', '.join(PROFILES)}")
    if profile == "none":
        return [], []
    known = frozenset(known)
    flags, missing = [], []
    for purpose, spellings in OVERLAP.items():
        chosen = next(((name, value) for name, value in spellings if name in known), None)
        if chosen is None:
            missing.append(purpose)
        else:
            flags.append(f"--{chosen[0]}={chosen[1]}")
    return flags, missing


def flag_names(xla_flags: str) -> set[str]:
    """The flag names in an XLA_FLAGS string."""
    return {word.lstrip("-").split("=", 1)[0] for word in xla_flags.split() if word.startswith("-")}


def gpu_expected(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether JAX will start on a GPU, judged without starting it: a CUDA plugin is installed
    and JAX_PLATFORMS (when set) names cuda or gpu."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and not {"cuda", "gpu"} & set(platforms.lower().split(",")):
        return False
    for name in _CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:
            continue
    return False


@dataclass
class XlaFlagsRecord:
    """What `apply_xla_profile` did, for the run directory."""

    profile: str
    applied: bool  # whether msjax added flags to XLA_FLAGS
    reason: str
    flags: list[str] = field(default_factory=list)  # msjax's flags that reached XLA_FLAGS
    overridden_by_user: list[str] = field(default_factory=list)  # names the user set already
    unavailable: list[str] = field(default_factory=list)  # purposes this jaxlib has no flag for
    user_xla_flags: str = ""
    xla_flags: str = ""  # XLA_FLAGS as XLA reads it

    def record(self) -> dict[str, Any]:
        return asdict(self)


def apply_xla_profile(
    profile: str,
    environ: MutableMapping[str, str] = os.environ,
    on_gpu: bool | None = None,
    known: Iterable[str] | None = None,
) -> XlaFlagsRecord:
    """Add the profile's flags to XLA_FLAGS; call before JAX's backend starts (it reads them once).

    A no-op on CPU and for `none`. Flags the user already set in XLA_FLAGS keep the user's value;
    only flags the installed jaxlib knows are added (an unknown one would abort XLA). Then
    XLA_FLAGS as XLA will read it is checked (`check_xla_flags`): MsjaxError if XLA rejects it.
    """
    record = _add_profile_flags(profile, environ, on_gpu, known)
    if record.xla_flags.strip() and not _backend_started():
        problem = check_xla_flags(record.xla_flags)
        if problem is not None:
            added = f" (train.xla_profile={profile} added {' '.join(record.flags)})"
            raise MsjaxError(
                f"XLA rejects XLA_FLAGS={record.xla_flags!r}: {problem}"
                + (added if record.flags else "")
                + "; fix or remove that flag"
                + (", or set train.xla_profile=none" if record.flags else "")
            )
    return record


def _backend_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _add_profile_flags(
    profile: str,
    environ: MutableMapping[str, str],
    on_gpu: bool | None,
    known: Iterable[str] | None,
) -> XlaFlagsRecord:
    user = environ.get("XLA_FLAGS", "")
    record = XlaFlagsRecord(profile, False, "", user_xla_flags=user, xla_flags=user)
    if profile == "none":
        record.reason = "train.xla_profile=none"
        return record
    if not (gpu_expected(environ) if on_gpu is None else on_gpu):
        record.reason = "no GPU: the overlap flags apply to GPUs only"
        return record
    if _backend_started():
        record.reason = "JAX's backend had already started; XLA_FLAGS left as they were"
        return record
    flags, record.unavailable = profile_flags(
        profile, known_xla_flags() if known is None else known
    )
    user_names = flag_names(user)
    record.overridden_by_user = [flag for flag in flags if flag_names(flag) & user_names]
    record.flags = [flag for flag in flags if not flag_names(flag) & user_names]
    record.xla_flags = " ".join([*record.flags, user]).strip()
    environ["XLA_FLAGS"] = record.xla_flags
    record.applied = True
    record.reason = "GPU run with train.xla_profile=overlap"
    return record


CHECK_TIMEOUT_S = 60  # parsing flags takes well under a second; past this, the check gives up
# What XLA logs before it aborts on XLA_FLAGS (parse_flags_from_env.cc, command_line_flags.cc)
_REJECTION = re.compile(
    r"(Unknown flags? in XLA_FLAGS.*|Couldn't interpret value.*|Could not open file.*"
    r"|Illegal value.*)"
)


def check_xla_flags(xla_flags: str) -> str | None:
    """Why XLA rejects this XLA_FLAGS string, or None if it accepts it (or cannot be asked).

    XLA parses XLA_FLAGS once, when its first backend starts, and aborts the process on a flag
    it does not know or a value it cannot read. So a forked copy of this process (JAX already
    imported, no backend yet) starts XLA's CPU backend with these flags and reports back how it
    went: about 0.1 s, instead of an abort that looks like a crash and is retried.
    """
    import jax  # imported before the fork, so that the child need not import it again

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only XLA's verdict leaves it
        try:
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            os.environ["XLA_FLAGS"] = xla_flags
            jax.config.update("jax_platforms", "cpu")
            jax.devices("cpu")
            code = 0
        except BaseException as error:  # a failure of the check itself, not of the flags
            print(f"msjax-xla-check-failed {error}", file=sys.stderr, flush=True)
            code = 3
        os._exit(code)
    os.close(write_end)
    output, timed_out = _read_until_exit(read_end, pid)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    status = os.waitstatus_to_exitcode(status)
    if status == 0 or timed_out or "msjax-xla-check-failed" in output:
        return None  # accepted, or the check itself could not run: XLA will judge at start
    match = _REJECTION.search(output)
    if match:
        return match.group(1).strip()
    return f"XLA exited with status {status} while reading it"


def _read_until_exit(read_end: int, pid: int) -> tuple[str, bool]:
    """What the child wrote until it closed its end, and whether it ran past the timeout (then
    it is killed)."""
    chunks, deadline = [], time.monotonic() + CHECK_TIMEOUT_S
    timed_out = False
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            os.kill(pid, signal.SIGKILL)
            timed_out = True
            break
        ready, _, _ = select.select([read_end], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(read_end, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace"), timed_out
