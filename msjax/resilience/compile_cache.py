"""Compilation caches, so a restarted worker loads its programs instead of compiling them again:
JAX's persistent cache (this user's, never in a run dir) and, for the train step, one serialized
executable per process, signed so that only what this user's msjax wrote loads.

An executable that JAX itself loaded from its persistent cache serializes without all of its
code (XLA:CPU, jax 0.10 and 0.12: the entry loads, then its first result fails with "NOT_FOUND:
Function ... not found"), so only a program compiled in this process is written here; and an
entry that fails at its first step anyway is dropped, never fatal (StaleCompileCache)."""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
import sys
import threading
from pathlib import Path
from typing import Any

from msjax.config import DataConfig, ResilienceConfig
from msjax.data.sources import resolve_cache_dir
from msjax.run_dir import RunDir

ENTRY_MAGIC = b"msjax-signed-executable-v1\n"
KEY_FILE = "compile_cache.key"  # in the user's msjax cache folder, never in a run dir
JAX_CACHE_FOLDER = "jax_compile_cache"  # in the same folder: JAX's entries are native code
JAX_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # jax.monitoring, jax 0.10 and 0.12


class StaleCompileCache(Exception):
    """An executable loaded from this process's compile cache failed at its first step; its entry
    is dropped, and the next attempt compiles afresh (not the machine's fault, nor the user's)."""

    def __init__(self, entry: Path, error: BaseException):
        super().__init__(
            f"the executable loaded from {entry} failed at its first step "
            f"({_first_line(error)}); the entry is dropped and the restart compiles afresh"
        )
        self.entry = entry


def compile_cache_dir(resilience: ResilienceConfig, run_dir: Path, launched: bool) -> Path | None:
    """The signed executables' directory: compile_cache_dir if set, else RUN_DIR/compile_cache
    for a worker started by msjax.launch (launched); None when off (a plain one-process run by
    default)."""
    if not resilience.compile_cache:
        return None
    if resilience.compile_cache_dir:
        return Path(resilience.compile_cache_dir)
    return RunDir(run_dir).compile_cache if launched else None


def jax_cache_dir(resilience: ResilienceConfig) -> Path:
    """JAX's persistent cache: compile_cache_dir if set, else in this user's msjax cache folder.
    Never in a run dir: its entries are native code that JAX loads unsigned, and a run dir may
    have been handed over (copied or unpacked, so owned by this user)."""
    if resilience.compile_cache_dir:
        return Path(resilience.compile_cache_dir)
    return resolve_cache_dir(DataConfig()) / JAX_CACHE_FOLDER


def enable_compile_cache(
    resilience: ResilienceConfig, run_dir: Path, launched: bool
) -> Path | None:
    """Point JAX at its cache directory, caching every program however fast it compiled; the
    signed executables' directory, or None when off. Both must be this user's own folders that
    no one else can write, or the cache is off (one line says why)."""
    import jax

    directory = compile_cache_dir(resilience, run_dir, launched)
    if directory is None:
        return None
    native = jax_cache_dir(resilience)
    for folder in dict.fromkeys((directory, native)):
        problem = untrusted_folder(folder)
        if problem is not None:
            print(f"msjax: compile cache off: {problem}", file=sys.stderr)
            return None
    jax.config.update("jax_compilation_cache_dir", str(native.absolute()))
    # defaults skip programs compiled in under 1 s: a restart wants every one of them
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return directory


def untrusted_folder(folder: Path) -> str | None:
    """Why folder (made, private, if missing) is not safe for cache entries: not a directory,
    owned by another user, or writable by others, who could plant entries; None if it is."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        status = folder.stat()
    except OSError as error:
        return f"{folder} cannot be made ({error.strerror})"
    if not stat.S_ISDIR(status.st_mode):
        return f"{folder} is not a directory"
    if status.st_uid != os.getuid():
        return f"{folder} belongs to user id {status.st_uid}, not this user ({os.getuid()})"
    if status.st_mode & 0o022:
        return (
            f"{folder} is writable by others (mode {stat.S_IMODE(status.st_mode):o}); "
            "chmod go-w it to cache there"
        )
    return None


def compile_cached(lowered: Any, directory: Path | None, name: str) -> Any:
    """lowered.compile(), or the executable this process saved for the same program before.

    JAX's persistent cache only ever writes from process 0, and other processes' keys differ
    (jax 0.10), so without this every restart recompiles on ranks > 0 and the job waits for
    them. Each process keeps its own serialized executable here, keyed by program, versions,
    process and devices. Loading one unpickles it, so an entry is loaded only when its HMAC
    matches this user's key (kept outside run dirs): a run dir or cache handed over by someone
    else is compiled afresh, never executed.
    """
    if directory is None:
        return lowered.compile()
    from jax.experimental import serialize_executable

    path = cache_entry(lowered, directory, name)
    key = signing_key()
    payload = read_signed(path, key, path.name)
    if payload is not None:
        try:
            loaded = serialize_executable.deserialize_and_load(
                payload, lowered.in_tree, lowered.out_tree
            )
            return CheckedOnFirstCall(loaded, path)
        except Exception as error:  # a stale entry of our own: compile afresh and replace it
            print(f"msjax: compile cache entry {path} not usable ({error}); compiling")
    hits_before = jax_cache_hits()
    compiled = lowered.compile()
    if jax_cache_hits() > hits_before:
        # JAX loaded it from its own cache: serialized again, it would lack code; JAX's cache
        # serves the restart as it served this attempt (and a stale entry of ours must go)
        path.unlink(missing_ok=True)
    elif key is not None:
        write_signed(path, key, serialize_executable.serialize(compiled)[0])
    return compiled


def write_signed(path: Path, key: bytes, payload: bytes) -> None:
    """A cache entry at path (atomically): payload, signed with key for this name."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_bytes(ENTRY_MAGIC + _signature(key, path.name, payload) + payload)
    os.replace(partial, path)


