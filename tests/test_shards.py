"""The worker's sharded-state machinery without a network: the local ring of pre-step copies (double buffered,
restored bit for bit, never aliased by the objects it restores), and the pusher thread (newest complete
version only, a pinned version never overwritten, errors retried)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tpassrun.channel import Field
from tpassrun.worker import shards
from tpassrun.worker.shards import MIRROR_KIND, ShardRing, ShardState, decode_mirrored

pytestmark = pytest.mark.timeout(60)


def _job(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model, opt, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(3, 8, generator=g)).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _flat(model, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [v.clone() for v in st.values() if torch.is_tensor(v)]
    return out


def test_ring_restores_a_version_bit_for_bit_and_never_aliases_its_buffers():
    model, opt = _job()
    _train(model, opt, 2)
    ring = ShardRing()
    ring.begin(2, {"opt": opt}, {"model": model}, owner=0, light=b"L2")
    ring.fence()
    want = _flat(model, opt)
    _train(model, opt, 1)
    ring.begin(3, {"opt": opt}, {"model": model}, owner=0, light=b"L3")
    ring.fence()
    assert ring.versions() == (2, 3)
    _train(model, opt, 1)
    assert ring.restore(2, {"opt": opt}, {"model": model}) == b"L2"
    got = _flat(model, opt)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    # the ring's buffers are reused by the next versions: the restored objects must own their tensors
    for step in (4, 5, 6):
        ring.begin(step, {"opt": opt}, {"model": model}, owner=0, light=None)
        ring.fence()
        _train(model, opt, 1)
    assert ring.versions() == (4, 5, 6)
    with pytest.raises(KeyError):
        ring.restore(2, {"opt": opt}, {"model": model})


def test_a_version_being_pushed_is_never_overwritten_the_snapshot_is_skipped():
    model, opt = _job()
    _train(model, opt, 1)
    ring = ShardRing()
    for step in (1, 2, 3):
        ring.begin(step, {"opt": opt}, {"model": model}, owner=0, light=None)
        ring.fence()
    pinned = ring.pin_newest(after=0)          # the pusher reads step 3
    assert pinned is not None and pinned.step == 3
    old = ring.pin_newest(after=0)
    assert old is pinned
    ring.unpin(old)
    one = ring.get(1)
    one.pins += 1                              # and (say) an older push of step 1 still runs
    assert ring.begin(4, {"opt": opt}, {"model": model}, owner=0, light=None) is not None   # into step 2's slot
    ring.fence()
    assert ring.begin(5, {"opt": opt}, {"model": model}, owner=0, light=None) is None       # 1, 3 pinned, 4 newest
    assert ring.skipped == 1 and ring.versions() == (1, 3, 4)
    ring.unpin(pinned)
    one.pins -= 1
    assert ring.begin(5, {"opt": opt}, {"model": model}, owner=0, light=None) is not None
    ring.fence()
    assert ring.versions() == (3, 4, 5)


class FakeMirror:
    """A test double of the buddy's mirror client: records puts, can be told to fail or to stall."""

    def __init__(self) -> None:
        self.puts: list[tuple[int, str, int, bytes]] = []
        self.fail = 0
        self.gate = threading.Event()
        self.gate.set()
        self.closed = 0

    def client(self) -> "FakeMirror":     # as tpassrun.mirror.MirrorTarget.client(): connects on first use
        return self

    def put(self, owner: int, kind: str, version: int, parts, *, epoch: int = 0) -> bool:
        self.gate.wait(10)
        if self.fail:
            self.fail -= 1
            raise ConnectionError("buddy went away")
        self.puts.append((owner, kind, version, b"".join(bytes(p) for p in parts)))
        return True

    def close(self) -> None:
        self.closed += 1


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_pusher_sends_the_newest_complete_version_with_the_light_snapshot():
    model, opt = _job()
    _train(model, opt, 1)
    mirror = FakeMirror()
    published: dict[Field, int] = {}
    state = ShardState(3, 1, lambda f, v: published.__setitem__(f, v))
    state.retarget(mirror, 3)
    state.begin(1, ({"opt": opt}, {"model": model}), light=b"light-1")
    state.fence()
    _wait(lambda: len(mirror.puts) == 1)
    owner, kind, version, data = mirror.puts[0]
    assert (owner, kind, version) == (3, MIRROR_KIND, 1)
    bundle, light, step = decode_mirrored(data)
    assert light == b"light-1" and step == 1 and sorted(bundle.meta["objects"]) == ["opt"]   # the model stays local
    _wait(lambda: published.get(Field.SHARD_PUSHED) == 2)
    assert published[Field.SHARD_V2] == 2 and published[Field.SHARD_HELD] > 0 and published[Field.SHARD_SENT] > 0
    # a failing buddy: retried, then the newest version goes
    mirror.fail = 2
    _train(model, opt, 1)
    state.begin(2, ({"opt": opt}, {"model": model}), light=b"light-2")
    state.fence()
    _wait(lambda: [p[2] for p in mirror.puts] == [1, 2])
    assert state.pusher.stats.errors == 2
    state.close()


def _push_of_step_1_hangs():
    """A job whose buddy takes the push of step 1 and does not answer until ``mirror.gate`` is set."""
    model, opt = _job()
    mirror = FakeMirror()
    state = ShardState(0, 1, lambda f, v: None)
    state.retarget(mirror, 0)
    mirror.gate.clear()
    state.begin(1, ({"opt": opt}, {"model": model}), light=None)
    state.fence()
    _wait(lambda: state.ring.get(1).pins == 1)
    return model, opt, mirror, state


def test_a_refresh_waits_until_the_buddy_holds_the_previous_version():
    """The mirror lags one version at most: else a loaded host's pusher fell behind the survivors' local copies
    and a live recovery found no common step."""
    model, opt, mirror, state = _push_of_step_1_hangs()
    _train(model, opt, 1)
    t = threading.Thread(target=state.begin, args=(2, ({"opt": opt}, {"model": model})), kwargs={"light": None})
    t.start()
    t.join(0.5)
    assert t.is_alive() and state.ring.versions() == (1,)     # step 2 waits for step 1's push
    mirror.gate.set()
    t.join(30)
    assert not t.is_alive()
    state.fence()
    assert mirror.puts[0][2] == 1 and state.ring.versions() == (1, 2)
    state.close()


def test_a_stalled_buddy_makes_the_pusher_skip_to_the_newest_version(monkeypatch):
    monkeypatch.setattr(shards, "PUSH_WAIT_S", 0.2)   # the wait gives up: best effort from there
    model, opt, mirror, state = _push_of_step_1_hangs()
    for step in (2, 3, 4, 5):
        _train(model, opt, 1)
        state.begin(step, ({"opt": opt}, {"model": model}), light=None)
        state.fence()
    assert state.ring.versions() == (1, 4, 5)   # 1 stays while it is pushed; 2 and 3 were overwritten
    mirror.gate.set()
    _wait(lambda: [p[2] for p in mirror.puts] == [1, 5])   # then straight to the newest
    state.close()


def test_interval_k_snapshots_every_kth_step_and_the_first_one():
    model, opt = _job()
    state = ShardState(0, 3, lambda f, v: None)
    taken = []
    state.begin(0, ({"opt": opt}, {"model": model}), light=None)
    assert state.ring.versions() == ()       # never step 0 (a framework's state_dict may initialise state then)
    for step in range(5, 12):
        state.begin(step, ({"opt": opt}, {"model": model}), light=None)
        state.fence()
        taken.append(state.ring.versions()[-1] if state.ring.versions() else None)
    assert taken == [5, 6, 6, 6, 9, 9, 9]
    state.close()
