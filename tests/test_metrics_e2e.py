"""--metrics-port: the agent's Prometheus endpoint, scraped during a real swap."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest
from faults import Job, taint

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _value(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_swap_is_counted_while_the_job_runs(tmp_path, etcd_server, run_id):
    job = Job.tpassrun(str(tmp_path), endpoint=etcd_server.endpoint, run_id=run_id, nproc=2, spares=1,
                       steps=100000, step_sleep=0.05, extra=["--metrics-port", "0"]).start()
    try:
        job.wait_step(2, 180)
        job.wait_event("spare_ready")     # "free" spares are ready ones: a spare can warm up for 20 s on a busy host
        port = next(e["port"] for e in job.events() if e["event"] == "metrics_serving")
        before = _scrape(port)
        assert _value(before, 'tpassrun_swaps_total{kind="planned"}') == 0
        assert _value(before, "tpassrun_spares_free") == 1 and 'tpassrun_step{rank="1"}' in before
        assert taint(etcd_server.endpoint, run_id, rank=1, reason="metrics test") == 0
        deadline = time.monotonic() + 120
        while _value(_scrape(port), 'tpassrun_swaps_total{kind="planned"}') < 1:     # scraped while it runs
            assert time.monotonic() < deadline and job.proc.poll() is None, job.log()[-3000:]
            time.sleep(0.2)
        after = _scrape(port)
        assert job.proc.poll() is None
        assert _value(after, 'tpassrun_swap_pause_seconds_count{kind="planned"}') == 1
        assert _value(after, "tpassrun_state_bytes_moved_total") > 0
        assert _value(after, 'tpassrun_taints_total{source="tpassctl"}') == 1
        assert _value(after, "tpassrun_spares_free") == 0
        assert 0 < _value(after, "tpassrun_goodput_ratio") <= 1
        # progress: the total its sess.run() was given, and an ETA from the slowest rank's step time
        assert _value(after, "tpassrun_total_steps") > 0 and _value(after, "tpassrun_eta_seconds") > 0
        assert _value(after, "tpassrun_steps_lost") == 0 and _value(after, "tpassrun_whole_group_restarts") == 0
    finally:
        job.kill()
