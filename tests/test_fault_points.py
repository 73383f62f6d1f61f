"""tpassrun/testing.py's fault points as the chaos harness arms them (pure, no job): a fault with ``any_step``
fires at the first step that reaches its point once its marker is gone, once; a ``sleep`` with ``unless`` slows
every step until that file exists."""

from __future__ import annotations

import json
import os

import pytest

from tpassrun import testing

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def faults(monkeypatch):
    def set_faults(*items: dict) -> None:
        monkeypatch.setenv(testing.FAULTS_ENV, json.dumps(list(items)))
        testing._faults.cache_clear()

    yield set_faults
    testing._faults.cache_clear()


def test_an_armed_any_step_fault_fires_once_at_whatever_step(tmp_path, faults):
    marker = tmp_path / "send-raise-r1"
    marker.write_text("")                       # disarmed: the marker exists
    faults({"rank": 1, "where": "send", "action": "raise", "marker": str(marker), "any_step": True, "step": 0})
    testing.fault_point(1, 7, "send")           # nothing fires while disarmed
    os.unlink(marker)                           # armed
    testing.fault_point(0, 9, "send")           # another rank: nothing
    with pytest.raises(RuntimeError, match="rank 1 step 9"):
        testing.fault_point(1, 9, "send")
    testing.fault_point(1, 10, "send")          # once
    assert marker.read_text().split()[0] == str(os.getpid())


def test_a_sleep_unless_a_file_exists(tmp_path, faults, monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(testing.time, "sleep", slept.append)
    done = tmp_path / "done"
    faults({"rank": 0, "step": 5, "where": "step", "action": "sleep", "seconds": 1.5, "unless": str(done)})
    for step in (4, 5, 6):
        testing.fault_point(0, step)
    assert slept == [1.5, 1.5]
    done.write_text("")
    testing.fault_point(0, 7)
    assert slept == [1.5, 1.5]
