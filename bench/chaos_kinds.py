"""The chaos harness's fault kinds: each ``inject(cluster, rng)`` does one fault to a running job and returns a
note (what it did, and for the attacks whether anything got through). ``after`` undoes what must not outlive the
fault (taints, armed switches, a full disk, a partition). See ``bench/chaos.py``.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import socket
import time
import uuid
from typing import Any, Callable

from chaos_cluster import RANKS, Cluster
from faults import EtcdProxy, restart_etcd, taint  # noqa: F401  (EtcdProxy: the partition without netns)


def _kill_rank(c: Cluster, rank: int, sig: int = signal.SIGKILL) -> str:
    pid = c.pid_of_rank(rank)
    if pid is None:
        return f"rank {rank}: no live process"
    os.kill(pid, sig)
    return f"rank {rank} pid {pid}"


def worker_sigkill(c: Cluster, rng: random.Random) -> str:
    return "SIGKILL " + _kill_rank(c, rng.randrange(RANKS))


def sigstop_hang(c: Cluster, rng: random.Random) -> str:
    return f"SIGSTOP {_kill_rank(c, rng.randrange(RANKS), signal.SIGSTOP)} (--hang-timeout {c.hang_timeout:g})"


def agent_sigkill(c: Cluster, rng: random.Random) -> str:
    """SIGKILL a member node's agent (its workers die with it), then start a new agent as a spare node, as a
    cluster manager replacing the machine would."""
    gen = (c.snapshot() or {}).get("generation") or {}
    members = {m.get("node_id") for m in gen.get("members", [])}
    victims = [a for a in c.live_agents() if _node_of(a) in members] or [a for a in c.live_agents() if not a.spare_node]
    if not victims:
        return "no member agent to kill"
    victim = rng.choice(victims)
    c.kill_agent(victim)
    fresh = c.start_agent(spare_node=True)
    return f"SIGKILL agent {victim.name} (pid {victim.pid}); started {fresh.name} as a spare node"


def _node_of(agent: Any) -> str | None:
    for e in agent.events():
        if e.get("event") == "agent_started":
            return e.get("node")
    return None


def _swap_trigger(c: Cluster, rng: random.Random, rank: int) -> str:
    """A swap of ``rank``: planned (a taint) or unplanned (SIGKILL), at random."""
    if rng.random() < 0.5:
        taint(c.endpoint, c.run_id, rank=rank, reason="chaos")
        return f"taint rank {rank}"
    return "SIGKILL " + _kill_rank(c, rank)


def joiner_dies(c: Cluster, rng: random.Random) -> str:
    rank = rng.randrange(RANKS)
    c.switches.arm("receive", "kill", [rank])
    how = _swap_trigger(c, rng, rank)
    return f"joiner of rank {rank} dies as it starts to receive; {how}"


def donor_dies(c: Cluster, rng: random.Random) -> str:
    rank = rng.randrange(RANKS)
    if rng.random() < 0.5:
        c.switches.arm("send", "kill", [rank])
        taint(c.endpoint, c.run_id, rank=rank, reason="chaos")
        return f"leaver rank {rank} dies as it starts to send (planned swap)"
    donor = rank ^ 1     # the dead rank's first pick of a replica is a peer on its node (ranks 2k, 2k+1 start there)
    c.switches.arm("send", "kill", [donor])
    return f"rank {donor} armed to die as it starts to send its state to rank {rank}'s joiner; SIGKILL {_kill_rank(c, rank)}"


def corrupt_transfer(c: Cluster, rng: random.Random) -> str:
    rank = rng.randrange(RANKS)
    c.switches.arm("send", "corrupt", list(range(RANKS)))
    how = _swap_trigger(c, rng, rank)
    return f"one byte flipped on the wire of the next transfer; {how}"


def forged_transfer(c: Cluster, rng: random.Random) -> str:
    """A swap starts; a stranger (no key) races the real sender to the joiner's listener with perturbed weights.
    It must be dropped before anything is read from it; the run must end bit-identical."""
    rank = rng.randrange(RANKS)
    before = {p.id for p in (c.snapshot() or {}).get("plans", [])}
    how = _swap_trigger(c, rng, rank)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        snap = c.snapshot() or {}
        fresh = [p for p in snap.get("plans", []) if p.id not in before and p.joiner_addr]
        if fresh:
            host, port = fresh[-1].joiner_addr
            return f"{how}; {_stranger(host, int(port))}"
        time.sleep(0.01)
    return f"{how}; no joiner address seen"


def _stranger(host: str, port: int) -> str:
    """Connect, answer the listener's hello with a made-up proof, then push a frame anyway."""
    import torch

    from tpassrun.transfer.handoff import StateBundle, send_bundle

    try:
        with socket.create_connection((host, port), timeout=3) as s:
            s.settimeout(3)
            hello = s.recv(40)
            s.sendall(b"TPAU" + secrets.token_bytes(64))
            try:
                send_bundle(s, StateBundle({"step": 0}, [torch.full((64,), 7.0)]))
                return "stranger's frame ACCEPTED"
            except Exception as exc:  # noqa: BLE001 - refused, as it must be
                return f"stranger refused after a {len(hello)}-byte hello ({type(exc).__name__})"
    except OSError as exc:
        return f"stranger could not connect ({exc.strerror or exc})"


