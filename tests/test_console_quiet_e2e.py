"""One quiet console under a port scan and a peer's death (issue 28, items 5): one real job (3 ranks + 1 spare,
gloo, the embedded etcd, Prometheus metrics), scanned with garbage on every port it listens on, then a rank
SIGKILLed while its survivors wait in a collective."""

from __future__ import annotations

import glob
import os
import re
import signal
import socket

import pytest

from faults import Job, faults_env, hold_at
from test_console_e2e import _descendants, _lines, _wait_event

pytestmark = pytest.mark.timeout(300)
SCANS = 200
GLOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ tpassrun/\w+\] ")   # any line of tpassrun's own


def _listening_ports(pids: list[int]) -> list[int]:
    """TCP ports in LISTEN held by ``pids`` (from /proc: each socket's inode among the process's descriptors)."""
    inodes: set[str] = set()
    for pid in pids:
        for fd in glob.glob(f"/proc/{pid}/fd/*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:      # 0A: TCP_LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _scan(ports: list[int], times: int) -> int:
    """Connect ``times`` times to each port, send garbage, hang up. Returns the connections made."""
    made = 0
    for i in range(times):
        for port in ports:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    s.sendall(os.urandom(48) + b"\r\nGET / HTTP/1.0\r\n\r\n" + bytes([i % 256]) * 16)
                    made += 1
            except OSError:
                pass
    return made


def test_a_port_scan_and_a_peers_death_leave_a_few_lines_and_no_gloo_text(tmp_path):
    """A port scan logged one warning line per connection (348 in a minute), and each survivor of a death printed
    gloo's 3-line "Read error ... Connection reset by peer ... GLHF!" error around tpassrun's recovery lines.
    Now: a scan leaves at most one aggregated line per listener, and each survivor's line says what interrupted
    it (its gloo text is in its log file). The job, scanned and recovered, ends with exit code 0."""
    hold = hold_at(tmp_path, 5, rank=0)              # ranks 1 and 2 wait in step 5's first collective meanwhile
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=None, run_id="", nproc=3, spares=1, steps=12,
                       step_sleep=0.02, extra=["--metrics-port", "0"],
                       env=faults_env(hold.fault)).start()
    try:
        _wait_event(job, "spare_ready")
        hold.wait_reached(job)
        pids = [job.proc.pid, *_descendants(job.proc.pid)]
        ports = _listening_ports(pids)
        assert len(ports) >= 4, ports         # the mirror, etcd's two, the metrics, the workers' store, gloo's
        said = len(job.log())
        made = _scan(ports, SCANS)
        assert made >= SCANS * len(ports) // 2, (made, ports)
        os.kill(job.losses(1)[-1]["pid"], signal.SIGKILL)    # its peers wait in a collective with it
        _wait_event(job, "worker_died")
        scanned = job.log()[said:]
        hold.release()
        assert job.wait(240) == 0, job.log()[-4000:]
    finally:
        job.kill()
    warnings = [ln for ln in scanned.splitlines() if ln.startswith("W") and "died at step" not in ln]
    assert len(warnings) <= 3, "\n".join(warnings)               # one aggregated line per listener at most
    strays = [ln for ln in scanned.splitlines() if ln.strip() and not GLOG.match(ln)]
    assert not strays, "\n".join(strays)                         # nothing from etcd, gloo or the workers
    log = job.log()
    assert "GLHF" not in log and "Connection reset" not in log, log[-4000:]
    interrupted = [e for e in job.events() if e["event"] == "step_interrupted"]
    assert interrupted and all(e["by"].startswith("rank 1's death") for e in interrupted), interrupted
    for e in interrupted:
        assert _lines(log, rf"\[rank {e['rank']}\] step {e['step']} interrupted by rank 1's death \(killed by SIGKILL\); "
                           r"waiting for recovery"), log[-4000:]
        with open(e["log"], errors="replace") as fh:      # gloo's own text, kept in the worker's log file
            assert re.search(rf"rank {e['rank']}: step {e['step']} failed \(\w+, RuntimeError: .*gloo", fh.read())
