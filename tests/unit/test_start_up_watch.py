"""The start-up watch and failed saves, piece by piece: per-phase deadlines, heartbeat progress,
abandoned token-store writes, the save retry pause and the bound on unsaved time."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from msjax.config import Config, ResilienceConfig, load_config
from msjax.data.token_store import (
    TokenStoreWriter,
    write_progress,
)
from msjax.errors import ConfigError
from msjax.launch.fault_detection import deadline_s
from msjax.resilience.heartbeat import Heartbeat, HeartbeatRecord


def test_each_start_up_phase_has_its_own_deadline():
    resilience = ResilienceConfig(
        init_deadline_s=1, data_deadline_s=2, restore_deadline_s=3, compile_deadline_s=4
    )
    phases = ("init", "data", "restore", "compile", "eval", "step")
    assert [deadline_s(resilience, phase) for phase in phases] == [1, 2, 3, 4, 4, 120]


def test_heartbeat_carries_progress_within_a_phase_and_old_records_still_read(tmp_path):
    heartbeat = Heartbeat(tmp_path, rank=0, every_s=0.0)
    heartbeat.beat("data", progress=1234)
    record = HeartbeatRecord.read(heartbeat.path)
    assert (record.phase, record.progress) == ("data", 1234)
    old = heartbeat.path.read_text().replace(', "progress": 1234', "")
    heartbeat.path.write_text(old)
    assert HeartbeatRecord.read(heartbeat.path).progress == 0


def test_token_writers_report_their_progress_to_listeners(tmp_path):
    seen: list[int] = []
    with write_progress(seen.append), TokenStoreWriter(tmp_path / "train.bin", "uint16") as w:
        w.append(np.arange(5))
        w.append(np.arange(3))
        w.commit({})
    with TokenStoreWriter(tmp_path / "other.bin", "uint16") as w:
        w.append(np.arange(2))  # no listener any more
    assert seen == [5, 8]


def test_max_unsaved_minutes_must_be_positive_or_null():
    with pytest.raises(ConfigError, match=r"checkpoint\.max_unsaved_minutes=0"):
        load_config(None, ["checkpoint.max_unsaved_minutes=0"])
    assert (
        load_config(None, ["checkpoint.max_unsaved_minutes=null"]).checkpoint.max_unsaved_minutes
        is None
    )


def test_a_failed_save_is_retried_after_a_growing_pause_and_bounded_in_time():
    from msjax.training.save_schedule import SaveSchedule

    options = dataclasses.replace(Config().checkpoint, max_unsaved_minutes=0.5 / 60)
    schedule = SaveSchedule(options)
    assert not schedule.retry_due() and not schedule.overdue()
    schedule.tried()
    schedule.failed()
    assert not schedule.retry_due()  # the first retry waits 1 s
    time.sleep(0.6)
    assert schedule.overdue()  # 0.5 s without a committed save, and saves are failing
    time.sleep(0.5)
    assert schedule.retry_due()
    schedule.failed()
    assert not schedule.retry_due()  # now 2 s