def forged_plan(c: Cluster, rng: random.Random) -> str:
    """A plan written straight into etcd, naming real nodes, the current generation and a trap socket as the
    joiner's address: nothing may ever connect to the trap."""
    from tpassrun.records import Phase, SlotRef, SwapKind, SwapPlan, load

    snap = c.snapshot() or {}
    gen = snap.get("generation") or {}
    members = [m.get("node_id") for m in gen.get("members", [])]
    status = snap.get("status", {})
    rank = rng.randrange(RANKS)
    leaver = joiner = None
    for node in members:
        for w in getattr(status.get(node), "workers", ()):
            if w.rank == rank:
                leaver = SlotRef(node, w.slot, rank)
            elif w.state == "spare" and joiner is None:
                joiner = SlotRef(node, w.slot, rank)
    if leaver is None or joiner is None:
        return "no leaver/spare to name"
    with socket.socket() as trap:
        trap.bind(("0.0.0.0", 0))
        trap.listen(4)
        trap.settimeout(8)
        plan = SwapPlan(id="s-forged-" + uuid.uuid4().hex[:6], kind=SwapKind.PLANNED, generation=int(gen.get("number", 0)),
                        leaver=leaver, joiner=joiner, donor=None, phase=Phase.SEND, reason="forged",
                        nodes=tuple(members), boundary=c.step(rank) + 2, joiner_addr=(_trap_host(c), trap.getsockname()[1]),
                        secret=secrets.token_hex(32), history=(("pause", time.time()), ("send", time.time())))

        async def put(store: Any) -> None:
            await store.put_json(c.prefix + "swaps/" + plan.id, plan.to_json())
        c.etcd_call(put)
        try:
            conn, _ = trap.accept()
            conn.close()
            said = "forged plan: something CONNECTED to the trap"
        except (TimeoutError, OSError):
            said = "forged plan: nothing connected to the trap in 8 s"
            # it carries no MAC of the run key: every live agent must have refused it on read (and said so once)
            live = [a for a in c.live_agents() if a.running]
            refusing = [a for a in live if f"refusing etcd record {c.prefix}swaps/{plan.id}" in a.job.log()]
            said = (f"forged plan: refused by {len(refusing)}/{len(live)} agents (no MAC of the run key), "
                    f"nothing connected to the trap in 8 s" if refusing and len(refusing) == len(live) else
                    said + f"; NOT REFUSED by {len(live) - len(refusing)}/{len(live)} agents")

    async def remove(store: Any) -> str:     # an operator's cleanup: the next fault starts from full strength
        left = [p for k, d, r in await store.get_prefix_json(c.prefix + "swaps/" + plan.id)
                if (p := load(SwapPlan.from_json, k, d, r)) is not None]
        await store.delete(c.prefix + "swaps/" + plan.id)
        return f"; the plan was left {left[0].phase.value}" if left else ""
    return said + (c.etcd_call(remove) or "")


def _trap_host(c: Cluster) -> str:
    return c.lab.gateway if c.lab is not None else "127.0.0.1"


