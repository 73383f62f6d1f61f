"""A second fault landing while the leader reads the control plane (tpassrun/swapper/coordinator.py), against a real etcd.

A dying worker's agent writes its failure record, then the node's status that shows the slot dead. The leader reads
the members' status before the failures: a death the status shows is then always in the failures it reads, and a
donor dying while it hands over the state supersedes the recovery (both ranks planned again at once) instead of
looking like a sender gone without a failure, which aborts the recovery and restarts the whole group. The agent's
two writes are made to land between the leader's reads, at the worst point."""

from __future__ import annotations

import asyncio
import types

import pytest

from tpassrun.plan.triage import CasPlan, triage
from tpassrun.records import Failure, Keys, NodeStatus, Phase, SlotRef, SwapKind, SwapPlan, WorkerRow
from tpassrun.rendezvous import EtcdConfig, EtcdStore, Generation, GenState, Member
from tpassrun.swapper.agentport import AgentPort, SwapSettings
from tpassrun.swapper.coordinator import Coordinator

pytestmark = pytest.mark.timeout(60)


class _Events:
    def write(self, kind: str, **fields) -> None:
        pass


def _port(store, prefix: str) -> AgentPort:
    """The leader's port with no agent behind it: keys and store are real etcd, the generation is fixed."""
    rdzv = types.SimpleNamespace(key=lambda *parts: prefix + "/".join(parts), store=store, is_leader=True,
                                 generation=None)
    gen = Generation(number=0, state=GenState.ACTIVE, members=(Member("n0", 0, "127.0.0.1", 1, 0),), world_size=3)

    async def nothing(*_a) -> None:
        return None
    return AgentPort(node_id="n0", addr="127.0.0.1", settings=SwapSettings(1, 1), events=_Events(), rdzv=rdzv,
                     slots=None, generation=lambda: gen, spawned_generation=lambda: 0,  # type: ignore[arg-type]
                     master=lambda: ("", 0), set_generation=lambda g: None, spawn_spare=nothing,
                     publish_status=nothing, post=lambda *_a: None)


def _status(donor_state: str) -> NodeStatus:
    return NodeStatus(node_id="n0", workers=(
        WorkerRow(slot=0, state=donor_state, rank=0, managed=True),
        WorkerRow(slot=1, state="dead", rank=1, managed=True),
        WorkerRow(slot=2, state="running", rank=2, managed=True),
        WorkerRow(slot=3, state="running", rank=1, managed=True)))       # the joiner, receiving


class _AgentWritesMidRead:
    """The real store; right after the leader's first read of either the failures or the status, the donor's
    agent writes what it writes when its worker dies: the failure record, then the status."""

    def __init__(self, store: EtcdStore, keys: Keys) -> None:
        self._store, self._keys, self._fired = store, keys, False

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    async def get_prefix_json(self, prefix: str):
        rows = await self._store.get_prefix_json(prefix)
        if not self._fired and prefix in (self._keys.family("failures"), self._keys.family("status")):
            self._fired = True
            dead = Failure(node="n0", slot=0, rank=0, code=-9, step=12, light=True, generation=0)
            await self._store.put_json(self._keys.failure("n0", 0), dead.to_json())
            await self._store.put_json(self._keys.status("n0"), _status("dead").to_json())
        return rows


def test_a_donor_dying_while_the_leader_reads_supersedes_the_recovery(etcd_server, run_id):
    async def main() -> list:
        prefix = f"/tpassrun/v1/{run_id}/"
        keys = Keys(prefix)
        async with EtcdStore(EtcdConfig.from_endpoint(etcd_server.endpoint, {"read_timeout": "5"})) as store:
            try:
                plan = SwapPlan(id="u-n0-1-0", kind=SwapKind.UNPLANNED, generation=0, leaver=SlotRef("n0", 1, 1),
                                joiner=SlotRef("n0", 3, 1), donor=SlotRef("n0", 0, 0), phase=Phase.SEND,
                                reason="exit code -9", nodes=("n0",), boundary=12, secret="00" * 16,
                                history=((Phase.PAUSE.value, 1.0),))
                await store.put_json(keys.swap(plan.id), plan.to_json())
                first = Failure(node="n0", slot=1, rank=1, code=-9, step=12, light=True, generation=0,
                                handled="plan")
                await store.put_json(keys.failure("n0", 1), first.to_json())
                await store.put_json(keys.status("n0"), _status("running").to_json())
                seen = await Coordinator(_port(_AgentWritesMidRead(store, keys), prefix))._read(1000.0)
                return list(triage(seen).actions)
            finally:
                await store.delete_prefix(prefix)

    actions = asyncio.run(main())
    cas = [a for a in actions if isinstance(a, CasPlan)]
    assert len(cas) == 1 and cas[0].new.phase == Phase.ABORTED, actions
    assert cas[0].new.superseded and "(the donor) died while handing over" in cas[0].new.outcome, cas[0].decision
