"""Elastic ``--nnodes MIN:MAX`` (issue 14): losing an agent while >= MIN remain re-forms and continues.

Two real agents, torchrun's c10d command line (``--nnodes 1:2``, the first agent hosts the rendezvous on the
endpoint, like torchrun's store host), no spares. The second agent is SIGKILLed while its workers run; its
workers die with it (PDEATHSIG), its lease expires, and the survivor re-forms a one-node generation and
finishes with exit 0, as torchrun does (PyTorch's own elastic-agent test kills the odd agents the same way).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from faults import Job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

# A worker without torch: records (generation world, restart count) and runs until released by a file.
WORKER = r'''
import json, os, sys, time
out = sys.argv[1]
env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "GROUP_RANK",
                                  "TORCHELASTIC_RESTART_COUNT")}
name = f"{os.environ['TPASSRUN_NODE_ID']}-{env['RANK']}-{os.getpid()}"
with open(os.path.join(out, name + ".json"), "w") as f:
    json.dump(env, f)
while not os.path.exists(os.path.join(out, "go")):
    time.sleep(0.05)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(out: Path) -> list[dict]:
    dumps = []
    for p in out.glob("*.json"):
        try:
            dumps.append(json.loads(p.read_text()) | {"file": p.name})
        except ValueError:
            pass   # a worker is writing it right now: read it on the next poll
    return dumps


def _wait(cond, timeout: float, what: str, *jobs: Job) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s\n" + "\n".join(j.log()[-2000:] for j in jobs))
        time.sleep(0.1)


def test_scale_down_after_an_agent_is_sigkilled(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "dumps"
    out.mkdir()
    port = _free_port()

    def agent(name: str) -> Job:
        argv = [sys.executable, "-m", "tpassrun", "--nnodes", "1:2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
                "--rdzv-conf", "lease_ttl=3", "--monitor-interval", "0.5",
                "--log-dir", str(tmp_path / name / "logs"), str(script), str(out)]
        return Job(argv=argv, out=str(tmp_path / name))

    a, b = agent("a"), agent("b")
    try:
        a.start()
        _wait(lambda: "etcd hosted" in a.log() or "etcd_hosted" in a.log() or _port_open(port), 60,
              "agent A hosts the rendezvous", a)
        b.start()
        _wait(lambda: sum(d["WORLD_SIZE"] == "4" for d in _dumps(out)) == 4, 90, "4 workers in a 2-node world", a, b)
        b_pid = b.proc.pid
        os.kill(b_pid, signal.SIGKILL)   # the agent alone: its workers go by PDEATHSIG, like a lost node
        b.proc.wait(10)
        _wait(lambda: sum(d["WORLD_SIZE"] == "2" for d in _dumps(out)) == 2, 90, "a re-formed 1-node world", a)
        (out / "go").write_text("")
        assert a.wait(90) == 0, a.log()[-3000:]
    finally:
        (out / "go").write_text("")
        a.kill()
        b.kill()
    small = [d for d in _dumps(out) if d["WORLD_SIZE"] == "2"]
    assert sorted(d["RANK"] for d in small) == ["0", "1"] and {d["GROUP_WORLD_SIZE"] for d in small} == {"1"}
    # a membership change costs no restart (torchrun's num_nodes_waiting rule)
    assert {d["TORCHELASTIC_RESTART_COUNT"] for d in small} == {"0"}


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
