"""tpassrun/worker/faultpoints.py's fault points as the chaos harness arms them (pure, no job): a fault with ``any_step``
fires at the first step that reaches its point once its marker is gone, once; a ``sleep`` with ``unless`` slows
every step until that file exists."""

from __future__ import annotations

import json
import os

import pytest

from tpassrun.worker import faultpoints as testing

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


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_the_small_disk_fills_to_the_last_byte_without_failing_and_frees_again(tmp_path):
    """bench/chaos.py's disk_full kind. SmallDisk.fill wrote through a buffered file whose close flushed into the
    full disk and raised ENOSPC, on an empty disk too: a 50-fault run crashed at its disk_full fault (fault 13),
    the next noted 'harness error: No space left on device' there, and both were read as the logs having filled
    the tmpfs. Filling twice (a disk already full) and freeing must not raise."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from faults import SmallDisk

    disk = SmallDisk(str(tmp_path / "logs"), size_mb=2)
    try:
        (tmp_path / "logs" / "worker.log").write_bytes(b"x" * 1000)
        disk.fill()
        disk.fill()
        st = os.statvfs(disk.path)
        assert st.f_bavail == 0
        disk.free()
        st = os.statvfs(disk.path)
        assert st.f_bavail * st.f_frsize >= (2 << 20) - (64 << 10)     # only the log (and the fs's own) left
    finally:
        disk.close()
