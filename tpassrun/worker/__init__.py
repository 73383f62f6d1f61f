"""The worker API: ``sess = tpassrun.init()``, ``sess.track(...)``, ``sess.on_reconfigure(fn)``, ``sess.run(step_fn, n)``.

A healthy rank pays one shared-memory read per step (``run_until``) and a local light-state snapshot; it never
talks to the network for tpassrun's sake. Everything else happens only when the agent stops the world at a
step boundary:

* **survivor**: paused before step B; on ``reform`` it destroys its process group, joins the new world (same
  rank, same size, the joiner in the leaver's place), runs the ``on_reconfigure`` callbacks, carries on at B.
* **leaver** (planned swap): paused before step B; streams everything it tracks straight to the joiner, exits 0.
* **joiner** (a warm spare): blocked in :func:`init` until assigned a rank; receives the state, joins the new
  world; :meth:`Session.run` applies the state and starts at B.
* **unplanned**: a step that raises a distributed error (a peer died) parks the worker; the agent picks a
  donor (any survivor: under DDP every rank holds the model and optimizer) and a spare; survivors roll their
  light state back to the snapshot taken at the start of the failed step and everyone re-executes it.

Launched without tpassrun (plain ``torchrun`` or ``python``), :func:`init` just calls
``init_process_group`` and :meth:`Session.run` is a plain loop, so the same script runs anywhere.

Where the code is: :mod:`tpassrun.worker.session` (``Session``: hooks, the step loop, a joiner's pending
state; composed of parts sharing one :class:`~tpassrun.worker.state.WorkerState`),
:mod:`tpassrun.worker.step` (the step transaction: light snapshots, seal, commit point),
:mod:`tpassrun.worker.commands` (the one command dispatcher, a rank's commands, sending state),
:mod:`tpassrun.worker.spare` (a spare's commands), :mod:`tpassrun.worker.receive` (the receiving end of a transfer),
:mod:`tpassrun.worker.failure` (what a step's exception is),
:mod:`tpassrun.worker.link` (the channel's worker end).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from datetime import timedelta
from typing import Any

from tpassrun.channel import INT64_MAX, Field, Hello, StepFailure, WorkerPhase
from tpassrun.settings import envnames as E
from tpassrun.worker import faultpoints as testing
from tpassrun.worker.failure import classify_failure, is_distributed_failure
from tpassrun.worker.link import AgentLink
from tpassrun.worker.receive import _receive_state
from tpassrun.worker.session import Session
from tpassrun.worker.spare import _prewarm
from tpassrun.worker.watch import Watcher
from tpassrun.worker.world import GROUP_SOCKETS, init_first_world

log = logging.getLogger("tpassrun.worker")

_AgentLink = AgentLink   # the name tests and bench/step_overhead.py import


def init(backend: str | None = None, *, timeout: timedelta | None = None) -> Session:
    """Join the job. Active ranks return at once; a warm spare blocks here until it is given a rank.

    Args:
        backend: passed to ``init_process_group`` (None lets torch choose, as it does).
        timeout: process-group timeout (torch's default if None).
    """
    import torch.distributed as dist

    env = os.environ
    channel, sock = env.get(E.TPASSRUN_CHANNEL), env.get(E.TPASSRUN_AGENT_SOCK)
    local_rank = int(env.get(E.LOCAL_RANK, "0"))
    if not channel or not sock:
        # Not launched by tpassrun: behave like a plain torchrun script.
        if not dist.is_initialized():
            kwargs = {"timeout": timeout} if timeout is not None else {}
            dist.init_process_group(backend, **kwargs)
        return Session(backend=backend, link=None, rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=local_rank, generation=0, joined=False, timeout=timeout)

    _quiet_interrupts()
    spare = env.get(E.TPASSRUN_SPARE) == "1"
    if spare:
        _prewarm()
        if testing.ENABLED:
            testing.fault_point(-1, 0, "spare_start")   # tests: a spare slow to start (a host importing torch)
    link = AgentLink(channel, int(env[E.TPASSRUN_SLOT]), sock)
    link.set(Field.PID, os.getpid())
    link.send(Hello(pid=os.getpid(), spare=spare))
    Watcher(sock, link.slot, link.ch).start()    # breaks this rank out of collectives with a lost node
    generation = int(env.get(E.TPASSRUN_GENERATION, "0"))
    if not spare:
        if not dist.is_initialized():
            init_first_world(backend, timeout)
        link.set(Field.PHASE, WorkerPhase.STARTING)
        return Session(backend=backend, link=link, rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=local_rank, generation=generation, joined=False, timeout=timeout)
    # a spare is a session without a rank: it serves the agent's commands until one makes it a rank
    sess = Session(backend=backend, link=link, rank=-1, world_size=0, local_rank=local_rank, generation=generation,
                   joined=False, timeout=timeout)
    sess._spares.wait_for_rank()
    return sess


def _quiet_interrupts() -> None:
    """A Ctrl-C reaches every worker (the launcher forwards SIGINT, as torchrun does): each printed a whole
    KeyboardInterrupt traceback, ~15 lines a rank, around the launcher's own lines. A worker of tpassrun's says
    one line instead; the script's own ``except KeyboardInterrupt`` / ``finally`` still run (nothing is caught
    here: only what reaches the top is said differently). Torch's per-rank prefix, installed by
    ``init_process_group`` around this hook, still names the rank."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if issubclass(kind, KeyboardInterrupt):
            sys.stderr.write("interrupted (SIGINT from the launcher): stopped\n")
            sys.stderr.flush()
            gc.freeze()   # the interpreter's last collection then skips torch's object graph (seconds, here)
            return
        previous(kind, value, tb)

    sys.excepthook = hook


__all__ = ["AgentLink", "GROUP_SOCKETS", "INT64_MAX", "Session", "StepFailure", "_AgentLink", "_receive_state",
           "classify_failure", "init", "is_distributed_failure"]
