"""The run directory: `RunDir` names every file and folder in it; choosing, creating and saving.

Rerunning a command with the same `run.dir` continues that run. A config that differs in what
defines the run (model, data, optimizer, batch, seed: `msjax.config.differences`) is refused
unless `run.overwrite=true`, which moves the earlier run's files into `previous-<UTC timestamp>/`
inside the directory. A directory is a run only if msjax wrote it, and msjax never follows a
symbolic link in it.
Nothing outside this module spells a run directory's file names.
"""

from __future__ import annotations

import errno
import json
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from msjax.config import MAY_CHANGE_ON_RESUME, Config, config_from_dict, differences
from msjax.errors import ConfigError, MsjaxError
from msjax.resolve import utc_stamp
from msjax.writable import check_writable_dir, is_temporary_name, read_no_follow
from msjax.writable import write_text_atomically as write_text_atomically

PREVIOUS_PREFIX = "previous-"
_MISSING = object()  # an own file that is not there (not: there, and empty)


@dataclass(frozen=True)
class RunDir:
    """Every file and folder of one run directory, by name."""

    path: Path

    # What the run is: the resolved config, and the corpus it reads.
    @property
    def config_yaml(self) -> Path:
        return self.path / "config.yaml"

    @property
    def config_json(self) -> Path:
        return self.path / "config.json"

    @property
    def job_config(self) -> Path:
        """The config msjax.launch hands its workers (a file, not arguments to parse again)."""
        return self.path / "job_config.yaml"

    @property
    def data_facts(self) -> Path:
        return self.path / "data.json"

    @property
    def xla_flags(self) -> Path:
        """train.xla_profile's flags, the user's XLA_FLAGS, and what XLA was given."""
        return self.path / "xla_flags.json"

    @property
    def mfu_basis(self) -> Path:
        """What each step's MFU is reckoned from: the model FLOPs and the peak, and its source."""
        return self.path / "mfu.json"

    # What the run measured.
    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def ranks(self) -> Path:
        return self.path / "ranks.jsonl"

    @property
    def goodput(self) -> Path:
        return self.path / "goodput.json"

    @property
    def launches(self) -> Path:
        """One record per launcher session of the run (node 0's): its attempts and nodes."""
        return self.path / "launches.jsonl"

    @property
    def report(self) -> Path:
        return self.path / "report"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def profiles(self) -> Path:
        return self.path / "profiles"

    def profile(self, rank: int) -> Path:
        return self.profiles / f"rank{rank}"

    # What restarts need.
    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def lock(self) -> Path:
        """Held (flock) by the job using the directory: msjax.run_lock."""
        return self.path / "job.lock"

    @property
    def compile_cache(self) -> Path:
        return self.path / "compile_cache"

    @property
    def skipped_steps(self) -> Path:
        return self.path / "skipped_steps.json"

    @property
    def faults(self) -> Path:
        return self.path / "faults.jsonl"

    @property
    def replica_mismatches(self) -> Path:
        """Replicas found to differ, and how each mismatch was classified (process 0 writes)."""
        return self.path / "replica_mismatches.jsonl"

    # What each rank leaves behind, and what the supervisor collects after a fault.
    @property
    def heartbeats(self) -> Path:
        return self.path / "heartbeats"

    def heartbeat(self, rank: int) -> Path:
        return self.heartbeats / f"rank{rank}.json"

    def stacks(self, rank: int) -> Path:
        """Where rank's Python stacks go when it receives SIGUSR1."""
        return self.heartbeats / f"stacks-rank{rank}.txt"

    @property
    def flight(self) -> Path:
        return self.path / "flight"

    def flight_record(self, rank: int) -> Path:
        return self.flight / f"rank{rank}.json"

    def flight_records(self) -> list[Path]:
        """Every rank's flight record on disk, in name order."""
        return sorted(self.flight.glob("rank*.json"))

    def log(self, rank: int) -> Path:
        return self.path / "logs" / f"rank{rank}.log"

    @property
    def crashes(self) -> Path:
        """Where a worker that died of an unexpected exception leaves its signature."""
        return self.path / "crashes"

    def crash_record(self, attempt: int, rank: int) -> Path:
        return self.crashes / f"attempt{attempt}-rank{rank}.json"

    def check_log(self, slot: int) -> Path:
        """The output of a slot's self-check for re-admission (resilience.readmit_after_s)."""
        return self.path / "logs" / f"check-slot{slot}.log"

    def spare_log(self, slot: int) -> Path:
        """A spare worker's output while it waits (msjax.launch --spares); once it takes a
        rank, that rank's log."""
        return self.path / "logs" / f"spare-slot{slot}.log"

    @property
    def probes(self) -> Path:
        """The run dirs of excluded slots' training probes for re-admission (msjax.launch.probe)."""
        return self.path / "probes"

    def probe(self, slot: int, number: int) -> Path:
        return self.probes / f"slot{slot}-{number}"

    def probe_log(self, slot: int) -> Path:
        """The output of a slot's training probes for re-admission."""
        return self.path / "logs" / f"probe-slot{slot}.log"

    def standby_log(self, slot: int) -> Path:
        """A warm standby's output while it waits (resilience.warm_standbys); once it takes a
        rank, that rank's log."""
        return self.path / "logs" / f"standby-slot{slot}.log"

    @property
    def incidents_log(self) -> Path:
        return self.path / "incidents.jsonl"

    def incident(self, number: int) -> Path:
        return self.path / "incidents" / str(number)

    # Slots' health (msjax.launch.slots): the faults each slot was the named cause of, the
    # slots marked bad.
    @property
    def health(self) -> Path:
        return self.path / "health"

    @property
    def slot_faults(self) -> Path:
        return self.health / "slot_faults.jsonl"

    @property
    def bad_slots(self) -> Path:
        return self.health / "bad_slots.json"

    # Self-checks (msjax.doctor): each round's verdict, and what each rank measured for it.
    def health_verdict(self, number: int) -> Path:
        return self.health / f"{number}.json"

    def health_rank(self, number: int, rank: int) -> Path:
        return self.health / str(number) / f"rank{rank}.json"

    def previous(self, stamp: str) -> Path:
        return self.path / f"{PREVIOUS_PREFIX}{stamp}"

    def own_names(self) -> frozenset[str]:
        """The names msjax may create directly in a run directory (files and folders)."""
        named = [getattr(self, name) for name, value in vars(RunDir).items() if _is_path(value)]
        named += [self.log(0).parent, self.incident(0).parent]
        return frozenset(path.name for path in named if path.parent == self.path)

    def own_folders(self) -> frozenset[str]:
        """The own names that are folders (the others, with a suffix, are files)."""
        return frozenset(name for name in self.own_names() if "." not in name)

    def saved_config(self) -> dict[str, Any] | None:
        """The resolved config msjax saved here (config.yaml), or None if there is none; a
        config.yaml that msjax did not write (someone's own file) is a MsjaxError."""
        tree = self._read_yaml(self.config_yaml)
        if tree is _MISSING:
            return None
        try:
            twin = json.loads(read_no_follow(self.config_json))
        except (OSError, ValueError):
            twin = None
        # msjax writes config.json, then config.yaml saying the same: only both together are its
        # (compared on what defines the run, so a rerun rewriting them is never caught between)
        defining = _defining(tree)
        if defining is None or defining != _defining(twin):
            raise MsjaxError(
                f"run.dir={self.path} holds a config.yaml that msjax did not write (no "
                f"{self.config_json.name} beside it saying the same), so it is not an msjax run; "
                "choose another run.dir (nothing there was moved or written)"
            )
        return tree

    def launch_config_is_msjax(self) -> bool:
        """Whether job_config.yaml is there and an msjax config (the launcher's, for its workers);
        a job_config.yaml that is not one is a MsjaxError."""
        tree = self._read_yaml(self.job_config)
        if tree is _MISSING:
            return False
        try:
            config_from_dict(tree)
        except ConfigError:
            raise MsjaxError(
                f"run.dir={self.path} holds a {self.job_config.name} that is not an msjax config, "
                "so it is not an msjax run; choose another run.dir (nothing there was written)"
            ) from None
        return True

    def _read_yaml(self, path: Path) -> Any:
        """The YAML in one of the directory's own files; _MISSING if it is not there, MsjaxError if
        it is not a UTF-8 YAML file (msjax writes nothing else)."""
        try:
            text = read_no_follow(path).decode()
        except FileNotFoundError:
            return _MISSING
        except UnicodeDecodeError:
            problem = "is not UTF-8"
        except OSError as error:
            if error.errno not in (errno.ELOOP, errno.EINVAL):
                raise  # an I/O error is not the user's mistake: the retryable crash path
            problem = "is a symbolic link" if error.errno == errno.ELOOP else "is not a file"
        else:
            try:
                return yaml.safe_load(text)
            except yaml.YAMLError:
                problem = "is not valid YAML"
        raise MsjaxError(
            f"run.dir={self.path}: its {path.name} {problem}, so msjax did not write it; choose "
            "another run.dir (nothing there was moved or written)"
        )

    def check_own_entries(self) -> None:
        """MsjaxError (one line) unless every entry with a name msjax writes is what msjax makes
        there: no symbolic link (at the top or in the folders of per-rank files), a file where
        msjax writes a file, a folder where it makes one."""
        folders = self.own_folders()
        entries = [self.path / name for name in sorted(self.own_names())]
        for folder in (self.heartbeats, self.flight, self.log(0).parent, self.incident(0).parent):
            if folder.is_dir() and not folder.is_symlink():
                entries += sorted(folder.iterdir())
        for entry in entries:
            try:
                mode = entry.lstat().st_mode
            except FileNotFoundError:
                continue
            shown = entry.relative_to(self.path)
            if stat.S_ISLNK(mode):
                raise MsjaxError(
                    f"run.dir={self.path}: {shown} is a symbolic link; msjax never follows links "
                    "in a run directory (run.dir itself may be one): remove it or choose another "
                    "run.dir (nothing was written)"
                )
            if entry.parent != self.path:
                continue
            wanted = stat.S_ISDIR if entry.name in folders else stat.S_ISREG
            if not wanted(mode):
                made = "folder" if entry.name in folders else "file"
                raise MsjaxError(
                    f"run.dir={self.path}: its {shown} is {_kind(mode)}, not the {made} msjax "
                    "makes there; choose another run.dir (nothing was written)"
                )

    def foreign_entries(self) -> list[str]:
        """What is in the directory that msjax did not put there (earlier runs set aside and
        temporary files of a killed writer apart)."""
        own = self.own_names()
        return sorted(
            entry.name
            for entry in self.path.iterdir()
            if entry.name not in own
            and not entry.name.startswith(PREVIOUS_PREFIX)
            and not is_temporary_name(entry.name)
        )


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISREG, "a file"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "a device"


