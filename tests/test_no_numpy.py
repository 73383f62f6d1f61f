"""The worker API without numpy (issue 9 item 3: numpy is not a dependency), in one child process where
``import numpy`` fails: a tracked job's step transaction (start snapshots, seals after the backward pass, the
commit), the per-rank state a dead rank leaves in its channel decoded and applied by a joiner (the draws of the
step it resumes are the dead rank's), and a whole state bundle sent over the authenticated wire; the parent reads
the seal where numpy is there. The swap with numpy blocked in every process of a real job is
``tests/test_numerics_e2e.py::test_swap_without_numpy_equals_torchrun``; this covers the pieces of an unplanned
recovery (light frames) in ~2 s of CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tpassrun.transfer.codec import decode_tree
from tpassrun.transfer.light import decode

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import sys
sys.modules["numpy"] = None          # import numpy raises ModuleNotFoundError, as on a minimal install
import os, random, socket, threading
import torch
from tpassrun.transfer import handoff
from tpassrun.transfer import wire as handoff_wire
from tpassrun.channel import ChannelFile, Field
from tpassrun.transfer.light import decode
from tpassrun.transfer.auth import TransferAuth
from tpassrun.worker import Session, _AgentLink

try:
    import numpy  # noqa: F401
    raise SystemExit("numpy is importable: the blocker did not work")
except ImportError:
    pass
work = sys.argv[1]


class Sampler:
    def __init__(self):
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos, "order": torch.arange(5) + self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


channel = ChannelFile.create(os.path.join(work, "channel"), n_slots=2)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(os.path.join(work, "agent.sock"))
listener.listen(1)


def drain():
    conn, _ = listener.accept()
    with conn:
        while conn.recv(65536):
            pass


threading.Thread(target=drain, daemon=True).start()
link = _AgentLink(channel.path, 1, os.path.join(work, "agent.sock"))
sess = Session(backend=None, link=link, rank=0, world_size=1, local_rank=0, generation=0, joined=False, timeout=None)
torch.manual_seed(0)
random.seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
sampler = Sampler()
sess.track(model=model, optimizer=opt, sampler=sampler)
draws = {}


def step(i):
    sampler.pos += 1
    draws[i] = (random.random(), torch.rand(1).item())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


sess.run(step, 6)
assert (channel.light_step(1), channel.light_step(1, previous=True)) == (6, 5)
with open(os.path.join(work, "seal"), "wb") as fh:           # the parent decodes it with numpy present
    fh.write(bytes(channel.read_light(1)))

# a joiner takes the dead rank's start snapshot of step 5 and draws what the rank drew in step 5
start5 = decode(channel.read_light(1, previous=True))
joiner = Sampler()
assert handoff.apply(start5, {"sampler": joiner}, restore_rng_state=True) == 5
assert joiner.pos == 5
joiner.pos += 1
assert (random.random(), torch.rand(1).item()) == draws[5]

# the replicated state over the authenticated wire
bundle = handoff.capture({"model": model, "optimizer": opt}, step=5, rng=handoff.capture_rng())
assert "numpy" not in bundle.meta["rng"]
auth = TransferAuth(key=b"k" * 32, swap_id="s-1", rank=0)
server, port = handoff_wire.listen_for_bundle()
sender = threading.Thread(target=handoff_wire.connect_and_send, args=("127.0.0.1", port, bundle),
                          kwargs={"timeout": 30, "auth": auth})
sender.start()
got, _stats = handoff_wire.accept_and_recv(server, timeout=30, auth=auth)
sender.join(30)
server.close()
target = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
target_opt = torch.optim.AdamW(target.parameters(), lr=0.1)
handoff.apply(got, {"model": target, "optimizer": target_opt}, restore_rng_state=False)
assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), target.state_dict().values()))
assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], target_opt.state_dict()["state"][0]["exp_avg"])
small = handoff_wire.decode_small(handoff_wire.encode_small(bundle))
assert small.step == 5

link.sock.close()
listener.close()
link.ch.close()
channel.close()
print("no-numpy worker ok")
'''


def test_the_worker_api_runs_and_hands_state_over_without_numpy(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0 and "no-numpy worker ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    # what a worker without numpy saved is read alike where numpy is there (a joiner on another install)
    seal = decode((tmp_path / "seal").read_bytes())
    assert seal.step == 6 and seal.meta["objects"]["sampler"]["pos"] == 6
    assert "numpy" not in seal.meta["rng"]
    sampler = decode_tree(seal.meta["objects"]["sampler"], seal.tensors)
    assert torch.equal(sampler["order"], torch.arange(5) + 6)