class CheckedOnFirstCall:
    """A loaded executable whose first call waits for its results: one that fails there raises
    StaleCompileCache after dropping its entry. Later calls go straight through; everything
    else (cost and memory analysis, the HLO text) is the executable's own."""

    def __init__(self, executable: Any, entry: Path):
        self.executable = executable
        self.entry = entry
        self.checked = False

    def __call__(self, *args: Any) -> Any:
        if self.checked:
            return self.executable(*args)
        import jax

        try:
            outputs = jax.block_until_ready(self.executable(*args))
        except jax.errors.JaxRuntimeError as error:
            self.entry.unlink(missing_ok=True)
            raise StaleCompileCache(self.entry, error) from error
        self.checked = True
        return outputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.executable, name)


_jax_cache_hits = 0
_hits_lock = threading.Lock()
_listening = False


def jax_cache_hits() -> int:
    """How many programs JAX's persistent cache has served in this process (counted from the
    first call on, through jax.monitoring)."""
    global _listening
    with _hits_lock:
        if not _listening:
            import jax

            jax.monitoring.register_event_listener(_count_jax_cache_hit)
            _listening = True
        return _jax_cache_hits


def _count_jax_cache_hit(event: str, **_: Any) -> None:
    global _jax_cache_hits
    if event == JAX_CACHE_HIT_EVENT:
        with _hits_lock:
            _jax_cache_hits += 1


def cache_entry(lowered: Any, directory: Path, name: str) -> Path:
    """Where this process keeps the executable of `lowered` (program `name`)."""
    import jax

    return directory / f"{name}-process{jax.process_index()}-{_program_key(lowered)}.xla"


def read_signed(path: Path, key: bytes | None, name: str) -> bytes | None:
    """The payload of a cache entry signed with key for this name, else None (with a note when a
    file is there but was not written by this user's msjax: it is never unpickled)."""
    if key is None or not path.exists():
        return None
    data = path.read_bytes()
    size = len(ENTRY_MAGIC) + hashlib.sha256().digest_size
    signature, payload = data[len(ENTRY_MAGIC) : size], data[size:]
    if data.startswith(ENTRY_MAGIC) and hmac.compare_digest(
        signature, _signature(key, name, payload)
    ):
        return payload
    print(f"msjax: compile cache entry {path} was not written by this user's msjax; compiling")
    return None


def signing_key() -> bytes | None:
    """This user's secret for signing cache entries, made on first use (mode 0600) in the msjax
    cache folder; None (no cache, one line why) unless it is a regular file, reached without
    following a symlink, owned by this user and readable by no one else."""
    folder = resolve_cache_dir(DataConfig())
    path = folder / KEY_FILE
    try:
        if not os.path.lexists(path):
            _make_key(folder, path)
        # O_NOFOLLOW: a link planted in the folder is refused; O_NONBLOCK: a FIFO never blocks
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        reason = "is a symbolic link" if error.errno == errno.ELOOP else f"({error.strerror})"
        print(
            f"msjax: compile cache signing key {path} {reason}; compile cache off", file=sys.stderr
        )
        return None
    with os.fdopen(descriptor, "rb") as file:
        status = os.fstat(file.fileno())
        problem = None
        if not stat.S_ISREG(status.st_mode):
            problem = "is not a regular file"
        elif status.st_uid != os.getuid():
            problem = f"belongs to user id {status.st_uid}, not this user ({os.getuid()})"
        elif status.st_mode & 0o077:
            problem = f"can be read or written by others (mode {stat.S_IMODE(status.st_mode):o})"
        key = file.read() if problem is None else b""
    if problem is None and len(key) < 32:
        problem = f"holds {len(key)} bytes, fewer than 32"
    if problem is not None:
        print(
            f"msjax: compile cache signing key {path} {problem}; compile cache off", file=sys.stderr
        )
        return None
    return key


def _make_key(folder: Path, path: Path) -> None:
    """A new random key at path, atomically (never replacing one another process made)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = folder / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    with os.fdopen(os.open(partial, flags, 0o600), "wb") as file:
        file.write(secrets.token_bytes(32))
        file.flush()
        os.fsync(file.fileno())
    try:
        os.link(partial, path)
    except FileExistsError:
        pass
    finally:
        partial.unlink()


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _signature(key: bytes, name: str, payload: bytes) -> bytes:
    return hmac.new(key, name.encode() + b"\0" + payload, hashlib.sha256).digest()


def _program_key(lowered: Any) -> str:
    import jax
    import jaxlib

    backend = jax.devices()[0].client
    parts = [
        lowered.as_text(),
        jax.__version__,
        jaxlib.__version__,
        backend.platform,
        backend.platform_version,
        f"{jax.process_index()}/{jax.process_count()}",
        " ".join(f"{d.id}:{d.device_kind}:{d.process_index}" for d in jax.devices()),
        os.environ.get("XLA_FLAGS", ""),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