def _defining(tree: Any) -> str | None:
    """A saved config tree's keys that define the run, as canonical JSON (None if not a tree)."""
    if not isinstance(tree, dict) or not all(isinstance(v, dict) for v in tree.values()):
        return None
    kept = {
        section: {
            key: value
            for key, value in values.items()
            if f"{section}.{key}" not in MAY_CHANGE_ON_RESUME
        }
        for section, values in tree.items()
        if section not in MAY_CHANGE_ON_RESUME
    }
    return json.dumps(kept, sort_keys=True, default=repr)


def _is_path(value: object) -> bool:
    return isinstance(value, property) and value.fget.__annotations__.get("return") == "Path"


def save_config(config: Config, run_dir: RunDir) -> None:
    """The resolved config, as YAML for people and JSON for tools; the JSON first, as config.yaml
    counts as msjax's only with a config.json beside it that says the same."""
    write_text_atomically(run_dir.config_json, json.dumps(config.to_dict(), indent=2))
    write_text_atomically(run_dir.config_yaml, config.to_yaml())


@dataclass(frozen=True)
class RunDirPlan:
    """What to do with the run directory, decided before anything is written."""

    run_dir: RunDir
    continues_run: bool  # it holds a run of the same config: resume it
    set_aside: bool  # it holds a run of another config and run.overwrite=true

    @property
    def path(self) -> Path:
        return self.run_dir.path


