"""Copying a rank's heavy state to host memory in the background (the local copies of :mod:`tpassrun.worker.shards`).

A copy is started at a step start and must have *read* the live tensors before the step's commit point changes
them (:meth:`CopyJob.fence`); the pusher thread waits for it to be complete (:meth:`CopyJob.wait`). On CPU one
background thread copies (torch releases the GIL in ``copy_``); on GPU a side stream copies into pinned memory.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Protocol, Sequence


class CopyJob(Protocol):
    def fence(self) -> None:
        """Return once the live tensors may change again (the copy has read them)."""

    def wait(self) -> None:
        """Return once the host copy is complete and readable (the pusher thread)."""

    def done(self) -> bool: ...


class Copier(Protocol):
    def host_buffer(self, like: Any) -> Any:
        """A host tensor to copy ``like`` into (contiguous; pinned for a GPU source)."""

    def start(self, pairs: Sequence[tuple[Any, Any]]) -> CopyJob:
        """Start copying every ``(dst, src)`` pair; return at once."""


class _ThreadJob:
    def __init__(self) -> None:
        self._event = threading.Event()
        self.error: BaseException | None = None
        self.cpu_s = 0.0                # the copy thread's CPU time for this job
                                        # (tpassrun/settings/shard_interval.py measures it)

    def fence(self) -> None:
        self._event.wait()

    def wait(self) -> None:
        self._event.wait()

    def done(self) -> bool:
        return self._event.is_set()


class CpuCopier:
    """CPU tensors: one background thread copies them (torch releases the GIL in ``copy_``), so the copy
    overlaps the step's forward and backward."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Sequence[tuple[Any, Any]], _ThreadJob]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def host_buffer(self, like: Any) -> Any:
        import torch

        return torch.empty(tuple(like.shape), dtype=like.dtype)

    def start(self, pairs: Sequence[tuple[Any, Any]]) -> CopyJob:
        job = _ThreadJob()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tpassrun-shard-copy", daemon=True)
            self._thread.start()
        self._jobs.put((pairs, job))
        return job

    def _run(self) -> None:
        import torch

        while True:
            pairs, job = self._jobs.get()
            t0 = time.thread_time()
            try:
                with torch.no_grad():
                    for dst, src in pairs:
                        dst.copy_(src.detach())
            except BaseException as exc:  # noqa: BLE001 - reported by the ring, never kills the thread
                job.error = exc
            finally:
                job.cpu_s = time.thread_time() - t0
                job._event.set()


class _CudaJob:
    def __init__(self, event: Any, cpu: CopyJob | None) -> None:
        self._event, self._cpu = event, cpu

    def fence(self) -> None:
        import torch

        torch.cuda.current_stream().wait_event(self._event)   # the optimizer's kernels queue behind the copy
        if self._cpu is not None:
            self._cpu.fence()

    def wait(self) -> None:
        self._event.synchronize()
        if self._cpu is not None:
            self._cpu.wait()

    def done(self) -> bool:
        return bool(self._event.query()) and (self._cpu is None or self._cpu.done())


def split_by_device(pairs: Sequence[tuple[Any, Any]]) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
    """The copier's plan: ``(dst, src)`` pairs whose source is on a GPU (side stream, pinned destination) and
    the others (the CPU thread), each list in the snapshot's order."""
    gpu = [(d, s) for d, s in pairs if s.is_cuda]
    return gpu, [(d, s) for d, s in pairs if not s.is_cuda]


class CudaCopier:
    """GPU tensors: device-to-host copies into pinned memory on a side stream, ordered after everything queued
    before the snapshot point; :meth:`_CudaJob.fence` makes the compute stream wait for them (no host sync), the
    pusher thread synchronizes on their event. CPU tensors of the same snapshot go to a :class:`CpuCopier`.
    Each source is recorded on the side stream: the caller drops its references at once, and a tensor freed on
    the compute stream (a state tensor replaced, not updated in place) must not be reused before the copy read
    it. Exercised on a GPU by ``scripts/gpu_check.sh``; its plan by ``tests/test_gpu_paths.py``."""

    def __init__(self) -> None:
        import torch

        self._stream = torch.cuda.Stream()
        self._cpu = CpuCopier()

    def host_buffer(self, like: Any) -> Any:
        import torch

        return torch.empty(tuple(like.shape), dtype=like.dtype, pin_memory=like.is_cuda)

    def start(self, pairs: Sequence[tuple[Any, Any]]) -> CopyJob:
        import torch

        gpu, cpu = split_by_device(pairs)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream), torch.no_grad():
            for dst, src in gpu:
                src.record_stream(self._stream)
                dst.copy_(src.detach(), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return _CudaJob(event, self._cpu.start(cpu) if cpu else None)


def make_copier() -> Copier:
    import torch

    return CudaCopier() if torch.cuda.is_available() else CpuCopier()


__all__ = ["CopyJob", "Copier", "CpuCopier", "CudaCopier", "make_copier", "split_by_device"]
