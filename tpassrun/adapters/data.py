"""A data position that survives a swap: any ``DataLoader`` (with a ``DistributedSampler`` or any sampler whose
order depends only on its epoch) seen as an endless stream of batches with a small, exact ``state_dict()``.

    loader = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, seed=1), num_workers=2)
    batches = ResumableLoader(loader)          # then sess.track(data=batches), or pass it to an adapter
    x, y = batches.next()                      # epochs roll over (sampler.set_epoch) by themselves

The state is ``{"epoch", "batch"}``: the batches the *step* took in that epoch, counted as :meth:`next` hands them
out, never the loader's own position (with worker processes its iterator has already asked for the next few
batches). A joiner, or a survivor rolling a failed step back, re-creates the epoch's iterator starting at that
batch: the sampler's indices before it are skipped, so nothing of the epoch is loaded again (a ``DataLoader``
built with its own ``batch_sampler`` or ``batch_size=None`` cannot be started mid-epoch: its batches before the
position are drawn and dropped instead). Re-creating a ``DataLoader`` iterator draws a base seed from the global
RNG; loading does that inside a saved-and-restored RNG state, so a load leaves the RNG streams exactly where the
uninterrupted run has them. Random draws *inside* loader workers (augmentation) restart from a fresh worker seed:
seed them per sample (from the index and the epoch) to keep them identical across a recovery.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

STATE_VERSION = 1


class _StartAt:
    """A sampler that yields ``inner``'s indices from the ``skip``-th on, once; then puts ``inner`` back."""

    def __init__(self, owner: Any, inner: Any, skip: int) -> None:
        self._owner, self._inner, self._skip = owner, inner, skip

    def __iter__(self) -> Iterator[Any]:
        self._owner.sampler = self._inner      # the next epoch iterates the sampler itself
        return itertools.islice(iter(self._inner), self._skip, None)

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_inner"], name)


class ResumableLoader:
    """Endless batches from ``loader``, epoch after epoch, with the position as state."""

    def __init__(self, loader: Any, *, epoch: int = 0) -> None:
        self.loader = loader
        self.epoch = epoch
        self.batch = 0
        self._it: Iterator[Any] | None = None

    def _sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    def _start_epoch(self, at_batch: int = 0) -> int:
        """A fresh iterator for ``self.epoch`` whose first batch is ``at_batch``; returns the batches it still has
        to drop to get there (0 unless this loader cannot skip indices)."""
        set_epoch = getattr(self._sampler(), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        self._it = None           # shut the old iterator's workers down before the new ones start
        batches: Any = getattr(self.loader, "batch_sampler", None)
        size = getattr(batches, "batch_size", None)
        if at_batch and type(batches).__name__ == "BatchSampler" and hasattr(batches, "sampler") and size:
            batches.sampler = _StartAt(batches, batches.sampler, at_batch * int(size))
            at_batch = 0
        self._it = iter(self.loader)
        return at_batch

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

    def close(self) -> None:
        """Stop the loader's worker processes now; the next batch starts fresh ones. A script that leaves with
        ``os._exit`` calls it first: its workers then exit by themselves (removing their ``$TMPDIR/pymp-*``
        directories) instead of being killed with the process group, which leaves those behind."""
        self._it = None           # the only reference: the iterator's __del__ shuts its workers down

    def __iter__(self) -> "ResumableLoader":
        return self

    def state_dict(self) -> dict[str, int]:
        return {"v": STATE_VERSION, "epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        import torch

        if state.get("v") != STATE_VERSION:
            raise ValueError(f"ResumableLoader state version {state.get('v')!r}, expected {STATE_VERSION}")
        epoch, batch = int(state["epoch"]), int(state["batch"])
        if (epoch, batch) == (self.epoch, self.batch) and self._it is not None:
            return                # already there (a survivor rolled back to where it stands): keep the workers
        self.epoch, self.batch = epoch, batch
        if batch == 0:
            # nothing taken from this epoch yet: the uninterrupted run creates its iterator (drawing the base
            # seed from the global RNG) at the next batch, so this one must too
            self._it = None
            return
        rng = torch.get_rng_state()
        try:
            for _ in range(self._start_epoch(batch)):
                assert self._it is not None
                next(self._it)
        finally:
            torch.set_rng_state(rng)


__all__ = ["ResumableLoader"]
