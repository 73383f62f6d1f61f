"""The data position of a DataLoader with a DistributedSampler: the batches the step took (not the workers'
prefetch) travel, and a load starts the epoch at that batch without loading the ones before it."""

from __future__ import annotations

import gc

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tpassrun.adapters.data import ResumableLoader


class Logged(Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.fetched = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.fetched.append(i)
        return torch.tensor([float(i)])


def _loader(ds: Dataset, workers: int = 0) -> DataLoader:
    return DataLoader(ds, batch_size=4, num_workers=workers, drop_last=True,
                      sampler=DistributedSampler(ds, num_replicas=2, rank=1, seed=3))


def test_a_load_starts_the_epoch_at_the_batch_taken_without_loading_the_ones_before():
    torch.manual_seed(0)
    a = ResumableLoader(_loader(Logged(64)))
    for _ in range(3):
        a.next()
    state = a.state_dict()
    assert state["batch"] == 3 and state["epoch"] == 0
    ds = Logged(64)
    b = ResumableLoader(_loader(ds))
    rng = torch.get_rng_state()
    b.load_state_dict(state)
    assert torch.equal(torch.get_rng_state(), rng)        # the load draws nothing from the global RNG
    assert ds.fetched == []
    for _ in range(10):                                   # into the next epoch (8 batches per epoch)
        assert torch.equal(a.next(), b.next())
    assert a.state_dict() == b.state_dict() == {"v": 1, "epoch": 1, "batch": 5}
    skipped = {i for batch in list(_loader(Logged(64)).batch_sampler)[:3] for i in batch}   # epoch 0's first 3
    assert len(ds.fetched) == 40 and not skipped & set(ds.fetched[:20])


def test_with_worker_processes_the_position_is_what_the_step_took_not_the_prefetch():
    torch.manual_seed(0)
    a = ResumableLoader(_loader(Logged(64), workers=2))
    taken = [a.next() for _ in range(2)]
    assert a.state_dict()["batch"] == 2                   # the workers have asked for more by now
    b = ResumableLoader(_loader(Logged(64), workers=2))
    b.load_state_dict(a.state_dict())
    try:
        assert torch.equal(a.next(), b.next()) and not any(torch.equal(t, a.next()) for t in taken)
    finally:
        # the workers exit by themselves now (removing their $TMPDIR/pymp-*), not whenever the garbage collector
        # gets to the iterators (a clean-clone CI run found one left: the test's $TMPDIR is checked right after)
        a.close()
        b.close()
        gc.collect()


def test_an_epoch_not_started_yet_is_started_by_the_next_batch_as_in_the_uninterrupted_run():
    """Creating the iterator draws its workers' base seed from the global RNG: at the same point in both runs."""
    torch.manual_seed(0)
    a = ResumableLoader(_loader(Logged(64)))
    x = a.next()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    b = ResumableLoader(_loader(Logged(64)))
    b.load_state_dict({"v": 1, "epoch": 0, "batch": 0})
    assert torch.equal(b.next(), x) and torch.equal(torch.get_rng_state(), after)
