"""A data position that survives a swap: any ``DataLoader`` (with a ``DistributedSampler`` or any sampler whose
order depends only on its epoch) seen as an endless stream of batches with a small, exact ``state_dict()``.

    loader = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, seed=1))
    batches = ResumableLoader(loader)          # then sess.track(data=batches), or pass it to an adapter
    x, y = batches.next()                      # epochs roll over (sampler.set_epoch) by themselves

The state is ``{"epoch", "batch"}`` (batches taken in that epoch): a joiner, or a survivor rolling a failed step
back, re-creates the epoch's iterator and skips that many batches. Re-creating a ``DataLoader`` iterator draws a
base seed from the global RNG; loading does that inside a saved-and-restored RNG state, so a load leaves the RNG
streams exactly where the uninterrupted run has them.
"""

from __future__ import annotations

from typing import Any, Iterator

STATE_VERSION = 1


class ResumableLoader:
    """Endless batches from ``loader``, epoch after epoch, with the position as state."""

    def __init__(self, loader: Any, *, epoch: int = 0) -> None:
        self.loader = loader
        self.epoch = epoch
        self.batch = 0
        self._it: Iterator[Any] | None = None

    def _sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    def _start_epoch(self) -> None:
        set_epoch = getattr(self._sampler(), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        self._it = iter(self.loader)

    def next(self) -> Any:
        if self._it is None:
            self._start_epoch()
        assert self._it is not None
        try:
            item = next(self._it)
        except StopIteration:
            self.epoch, self.batch = self.epoch + 1, 0
            self._start_epoch()
            item = next(self._it)
        self.batch += 1
        return item

    __next__ = next

    def __iter__(self) -> "ResumableLoader":
        return self

    def state_dict(self) -> dict[str, int]:
        return {"v": STATE_VERSION, "epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        import torch

        if state.get("v") != STATE_VERSION:
            raise ValueError(f"ResumableLoader state version {state.get('v')!r}, expected {STATE_VERSION}")
        self.epoch, self.batch = int(state["epoch"]), 0
        rng = torch.get_rng_state()
        try:
            self._start_epoch()
            assert self._it is not None
            for _ in range(int(state["batch"])):
                next(self._it)
                self.batch += 1
        finally:
            torch.set_rng_state(rng)


__all__ = ["ResumableLoader"]
