"""tpassrun: a torchrun that swaps one failing rank for a warm spare.

The worker API (``tpassrun.init``) is imported lazily so that the launcher, ``tpassctl`` and
``tpassrun.rendezvous`` never pay for ``import torch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from tpassrun.worker import Session


def init(backend: str | None = None, **kwargs: Any) -> "Session":
    """Join the job: on an active rank returns at once; on a spare blocks until given a rank.

    See :func:`tpassrun.worker.init`.
    """
    from tpassrun.worker import init as _init

    return _init(backend=backend, **kwargs)


__all__ = ["init", "__version__"]
