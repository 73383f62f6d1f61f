"""Races of a spare pool, one process on a real etcd (issue 24).

A pool node's spare node joins a job in the middle of its recovery: the leader plans the lost node's ranks onto
its spare slots the moment they appear, so the new agent's swapper starts following the plans while the leader is
already moving the plan on. Whatever it reads first, it must then see every later phase.
"""

from __future__ import annotations

import asyncio
import contextlib
import types

import pytest

from tpassrun.records import Keys, Phase, SlotRef, SwapKind, SwapPlan
from tpassrun.rendezvous import EtcdConfig, EtcdStore, GenState, Generation, Member
from tpassrun.swapper import Swapper
from tpassrun.swapper.agentport import AgentPort, SwapSettings


def _cfg(endpoint: str) -> EtcdConfig:
    return EtcdConfig.from_endpoint(endpoint, {"read_timeout": "5"})


def _port(store: EtcdStore, prefix: str) -> AgentPort:
    """A swapper's port with no agent behind it: real etcd, a fixed generation, events dropped."""
    rdzv = types.SimpleNamespace(key=lambda *parts: prefix + "/".join(parts), store=store, is_leader=False)
    gen = Generation(number=0, state=GenState.ACTIVE, members=(Member("n0", 0, "127.0.0.1", 1, 0),), world_size=2)

    async def nothing(*_a) -> None:
        return None
    return AgentPort(node_id="pool1", addr="127.0.0.1", settings=SwapSettings(1, 1),
                     events=types.SimpleNamespace(write=lambda *a, **k: None), rdzv=rdzv,
                     slots=None, generation=lambda: gen,  # type: ignore[arg-type]
                     spawned_generation=lambda: 0, master=lambda: ("", 0), set_generation=lambda g: None,
                     spawn_spare=nothing, publish_status=nothing, post=lambda _m: None)


@pytest.mark.timeout(60)
def test_a_phase_written_while_the_plans_read_at_start_are_carried_out_is_not_missed(etcd_server, run_id):
    """The stall of test_pool_e2e (1 run in 2 of the whole suite, 1 in 2 under CPU load): the pool node's spare node
    started following the plans, read the node plan at PAUSE, carried it out, and only then began to watch, from
    that moment. The leader had moved the plan to TRANSFER in between: the spare node never saw it, never handed
    its spares their ranks, and the recovery waited until the test's 180 s ran out. Here the next phase is written
    by the handler of the first one, which is that interleaving made certain."""

    async def main() -> list[str]:
        prefix = f"/tpassrun/v1/{run_id}/"
        keys = Keys(prefix)
        async with EtcdStore(_cfg(etcd_server.endpoint)) as store:
            plan = SwapPlan(id="n-b", kind=SwapKind.NODE, generation=0, leaver=SlotRef("b", 0, 2),
                            joiner=SlotRef("pool1", 0, 2), donor=None, phase=Phase.PAUSE, reason="node b lost",
                            nodes=("n0", "pool1"), history=((Phase.PAUSE.value, 1.0),), lost_node="b")
            await store.put_json(keys.swap(plan.id), plan.to_json())
            swapper = Swapper(_port(store, prefix))
            seen: list[str] = []
            transfer_seen = asyncio.Event()

            async def on_plan(p: SwapPlan) -> None:
                seen.append(p.phase.value)
                if p.phase == Phase.PAUSE:      # the leader moves on while this node carries the pause out
                    await store.put_json(keys.swap(plan.id), plan.advance(Phase.TRANSFER, 2.0).to_json())
                else:
                    transfer_seen.set()
            swapper._on_plan = on_plan  # type: ignore[method-assign]
            task = asyncio.ensure_future(swapper._follow_plans())
            try:
                await asyncio.wait_for(transfer_seen.wait(), 20)
            except asyncio.TimeoutError:
                pass
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await store.delete_prefix(prefix)
            return seen

    assert asyncio.run(main()) == ["pause", "transfer"]
