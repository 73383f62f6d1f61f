"""How a warm spare starts: the user's script, run as ``python -u -m tpassrun.launch.sparestart [-m] TARGET ARGS...``.

A spare runs the user's script up to ``tpassrun.init()`` and waits there for a rank. A script that never
imports tpassrun has no such place: it would call ``init_process_group`` with the spare's ``RANK=-1`` and die
with a gloo/NCCL traceback. So, in a spare only, ``init_process_group`` is guarded: called before
``tpassrun.init()`` has given the spare a rank (which removes ``TPASSRUN_SPARE`` from the environment before
joining), it parks the process quietly instead. A parked spare still holds its slot, so a health-aware restart
of such a job (a taint on a script that cannot swap live) can start the tainted rank's replacement there.

Everything else is what ``python -u [-m] TARGET ARGS`` does: ``sys.argv``, ``__main__``, and ``sys.path[0]``
(the script's directory, or the working directory for ``-m``).
"""

from __future__ import annotations

import functools
import logging
import os
import runpy
import sys
import threading
from typing import Any, Callable

from tpassrun.settings import envnames as E

log = logging.getLogger(__name__)


def _park(*_args: Any, **_kwargs: Any) -> None:
    """Never returns: a spare of a script that does not use tpassrun.init() waits here until its agent
    stops it (SIGTERM at the end of the generation)."""
    log.info("spare: the script joins the world without tpassrun.init(); parking until needed")
    sys.stdout.flush()
    threading.Event().wait()


def guard(init: Callable[..., Any]) -> Callable[..., Any]:
    """``init`` (torch's ``init_process_group``), parking while this process is still an unassigned spare."""

    @functools.wraps(init)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get(E.TPASSRUN_SPARE) == "1":
            _park()
        return init(*args, **kwargs)

    guarded.__tpassrun_guard__ = True  # type: ignore[attr-defined]
    return guarded


def install_guard() -> None:
    try:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
    except ImportError:  # no torch: nothing a script could call
        return
    if getattr(dist.init_process_group, "__tpassrun_guard__", False):
        return
    guarded = guard(c10d.init_process_group)
    dist.init_process_group = guarded          # what scripts call
    c10d.init_process_group = guarded          # what torch's own helpers (init_device_mesh) call


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m tpassrun.launch.sparestart [-m] TARGET [ARGS...]")
    install_guard()
    if argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]       # run_module(alter_sys=True) sets argv[0] to the module's path
        sys.path[0] = os.getcwd()        # as `python -m` has it
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(script))   # as `python script.py` has it
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