def check_output_dirs(config: Config) -> None:
    """Every directory the run will write (run dir, corpus cache, compile cache) can be written."""
    from msjax.data.sources import resolve_cache_dir

    cache_dir = resolve_cache_dir(config.data)  # found before the checks, which all write
    check_writable_dir(Path(config.run.dir or "."), "run.dir")
    cache_key = "data.cache_dir" if config.data.cache_dir else "MSJAX_CACHE_DIR (or ~/.cache/msjax)"
    check_writable_dir(cache_dir, cache_key)
    compile_cache = config.resilience.compile_cache_dir
    if config.resilience.compile_cache and compile_cache:
        check_writable_dir(Path(compile_cache), "resilience.compile_cache_dir")


def plan_run_dir(config: Config) -> RunDirPlan:
    """Decide how to use run.dir (set by msjax.resolve); raise if it holds another run."""
    if not config.run.dir:
        raise ValueError("plan_run_dir needs a resolved config (run.dir set)")
    run_dir = RunDir(Path(config.run.dir))
    path = run_dir.path
    check_output_dirs(config)
    if path.is_dir():
        run_dir.check_own_entries()
    foreign = run_dir.foreign_entries() if path.is_dir() else []
    # msjax has started a run here: process 0 saved its config, or a launcher its workers'
    saved = run_dir.saved_config() if path.is_dir() else None
    launched = saved is None and path.is_dir() and run_dir.launch_config_is_msjax()
    if foreign and saved is None and not launched:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise MsjaxError(
            f"run.dir={path} is not empty and holds no msjax run ({shown}); choose an "
            "empty or new directory (nothing was written there)"
        )
    if saved is None:
        return RunDirPlan(run_dir, continues_run=False, set_aside=False)
    try:
        previous = config_from_dict(saved)
    except ConfigError as error:
        previous, changed = None, [f"its config.yaml is not readable ({error})"]
    else:
        changed = differences(previous, config)
    if not changed:
        return RunDirPlan(run_dir, continues_run=True, set_aside=False)
    if not config.run.overwrite:
        shown = "; ".join(changed[:3]) + (
            f"; and {len(changed) - 3} more" if len(changed) > 3 else ""
        )
        raise MsjaxError(
            f"run.dir={path} holds a run of another config ({shown}); choose another run.dir, "
            "or set run.overwrite=true to start afresh there (the old files are kept aside)"
        )
    return RunDirPlan(run_dir, continues_run=False, set_aside=True)


def create_run_dir(plan: RunDirPlan) -> Path | None:
    """Create the directory; with set_aside, move the earlier run's files (msjax's own, nothing
    else) into previous-<stamp>/."""
    plan.path.mkdir(parents=True, exist_ok=True)
    if not plan.set_aside:
        return None
    aside = plan.run_dir.previous(utc_stamp())
    aside.mkdir()
    own = plan.run_dir.own_names() - {plan.run_dir.lock.name}  # the lock stays with its holder
    for entry in plan.path.iterdir():
        if entry.name in own:
            shutil.move(str(entry), aside / entry.name)
    return aside
