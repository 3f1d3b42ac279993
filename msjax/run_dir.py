"""The run directory: choosing it, refusing to mix two different runs in it, never deleting one.

Rerunning a command with the same `run.dir` continues that run. A config that differs in what
defines the run (model, data, optimizer, batch, seed) is refused unless `run.overwrite=true`,
which moves the earlier run's files into `previous-<UTC timestamp>/` inside the directory.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import yaml

from msjax.config import Config, config_from_dict
from msjax.errors import ConfigError, MsjaxError

# Keys that may change between the runs that share a run directory (a resume may run on another
# mesh, train longer, or evaluate differently); everything else defines the run.
MAY_CHANGE_ON_RESUME = frozenset(
    {
        "mesh",
        "checkpoint",
        "observe",
        "resilience",
        "run.dir",
        "run.name",
        "run.overwrite",
        "train.steps",
        "train.eval_every",
        "train.eval_batches",
        "train.peak_tflops",
        "data.prefetch_batches",
        "data.num_workers",
        "data.cache_dir",
    }
)


@dataclass(frozen=True)
class RunDirPlan:
    """What to do with the run directory, decided before anything is written."""

    path: Path
    continues_run: bool  # it holds a run of the same config: resume it
    set_aside: bool  # it holds a run of another config and run.overwrite=true


def differences(before: Config, after: Config) -> list[str]:
    """`section.key: old -> new` for each key that defines the run and differs."""
    changed = []
    old, new = before.to_dict(), after.to_dict()
    for section, values in new.items():
        if section in MAY_CHANGE_ON_RESUME:
            continue
        for key, value in values.items():
            name = f"{section}.{key}"
            if name not in MAY_CHANGE_ON_RESUME and old[section].get(key) != value:
                changed.append(f"{name}: {old[section].get(key)!r} -> {value!r}")
    return changed


def plan_run_dir(config: Config) -> RunDirPlan:
    """Decide how to use run.dir (or a new timestamped one); raise if it holds another run."""
    if config.run.dir:
        path = Path(config.run.dir)
    else:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{config.run.name}-{stamp}"
    if path.exists() and not path.is_dir():
        raise MsjaxError(f"run.dir={path} exists and is not a directory")
    saved_config = path / "config.yaml"
    if not saved_config.exists():
        return RunDirPlan(path, continues_run=False, set_aside=False)
    try:
        previous = config_from_dict(yaml.safe_load(saved_config.read_text()) or {})
    except (ConfigError, yaml.YAMLError) as error:
        previous, changed = None, [f"its config.yaml is not readable ({error})"]
    else:
        changed = differences(previous, config)
    if not changed:
        return RunDirPlan(path, continues_run=True, set_aside=False)
    if not config.run.overwrite:
        shown = "; ".join(changed[:3]) + (
            f"; and {len(changed) - 3} more" if len(changed) > 3 else ""
        )
        raise MsjaxError(
            f"run.dir={path} holds a run of another config ({shown}); choose another run.dir, "
            "or set run.overwrite=true to start afresh there (the old files are kept aside)"
        )
    return RunDirPlan(path, continues_run=False, set_aside=True)


def create_run_dir(plan: RunDirPlan) -> Path | None:
    """Create the directory; with set_aside, move the earlier run into previous-<stamp>/."""
    plan.path.mkdir(parents=True, exist_ok=True)
    if not plan.set_aside:
        return None
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    aside = plan.path / f"previous-{stamp}"
    aside.mkdir()
    for entry in plan.path.iterdir():
        if entry != aside and not entry.name.startswith("previous-"):
            shutil.move(str(entry), aside / entry.name)
    return aside
