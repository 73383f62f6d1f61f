"""The worker's step transaction, in one process against a real channel file: what a dead rank leaves behind.

At the start of step s the channel holds s's start snapshot; after the step's backward pass (its collectives)
the newest buffer holds the seal, labelled s + 1, and the other one still s's start; the optimizer step marks
the commit. User code after the step that changes per-rank state turns sealing off (the next start checks).
"""

from __future__ import annotations

import os
import random
import socket
import threading

import pytest
import torch

from tpassrun.channel import ChannelFile, Field
from tpassrun.light import decode
from tpassrun.worker import Session, _AgentLink


class Sampler:
    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


@pytest.fixture
def session(tmp_path):
    channel = ChannelFile.create(str(tmp_path / "channel"), n_slots=2)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "agent.sock"))
    listener.listen(1)

    def drain() -> None:
        conn, _ = listener.accept()
        with conn:
            while conn.recv(65536):
                pass

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    link = _AgentLink(channel.path, 1, str(tmp_path / "agent.sock"))
    sess = Session(backend=None, link=link, rank=0, world_size=1, local_rank=0, generation=0, joined=False,
                   timeout=None)
    yield sess, channel
    link.sock.close()
    listener.close()
    thread.join(5)
    link.ch.close()
    channel.close()


def _job(sess):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = Sampler()
    sess.track(model=model, optimizer=opt, sampler=sampler)
    return model, opt, sampler


def _steps(channel):
    return channel.light_step(1), channel.light_step(1, previous=True)


def test_the_channel_holds_the_step_start_and_the_seal_after_the_collectives(session):
    sess, channel = session
    model, opt, sampler = _job(sess)
    seen = {}

    def step(i: int) -> None:
        sampler.pos += 1
        seen[(i, "start")] = _steps(channel)
        model(torch.randn(2, 4)).sum().backward()
        seen[(i, "backward")] = _steps(channel)
        opt.step()
        seen[(i, "committed")] = channel.get(1, Field.COMMITTED)
        opt.zero_grad()

    sess.run(step, 12)
    for i in range(12):
        # the newest buffer is this step's start (or the previous step's seal, which is the same state)
        assert seen[(i, "start")][0] == i
        assert seen[(i, "backward")] == (i + 1, i), i    # sealed for the next step; the start kept
        assert seen[(i, "committed")] == i + 1
    # the seal is byte for byte the next step's start: what a joiner resumes from
    newest = decode(channel.read_light(1))
    assert newest.meta["step"] == 12


def test_user_code_changing_per_rank_state_after_the_step_turns_sealing_off(session, caplog):
    sess, channel = session
    model, opt, sampler = _job(sess)
    seen = {}

    def step(i: int) -> None:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        seen[i] = _steps(channel)
        sampler.pos += 1        # "prefetch" after the step: the seal would be wrong
        random.random()

    sess.run(step, 4)
    assert "changed after the backward pass" in caplog.text
    assert seen[0] == (1, 0)                 # sealed before anyone knew
    assert seen[2] == (2, 1)                 # no seal any more: the newest is the step start
    assert not sess._commit_snapshots
