"""The README's first command, as a newcomer runs it: ``bash examples/demo.sh`` (a 4-rank job and a warm spare on
the embedded etcd; rank 1 tainted with ``tpassctl taint --rdzv-endpoint E --rdzv-id I`` mid-run). It was broken
without any test noticing: tpassctl, given the run's endpoint and id, no longer found the embedded etcd's per-run
credentials in the run registry."""

from __future__ import annotations

import os
import subprocess

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_demo_shows_a_live_swap_and_exits_0():
    r = subprocess.run(["bash", os.path.join(REPO, "examples", "demo.sh")], capture_output=True, text=True,
                       timeout=280, cwd=REPO)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "rank 1: 200 steps, none lost or repeated: True" in out and "<- moved to the spare" in out, out[-4000:]
    # the run's own key is found through the run registry (it sits 0600 beside the embedded etcd's password)
    assert "unverified" not in out, out[-4000:]
    for rank in (0, 2, 3):
        assert f"rank {rank}: 200 steps, none lost or repeated: True" in out and "(same process throughout)" in out
