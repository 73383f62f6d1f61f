"""A survivor catching up after a mixed commit (tpassrun/worker/catchup.py): it failed inside step s, which
another survivor completed; it loads that survivor's replicated state (sent over the authenticated handoff) and
resumes at s + 1 from its own seal, exactly where an uninterrupted run stands."""

from __future__ import annotations

import json
import random
import socket
import threading

import pytest
import torch

from tpassrun.channel import ChannelFile
from tpassrun.channel.protocol import CatchUp
from tpassrun.transfer import handoff
from tpassrun.worker import Session, _AgentLink

pytestmark = pytest.mark.timeout(60)
KEY = "ab" * 32


class Sampler:
    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


class Agent:
    """The agent's end of the unix socket: collects the worker's lines."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.lines: list[dict] = []
        self.got = threading.Condition()
        self.conn: socket.socket | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        self.conn, _ = self.listener.accept()
        buf = b""
        while chunk := self.conn.recv(65536):
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    with self.got:
                        self.lines.append(json.loads(line))
                        self.got.notify_all()

    def wait(self, kind: str) -> dict:
        with self.got:
            assert self.got.wait_for(lambda: any(m["kind"] == kind for m in self.lines), 20), self.lines
            return next(m for m in self.lines if m["kind"] == kind)


def _job(sess: Session | None, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sampler = Sampler()
    if sess is not None:
        sess.track(model=model, optimizer=opt, sampler=sampler)
    return model, opt, sampler


def _step(model, opt, sampler, i: int) -> None:
    sampler.pos += 1
    g = torch.Generator().manual_seed(100 + sampler.pos)
    model(torch.randn(3, 4, generator=g)).sum().backward()     # dropout draws from the global RNG
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_a_laggard_catches_up_from_a_leader_and_resumes_where_an_uninterrupted_run_is(tmp_path):
    # the reference: an uninterrupted rank, 5 steps
    torch.manual_seed(7)
    ref = _job(None)
    torch.manual_seed(7)
    for i in range(5):
        _step(*ref, i)
    ref_rng = torch.get_rng_state()

    channel = ChannelFile.create(str(tmp_path / "channel"), n_slots=2)
    agent = Agent(str(tmp_path / "agent.sock"))
    link = _AgentLink(channel.path, 1, str(tmp_path / "agent.sock"))
    sess = Session(backend=None, link=link, rank=1, world_size=2, local_rank=1, generation=0, joined=False,
                   timeout=None)
    sess._state.light_retarget_due = 0
    model, opt, sampler = _job(sess)
    torch.manual_seed(7)
    sess.run(lambda i: _step(model, opt, sampler, i), 2)          # steps 0, 1 as the reference did
    # step 2: this rank seals it in its backward pass, then "fails inside its all-reduce" (the others completed it)
    sess._state.in_step = 2
    sampler.pos += 1
    g = torch.Generator().manual_seed(100 + sampler.pos)
    model(torch.randn(3, 4, generator=g)).sum().backward()
    sess._state.in_step = -1
    assert sess._state.sealed == 2 and channel.light_step(1) == 3
    random.random(), torch.rand(5)                               # whatever the failure path consumed

    # a leader completed step 2 (and so is at step 3's start): the reference after 3 steps
    torch.manual_seed(7)
    leader = _job(None)
    torch.manual_seed(7)
    for i in range(3):
        _step(*leader, i)
    state = handoff.capture({"model": leader[0], "optimizer": leader[1]}, step=3,
                            extra={"objects": ["model", "optimizer"], "swap_id": "n-b"})

    def donor() -> None:
        port = agent.wait("listening")["port"]
        from tpassrun.channel.protocol import SendState
        from tpassrun.worker.commands import _send_state

        _send_state(SendState(addr="127.0.0.1", port=port, swap_id="n-b", key=KEY, rank=1), state,
                    corrupt=lambda: False)

    thread = threading.Thread(target=donor, daemon=True)
    thread.start()
    sess._catchup.on_catch_up(CatchUp(swap_id="n-b", key=KEY, rank=1, listen_host="127.0.0.1", step=3), 2,
                      RuntimeError("peer gone"))
    thread.join(20)
    received = agent.wait("received")
    assert received["ok"] and received["step"] == 3, received
    # the re-formed world: resume at 3 from the own seal (the worker's _roll_back; the world itself is not joined)
    sess._commands.roll_back(2, 3, True)
    assert sess.step == 3 and sampler.pos == 3
    sess.run(lambda i: _step(model, opt, sampler, i), 5)
    for a, b in zip(model.parameters(), ref[0].parameters()):
        assert torch.equal(a, b)
    assert sampler.pos == ref[2].pos == 5
    for k, v in opt.state_dict()["state"].items():
        for name, t in v.items():
            assert torch.equal(t, ref[1].state_dict()["state"][k][name]), (k, name)
    assert torch.equal(torch.get_rng_state(), ref_rng)
    link.sock.close()
    channel.close()


def test_a_rank_without_its_seal_of_the_step_refuses_to_catch_up(tmp_path):
    channel = ChannelFile.create(str(tmp_path / "channel"), n_slots=2)
    agent = Agent(str(tmp_path / "agent.sock"))
    link = _AgentLink(channel.path, 1, str(tmp_path / "agent.sock"))
    sess = Session(backend=None, link=link, rank=1, world_size=2, local_rank=1, generation=0, joined=False,
                   timeout=None)
    sess._state.light_retarget_due = 0
    model, opt, sampler = _job(sess)
    sess.run(lambda i: _step(model, opt, sampler, i), 2)
    sess._catchup.on_catch_up(CatchUp(swap_id="n-b", key=KEY, rank=1, listen_host="127.0.0.1", step=5), 2,
                      RuntimeError("peer gone"))
    answer = agent.wait("received")
    assert not answer["ok"] and "no seal of step 5" in answer["error"]
    link.sock.close()
    channel.close()
