"""The GPU-only paths' logic, on CPU (issue 29): what they would copy, where, in what order, without a device.

``scripts/gpu_check.sh`` runs the same paths on a real GPU; these pin down their decisions here: which CUDA
generator state a joiner restores onto which of its devices (a spare sees only its own GPU, the rank it
replaces may have seen the whole node), that the light snapshot carries the CUDA states and the device they
were drawn on, and the shard copier's plan (GPU sources on the side stream, recorded on it, the others on the
CPU thread, each in the snapshot's order). ``torch.cuda`` is replaced by a stand-in recording the calls.
"""

from __future__ import annotations

import random

import pytest
import torch

from tpassrun.transfer import handoff, light
from tpassrun.transfer.handoff import HandoffError, capture, capture_rng, cuda_rng_targets, restore_rng
from tpassrun.worker.shard_copy import split_by_device


class FakeCuda:
    """The part of ``torch.cuda`` the RNG paths call, for a process that sees ``devices`` GPUs."""

    def __init__(self, devices: int, current: int = 0, seed: int = 0) -> None:
        self.devices, self.current = devices, current
        self.states = [torch.full((16,), seed + i, dtype=torch.uint8) for i in range(devices)]
        self.set: list[tuple[int, list[int]]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "FakeCuda":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.devices > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.devices)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        monkeypatch.setattr(torch.cuda, "set_rng_state", self._set)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda _s: pytest.fail("restores per device"))
        return self

    def _set(self, state: torch.Tensor, device: int = 0) -> None:
        assert 0 <= device < self.devices, f"no device {device} here"
        self.set.append((device, state.tolist()))


@pytest.mark.parametrize("states, sender, devices, current, expected", [
    (1, 0, 1, 0, [(0, 0)]),                         # a spare replaced by a spare: the same view
    (8, 3, 8, 3, [(i, i) for i in range(8)]),       # the same view of the node: every state as it was
    (8, 3, 1, 0, [(3, 0)]),                         # rank 3 (saw the node) -> a spare (sees its own GPU)
    (1, 0, 8, 5, [(0, 5)]),                         # a spare's state -> a rank restarted on the whole node
    (8, 3, 8, 5, [(3, 5)]),                         # another current device: only the one computed on
    (1, None, 1, 0, [(0, 0)]),                      # a bundle without the current device (before it was kept)
    (1, None, 4, 2, [(0, 2)]),
])
def test_which_cuda_generator_state_goes_to_which_device(states, sender, devices, current, expected):
    assert cuda_rng_targets(states, sender, devices, current) == expected


def test_cuda_states_that_cannot_be_placed_are_refused():
    with pytest.raises(HandoffError, match="CUDA is not available"):
        cuda_rng_targets(1, 0, 0, 0)
    with pytest.raises(HandoffError, match="without the device"):
        cuda_rng_targets(8, None, 1, 0)
    with pytest.raises(HandoffError, match="not among"):
        cuda_rng_targets(2, 5, 1, 0)


def test_a_spare_restores_the_state_of_the_gpu_the_rank_computed_on(monkeypatch):
    """Rank 3 of an 8-GPU node (its dropout drew from cuda:3) dies; the spare sees one GPU as cuda:0."""
    FakeCuda(8, current=3, seed=10).install(monkeypatch)
    state = capture_rng()
    assert state["cuda_current"] == 3 and [s[0].item() for s in state["cuda"]] == list(range(10, 18))
    spare = FakeCuda(1, current=0).install(monkeypatch)
    restore_rng(state)
    assert spare.set == [(0, [13] * 16)]


def test_the_handoff_carries_the_cuda_states_through_its_codec(monkeypatch):
    FakeCuda(2, current=1, seed=40).install(monkeypatch)
    bundle = capture({}, step=7, rng=capture_rng())
    frame = handoff.encode_small(bundle)
    receiver = FakeCuda(1).install(monkeypatch)
    assert handoff.apply(handoff.decode_small(frame), {}) == 7
    assert receiver.set == [(0, [41] * 16)]


def test_the_light_snapshot_carries_the_cuda_states_and_the_device_they_were_drawn_on(monkeypatch):
    """The per-step snapshot a SIGKILLed rank leaves behind: its joiner continues that GPU's dropout stream."""
    FakeCuda(4, current=2, seed=100).install(monkeypatch)
    random.seed(5)
    torch.manual_seed(6)
    frame = light.LightSnapshotter().take({}, 11)
    expected_torch = torch.get_rng_state()
    random.seed(0)
    torch.manual_seed(0)
    bundle = light.decode(frame)
    rng = handoff.decode_tree(bundle.meta["rng"], bundle.tensors)
    assert rng["cuda_current"] == 2 and [s[0].item() for s in rng["cuda"]] == [100, 101, 102, 103]
    spare = FakeCuda(1).install(monkeypatch)
    assert handoff.apply(bundle, {}) == 11
    assert spare.set == [(0, [102] * 16)]
    assert torch.equal(torch.get_rng_state(), expected_torch)


def test_a_cpu_process_neither_captures_nor_restores_cuda_state(monkeypatch):
    FakeCuda(0).install(monkeypatch)
    state = capture_rng()
    assert "cuda" not in state and "cuda_current" not in state
    head_of = light.LightSnapshotter().take({}, 0)
    assert b'"cuda":[]' in head_of and b'"cuda_at":null' in head_of


class FakeTensor:
    def __init__(self, name: str, is_cuda: bool) -> None:
        self.name, self.is_cuda = name, is_cuda


def test_the_shard_copier_plan_splits_by_device_and_keeps_the_snapshot_order():
    """CudaCopier.start: sources on a GPU go to the side stream (into pinned buffers), the others to the CPU
    copy thread; each list in the order the snapshot named them (the optimizer's state, then the model)."""
    names = [("m.w", True), ("m.b", True), ("sampler.pos", False), ("opt.exp_avg", True), ("opt.step", False)]
    pairs = [(f"dst:{n}", FakeTensor(n, c)) for n, c in names]
    gpu, cpu = split_by_device(pairs)
    assert [d for d, _ in gpu] == ["dst:m.w", "dst:m.b", "dst:opt.exp_avg"]
    assert [d for d, _ in cpu] == ["dst:sampler.pos", "dst:opt.step"]
    assert split_by_device([]) == ([], [])


def test_the_copier_is_chosen_by_the_device():
    from tpassrun.worker.shard_copy import CpuCopier, make_copier

    assert isinstance(make_copier(), CpuCopier) == (not torch.cuda.is_available())
