"""The workers' store (a TCPStore in a process of its own, :mod:`tpassrun.launch.storeserver`) as the agent runs it:
a fresh one per generation next to group rank 0, a standby on every other node of a multi-node job (listening,
idle, no torch imported), which becomes the store when the node that ran it is lost. A part of
:class:`tpassrun.agent.Agent` (:class:`WorkersStore`).

Why a standby everywhere rather than a store that survives its node (its state in etcd, or replicated): a
re-formed world needs none of the old store's keys (each world meets under a prefix of its own, and gloo's
addresses are exchanged afresh), so the only thing a lost store costs is the time to have another one listening.
A standby that already listens makes that nothing; without torch (the plain door opens on demand) it is one idle
interpreter of ~20 MB per node. docs/concepts.md ("No node is special") says more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time

from tpassrun.agent.state import AgentState, Started
from tpassrun.records import StoreStandby, emit
from tpassrun.rendezvous import Generation, RendezvousError, split_endpoint
from tpassrun.store import bind_host, derive_store_key, is_loopback

log = logging.getLogger("tpassrun.agent")


def free_port(host: str = "") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class WorkersStore:
    """The store process this agent runs, if any, and the standby that may replace a lost node's."""

    def __init__(self, state: AgentState, node: Started) -> None:
        self._state = state
        self._node = node
        self._proc: asyncio.subprocess.Process | None = None
        self._port = 0
        self._standby: tuple[asyncio.subprocess.Process, int] | None = None   # a store ready to take over (port)
        self._bind = "127.0.0.1"       # what the store process listens on (resolved from the advertised name)

    async def bootstrap(self, gen: Generation, host: bool) -> tuple[str, int]:
        """A fresh TCPStore per generation, hosted next to group rank 0 (never a previous attempt's keys)."""
        st = self._state
        cfg = st.cfg
        if st.member(gen) is None:
            # a spare node: its spares join re-formed worlds at the swap's store; knowing this generation's
            # lets it lead a swap (the leader names the store). Not worth failing over.
            try:
                return await self._node.rdzv.wait_bootstrap(gen, timeout=min(60.0, self._node.rdzv.settings.join_timeout))
            except RendezvousError as exc:
                log.debug("spare node: no bootstrap address for generation %d: %s", gen.number, exc)
                return ("", 0)
        if host:
            # torchrun's RendezvousStoreInfo.build: the rank-0 node's --local-addr, else its FQDN ("localhost"
            # on a machine without a domain), even for one node: workers see the same MASTER_ADDR as under it
            # (a single node's store listens on loopback only: 127.0.0.1 when that name is not a loopback one)
            addr, port = self.addr_for(cfg.local_addr or socket.getfqdn()), 0
            if cfg.rdzv_backend == "static":
                # torchrun's static agent serves the workers' store on the endpoint (--rdzv-endpoint, else
                # --master-addr/--master-port) and hands workers that address, which scripts may tcp:// to; ours
                # serves each generation's new store there (a new process: never a previous attempt's keys)
                _scheme, addr, static_port = split_endpoint(cfg.rdzv_endpoint, schemes=False, min_port=0)
                port = static_port or 0
            port = port or free_port()
            await self._start(port, addr if cfg.rdzv_backend == "static" else None)
            await self._node.rdzv.publish_bootstrap(gen, addr, port)
            return addr, port
        return await self._node.rdzv.wait_bootstrap(gen, timeout=self._node.rdzv.settings.join_timeout)

    def _single_node(self) -> bool:
        return self._state.cfg.max_nodes == 1

    def addr_for(self, advertised: str) -> str:
        """What workers are told to reach the store at: ``advertised``, or 127.0.0.1 for a single node whose
        name is not a loopback one (its store listens on loopback only)."""
        if self._single_node() and not is_loopback(bind_host(advertised, single_node=False)):
            return "127.0.0.1"
        return advertised

    def key(self) -> bytes | None:
        """The workers' store key (tpassrun.store): derived from the run's mirror key, given to this node's
        workers in their environment and to the store process on its stdin, never on a command line."""
        mirror = self._node.mirror
        return derive_store_key(mirror.key) if mirror is not None and mirror.key else None

    async def _start(self, port: int, addr: str | None = None) -> None:
        self._proc, self._port = await self._spawn(port, addr), port

    async def ready(self, timeout: float) -> bool:
        """Whether the workers' store this agent runs accepts connections (waiting up to ``timeout``): a store
        process just started imports torch first (seconds on a loaded host), and a worker that connects before
        it listens backs off for longer and longer, so a re-formed world would wait seconds past the store's start."""
        proc, port = self._proc, self._port
        deadline = time.monotonic() + timeout
        while proc is not None and proc.returncode is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                _r, w = await asyncio.wait_for(asyncio.open_connection(self._bind, port), 1.0)
                w.close()
                return True
            await asyncio.sleep(0.05)
        return False

    async def _spawn(self, port: int, addr: str | None = None, *, standby: bool = False) -> asyncio.subprocess.Process:
        """The store process, listening on ``addr`` (this node's advertised address by default) resolved, or
        on loopback for a single node (:func:`tpassrun.store.bind_host`); its key on stdin. A ``standby`` opens
        its plain door (torch's TCPStore: a 1-3 s import) only when a plain client comes: tpassrun's re-formed
        worlds use the authenticated door alone."""
        from tpassrun.launch import die_with_parent, inherit_only  # the same hooks the workers get

        cfg = self._state.cfg
        advertised = addr or cfg.local_addr or socket.getfqdn()
        self._bind = host = bind_host(advertised, single_node=self._single_node() and cfg.rdzv_backend != "static",
                                      named=addr is not None or bool(cfg.local_addr))
        key = self.key() or secrets.token_bytes(32)   # no mirror (tests): a key no worker holds
        inherit_only()                                # uvloop ignores close_fds
        proc = await asyncio.create_subprocess_exec(
            cfg.python_exec, "-m", "tpassrun.launch.storeserver", host, str(port),
            *(["--plain-on-demand"] if standby else []),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            start_new_session=True, preexec_fn=die_with_parent(os.getpid()))
        assert proc.stdin is not None
        proc.stdin.write(key.hex().encode() + b"\n")
        with contextlib.suppress(OSError):
            await proc.stdin.drain()
        proc.stdin.close()
        return proc

    async def standby(self) -> None:
        """A store ready to take over if the node that runs the workers' store is lost: started with the
        generation on every node of a multi-node job but the store's (and again by the callers that see a peer
        fail, should it have died). It listens and holds nothing, so the re-formed world meets at once."""
        st = self._state
        if self._single_node() or st.cfg.rdzv_backend == "static":
            return    # a single node's store dies only with the whole job; a static job's is on its endpoint
        if st.store_host == st.node_id or self._proc is not None:
            return
        if self._standby is not None and self._standby[0].returncode is None:
            return
        port = free_port()
        try:
            proc = await self._spawn(port, standby=True)
        except OSError as exc:     # no standby: a lost store's node is then served by a store started at the loss
            log.warning("tpassrun: could not start a standby workers' store: %s", exc)
            return
        self._standby = (proc, port)
        emit(st.events, StoreStandby(port=port, pid=proc.pid))

    async def host_new(self) -> tuple[str, int]:
        """Run the workers' store here from now on (the node that ran it was lost): the standby if one is up."""
        standby, self._standby = self._standby, None
        if standby is not None and standby[0].returncode is None:
            self._proc, port = standby
            self._port = port
        else:
            port = free_port()
            self._proc, self._port = await self._spawn(port, standby=True), port
        return (self.addr_for(self._state.cfg.local_addr or socket.getfqdn()), port)

    async def stop(self) -> None:
        procs = [self._proc, self._standby[0] if self._standby else None]
        self._proc, self._standby = None, None
        for proc in procs:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 5)


__all__ = ["WorkersStore", "free_port"]
