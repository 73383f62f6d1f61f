"""The per-step light snapshot (tpassrun/transfer/light.py): exact RNG round trips, including numpy's Gaussian cache
that the unchanged-generator shortcut must not miss, the same bundle the general codec gives, and frames that
detect tearing and corruption."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tpassrun.transfer import handoff, light
from tpassrun.transfer.codec import ChecksumError, decode_tree

pytestmark = pytest.mark.timeout(60)


class Bag:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def _draws():
    return (random.random(), random.gauss(0, 1), np.random.rand(), np.random.standard_normal(),
            torch.rand(3).tolist(), torch.randn(2).tolist())


def _seed(n=7):
    random.seed(n)
    np.random.seed(n)
    torch.manual_seed(n)


def test_restoring_a_snapshot_replays_every_generator():
    _seed()
    snap = light.LightSnapshotter()
    _draws()
    frame = snap.take({}, step=3)
    expected = [_draws() for _ in range(3)]
    assert handoff.apply(light.decode(frame), {}, restore_rng_state=True) == 3
    assert [_draws() for _ in range(3)] == expected


def test_decoded_bundle_equals_what_the_general_codec_captures():
    _seed(11)
    random.gauss(0, 1)            # python's gauss_next cache filled
    np.random.standard_normal()   # numpy's has_gauss cache filled
    objects = {"sampler": Bag({"epoch": 2, "pos": 5, "order": torch.arange(10)}), "count": Bag({"n": 1})}
    snap = light.LightSnapshotter()
    frame = snap.take(objects, step=9)
    general = handoff.capture(objects, step=9, rng=handoff.capture_rng())
    ours = light.decode(frame)
    assert ours.step == general.step == 9
    a, b = decode_tree(ours.meta["rng"], ours.tensors), decode_tree(general.meta["rng"], general.tensors)
    assert a["python"]["version"] == b["python"]["version"] and a["python"]["gauss_next"] == b["python"]["gauss_next"]
    assert np.array_equal(a["python"]["internal"], b["python"]["internal"])
    assert torch.equal(a["torch"], b["torch"])
    assert np.array_equal(a["numpy"]["state"]["key"], b["numpy"]["state"]["key"])
    assert [a["numpy"][k] for k in ("has_gauss", "gauss")] == [b["numpy"][k] for k in ("has_gauss", "gauss")]
    assert a["numpy"]["state"]["pos"] == b["numpy"]["state"]["pos"]
    for name in objects:
        x = decode_tree(ours.meta["objects"][name], ours.tensors)
        y = decode_tree(general.meta["objects"][name], general.tensors)
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k]


def test_a_consumed_numpy_gaussian_is_seen_although_the_generator_did_not_move():
    _seed(3)
    snap = light.LightSnapshotter()
    np.random.standard_normal()          # draws a pair: one returned, one cached (has_gauss = 1)
    snap.take({}, step=0)
    np.random.standard_normal()          # returns the cached one: the generator's key and pos do not change
    frame = snap.take({}, step=1)
    assert decode_tree(light.decode(frame).meta["rng"], light.decode(frame).tensors)["numpy"]["has_gauss"] == 0
    expected = [np.random.standard_normal() for _ in range(3)]
    handoff.apply(light.decode(frame), {}, restore_rng_state=True)
    assert [np.random.standard_normal() for _ in range(3)] == expected


def test_an_untouched_numpy_generator_takes_the_shortcut_and_stays_exact():
    _seed(5)
    snap = light.LightSnapshotter()
    first = snap.take({}, step=0)
    assert snap._numpy is not None and snap._numpy._address, "this numpy exposes MT19937's C state"
    torch.rand(4)                        # the step draws from torch only
    second = snap.take({}, step=1)
    np.random.seed(99)                   # then someone reseeds numpy: the shortcut must notice
    third = snap.take({}, step=2)
    keys = [decode_tree(light.decode(f).meta["rng"], light.decode(f).tensors)["numpy"]["state"]["key"]
            for f in (first, second, third)]
    assert np.array_equal(keys[0], keys[1]) and not np.array_equal(keys[1], keys[2])
    assert np.array_equal(keys[2], np.random.get_state()[1])


def test_frames_ignore_slack_and_reject_tearing_and_corruption():
    frame = light.LightSnapshotter().take({"sampler": Bag({"pos": 3, "order": torch.arange(100)})}, step=2)
    assert light.decode(frame + b"\x00" * 64).step == 2
    with pytest.raises(ChecksumError):
        light.decode(frame[:-5])
    with pytest.raises(ChecksumError):
        light.decode(b"\x00" * 64)
    for at in (6, len(frame) // 2, len(frame) - 12):
        flipped = bytearray(frame)
        flipped[at] ^= 0x40
        with pytest.raises(ChecksumError):
            light.decode(bytes(flipped))


def test_objects_round_trip_into_live_objects():
    sampler = Bag({"epoch": 1, "pos": 4, "gen": torch.Generator().manual_seed(3).get_state()})
    frame = light.LightSnapshotter().take({"sampler": sampler}, step=5)
    target = Bag(None)
    assert handoff.apply(light.decode(frame), {"sampler": target}, restore_rng_state=False) == 5
    assert target.state["epoch"] == 1 and target.state["pos"] == 4
    assert torch.equal(target.state["gen"], sampler.state["gen"])
