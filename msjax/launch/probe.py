"""A training probe of an excluded slot before it is re-admitted: a slot left out for crashing
(or hanging) passes a self-check as easily as a healthy one, so once its self-check passes it
also trains alone, on the job's data and model shrunk onto one process, from step 0 past the step
it failed at. It is re-admitted only if the probe reaches that step and exits 0; otherwise it stays
out (an incident, action `stay_excluded`) for a time out twice as long."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from msjax.config import Config
from msjax.launch.incidents import Incident
from msjax.launch.membership import Slots
from msjax.launch.workers import WorkerProcess, describe_exit
from msjax.resilience.faults import ENV_VAR as FAULT_ENV_VAR
from msjax.resilience.faults import SLOT_ENV_VAR
from msjax.run_dir import RunDir, write_text_atomically

STAY_EXCLUDED = "stay_excluded"  # the incident's action when a slot fails its probe


@dataclass
class SlotProbe:
    """A slot's training probe, under way: `steps` steps of msjax.train alone in the slot."""

    slot: int
    steps: int
    health: str  # the self-check verdict it passed before (relative to the job's run dir)
    worker: WorkerProcess
    run_dir: Path  # the probe's own run dir, inside the job's (RunDir.probe)
    started_unix_s: float
    deadline: float  # monotonic: init, data, compile and its steps' deadlines

    def settled(self) -> bool:
        """Whether the probe has exited, or its deadline has passed (it is then killed)."""
        if self.worker.poll() is not None:
            return True
        if time.monotonic() < self.deadline:
            return False
        self.worker.signal(9)
        self.worker.wait(10.0)
        return True

    def failure(self) -> str | None:
        """None when the probe reached its steps (exit 0); else what went wrong, in one line."""
        code = self.worker.poll()
        self.worker.close()
        if code == 0:
            return None
        log = self.worker.log_path.relative_to(self.run_dir.parents[1])
        if code is None or (time.monotonic() >= self.deadline and code == -9):
            return f"its probe of {self.steps} steps did not end within its deadline ({log})"
        return f"its probe of {self.steps} steps ended with {describe_exit(code)} ({log})"


def start_probe(
    config: Config,
    slot: int,
    steps: int,
    run_dir: RunDir,
    faults: str | None,
    devices_per_proc: int | None,
    number: int,
    health: str,
) -> SlotProbe:
    """The probe of `slot` started: config is the job's shrunk onto one process; `number` names
    its run dir (RUN_DIR/probes/slot<S>-<number>). The job's injected-fault firings are copied
    in, so that an injected fault with `times` counts the job's firings."""
    probe_dir = run_dir.probe(slot, number)
    probe_dir.mkdir(parents=True, exist_ok=True)
    if run_dir.faults.exists():
        shutil.copyfile(run_dir.faults, RunDir(probe_dir).faults)
    resilience = config.resilience
    probe_config = dataclasses.replace(
        config,
        train=dataclasses.replace(config.train, steps=steps, eval_every=0),
        checkpoint=dataclasses.replace(config.checkpoint, enabled=False, resume_from=None),
        run=dataclasses.replace(config.run, dir=str(probe_dir)),
    )
    config_path = probe_dir.parent / f"{probe_dir.name}.yaml"
    write_text_atomically(config_path, probe_config.to_yaml())
    env = {**os.environ, "PYTHONUNBUFFERED": "1", SLOT_ENV_VAR: str(slot)}
    if devices_per_proc is not None:
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_proc)
    if faults:
        env[FAULT_ENV_VAR] = faults
    command = [sys.executable, "-m", "msjax.train", "--config", str(config_path)]
    worker = WorkerProcess(0, command, env, run_dir.probe_log(slot), number, echo=None)
    budget_s = (
        resilience.init_deadline_s
        + resilience.data_deadline_s
        + resilience.compile_deadline_s
        + steps * resilience.step_deadline_s
    )
    deadline = time.monotonic() + budget_s
    return SlotProbe(slot, steps, health, worker, probe_dir, time.time(), deadline)


def probe_failed_incident(
    number: int, probe: SlotProbe, why: str, attempt: int, step: int, slots: Slots
) -> Incident:
    """The incident of a slot whose probe failed: it stays excluded."""
    now = time.time()
    diagnostics = str(probe.worker.log_path.relative_to(probe.run_dir.parents[1]))
    return Incident(
        incident=number,
        cause="crash",
        rank=None,  # the slot holds no rank while excluded
        detail=f"slot {probe.slot}, probed for re-admission: {why}",
        attempt=attempt,
        phase="probe",
        step=step,
        fault_unix_s=probe.started_unix_s,
        fault_time_from="the probe's start",
        detected_unix_s=now,
        detection_latency_s=round(now - probe.started_unix_s, 3),
        stop_s=0.0,
        diagnostics=diagnostics,
        flight_recorder=None,
        action=STAY_EXCLUDED,
        membership={
            "action": STAY_EXCLUDED,
            "slot": probe.slot,
            "checked_unix_s": now,
            "probe": str(probe.run_dir.relative_to(probe.run_dir.parents[1])),
            "slots": slots.describe(),
        },
    )
