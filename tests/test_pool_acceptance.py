"""Issue 24's acceptance on separate hosts, run by hand (``TPASSRUN_ACCEPTANCE=1``; root and iproute2): two jobs
sharing one pool node, every agent a host of its own (a network namespace), ``bench/pool_acceptance.py share``.

Job A loses a node: the pool node joins A, A recovers live. Job B loses a node: the pool is empty, B says so and
waits. A's lost node is started again (same command line, same host): it rejoins A as a spare node, --migrate-back
moves the pool node's ranks home, the pool node is given back, and B claims it and recovers live. Both jobs end
``torch.equal`` to torchrun, survivors keep their processes, the pool node is idle with no claim at the end. The
harness deletes its namespaces itself (a SIGTERM too); the test deletes any left by a harness killed harder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest
from faults import NetLab

pytestmark = [pytest.mark.e2e, pytest.mark.acceptance, pytest.mark.timeout(1500)]

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "pool_acceptance.py")


def _leftovers(tag: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [n for n in names if n.startswith(f"tp{tag}-")] + ([f"tp{tag}br"] if f"tp{tag}br" in links else [])


def test_two_jobs_share_one_pool_node_on_separate_hosts(tmp_path):
    if not NetLab.available():
        pytest.skip("needs root and iproute2 (network namespaces)")
    tag = uuid.uuid4().hex[:4]
    proc = subprocess.Popen([sys.executable, BENCH, "share", "--trials", "1", "--tag", tag],
                            stdout=open(tmp_path / "out.txt", "w"), stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        code = proc.wait(1400)
    finally:
        if proc.poll() is None:             # the harness removes what it made on SIGTERM (its finally blocks)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for name in _leftovers(tag):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            subprocess.run(["ip", "link", "del", name], capture_output=True)
    text = (tmp_path / "out.txt").read_text()
    print(text[-6000:])
    assert not _leftovers(tag)
    assert code == 0, text[-8000:]
    row = json.loads(text.strip().splitlines()[-1])["trials"][0]
    assert row["exit_codes"] == {"A": [0, 0], "B": [0]}
    assert row["A_bit_identical"] is True and row["B_bit_identical"] is True
    assert row["A_survivors_kept_pids"] and row["B_survivors_kept_pids"]
    assert "claimed" in row["B_waiting_said"] and "moved home" in row["A_released_reason"]
    timeline = list(row["timeline_s"])
    assert timeline.index("A migrated back, released") < timeline.index("B pool claimed") < \
        timeline.index("B training again")
    assert row["history"] == ["claimed", "joined", "released", "idle", "claimed", "joined", "idle"], row["history"]
