"""``--rdzv-backend static``: the workers' store is on the endpoint, as torchrun's (issue 30), in every attempt,
and each attempt's store is a new one (torchrun's one long-lived store hands a restart the previous attempt's
keys: torchrun.md §3.7)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

SCRIPT = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
endpoint, attempt, rank = sys.argv[1], os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
assert f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}" == endpoint, dict(os.environ)
host, port = endpoint.rsplit(":", 1)
raw = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
stale = raw.check([f"left_by_attempt_{int(attempt) - 1}"])
os.write(1, f"rank {rank} attempt {attempt} stale key {stale}\\n".encode())   # one write: the ranks share stdout
dist.init_process_group("gloo", init_method=f"tcp://{endpoint}", rank=int(rank),
                        world_size=int(os.environ["WORLD_SIZE"]))
t = torch.tensor([float(rank) + 1])
dist.all_reduce(t)
raw.set(f"left_by_attempt_{attempt}", "x")
dist.barrier()
os.write(1, f"rank {rank} attempt {attempt} sum {t.item()}\\n".encode())
dist.destroy_process_group()
if attempt == "0" and rank == "1":
    sys.exit(3)
"""


@pytest.mark.e2e
def test_tcp_to_the_static_endpoint_works_in_every_attempt_with_a_new_store(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"127.0.0.1:{port}"
    script = tmp_path / "tcp_job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PET_", "TPASSRUN_"))}
    proc = subprocess.run([sys.executable, "-m", "tpassrun", "--rdzv-backend", "static", "--rdzv-endpoint", endpoint,
                           "--nproc-per-node", "2", "--max-restarts", "1", str(script), endpoint],
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank"))
    assert lines == sorted([f"rank {r} attempt {a} {what}" for r in (0, 1) for a in (0, 1)
                            for what in ("stale key False", "sum 3.0")]), proc.stdout