def etcd_restart(c: Cluster, rng: random.Random) -> str:
    down = rng.uniform(1.0, 4.0)
    restart_etcd(c.etcd, down)
    return f"etcd SIGKILLed, restarted after {down:.1f} s"


def partition(c: Cluster, rng: random.Random) -> str:
    """A member node cut off (from etcd and from its peers) for a few seconds: shorter or longer than the lease."""
    gen = (c.snapshot() or {}).get("generation") or {}
    members = {m.get("node_id") for m in gen.get("members", [])}
    victims = [a for a in c.live_agents() if _node_of(a) in members and a.host]
    if c.lab is None or not victims:
        return "no partitionable member (needs --netns)"
    victim = rng.choice(victims)
    seconds = rng.choice([rng.uniform(2.0, c.lease_ttl * 0.6), rng.uniform(c.lease_ttl + 2, c.lease_ttl * 2)])
    c.lab.partition(victim.host)
    time.sleep(seconds)
    c.lab.heal(victim.host)
    return f"{victim.name} partitioned for {seconds:.1f} s (lease {c.lease_ttl} s)"


def disk_full(c: Cluster, rng: random.Random) -> str:
    """The disk of every log (--log-dir, --tee) fills up; a worker is SIGKILLed while it is full (a recovery and a
    spare respawn on a full disk). Freed once the job settled."""
    if c.disk is None:
        return "no small disk (needs root)"
    c.disk.fill()
    time.sleep(1.0)
    return f"log disk full; SIGKILL {_kill_rank(c, rng.randrange(RANKS))}"


def malformed_value(c: Cluster, rng: random.Random) -> str:
    key = rng.choice(["swaps/x", "taints/x", "failures/x", "status/x", "reports/x/0/y", "fallbacks/x", "generation"])
    if key != "generation":
        key = key.replace("x", "x" + uuid.uuid4().hex[:4])
    value = rng.choice([b"\x00not json", b"{\"v\": 1, \"leaver\": 5}", b"[1,2,3]", b"{\"v\": 99}", b""])

    async def put(store: Any) -> None:
        client, _ = await store.connection.acquire()
        await client.put((c.prefix + key).encode(), value)
    c.etcd_call(put)
    return f"{key} = {value[:24]!r}"


def taint_storm(c: Cluster, rng: random.Random) -> str:
    """Three ranks tainted at once (three ``tpassctl taint`` racing), one of them twice: the swaps must drain one
    after another, the duplicate be coalesced, a rank left without a spare wait (said once)."""
    import threading

    ranks = rng.sample(range(RANKS), 3)
    twice = rng.choice(ranks)
    runs = [threading.Thread(target=taint, args=(c.endpoint, c.run_id), kwargs={"rank": r, "reason": "chaos storm"})
            for r in (*ranks, twice)]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    return f"ranks {ranks} tainted at once, rank {twice} twice"


def planned_taint(c: Cluster, rng: random.Random) -> str:
    rank = rng.randrange(RANKS)
    taint(c.endpoint, c.run_id, rank=rank, reason="chaos")
    return f"taint rank {rank}"


KINDS: dict[str, Callable[[Cluster, random.Random], str]] = {
    "worker_sigkill": worker_sigkill, "sigstop_hang": sigstop_hang, "agent_sigkill": agent_sigkill,
    "joiner_dies": joiner_dies, "donor_dies": donor_dies, "corrupt_transfer": corrupt_transfer,
    "forged_transfer": forged_transfer, "forged_plan": forged_plan, "etcd_restart": etcd_restart,
    "partition": partition, "disk_full": disk_full, "malformed_value": malformed_value,
    "taint_storm": taint_storm, "taint": planned_taint,
}
# Faults after which no live recovery is expected: nothing to recover (attacks, etcd), or the job just goes on.
NOTHING_TO_RECOVER = {"forged_plan", "malformed_value", "etcd_restart"}


def after(c: Cluster, kind: str) -> None:
    """Undo what must not outlive a fault: taints (their slots go back to the spare pool), armed switches, the
    full disk."""
    c.untaint_all()
    c.switches.disarm()
    if kind == "disk_full" and c.disk is not None:
        c.disk.free()

