"""Issue 11's malformed etcd values, against a real etcd: each is skipped with one log line, and neither stops
other swaps, kills a task, nor spins the CPU (a coordinator tick or a CAS per event, not a loop)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import types

import pytest

from tpassrun.records import Keys, NodeStatus, Phase, SlotRef, SwapKind, SwapPlan, Taint, TaintEffect, WorkerRow
from tpassrun.rendezvous import EtcdConfig, EtcdRendezvous, EtcdStore, Generation, GenState, Member, NodeInfo, RendezvousSettings
from tpassrun.swapper import Swapper
from tpassrun.swapper.agentport import AgentPort, SwapSettings
from tpassrun.swapper.coordinator import Coordinator

GARBAGE = b"0123456789"   # the 10-byte value of the finding


def _cfg(endpoint: str) -> EtcdConfig:
    return EtcdConfig.from_endpoint(endpoint, {"read_timeout": "5"})


async def _put_raw(store: EtcdStore, key: str, raw: bytes) -> None:
    await store._call(lambda c: c.put(key.encode(), raw))


class _Events:
    def __init__(self) -> None:
        self.written: list[tuple[str, dict]] = []

    def write(self, kind: str, **fields) -> None:
        self.written.append((kind, fields))


def _fake_agent(store: EtcdStore, prefix: str) -> AgentPort:
    """The coordinator's port with no agent behind it: the rendezvous handle (keys, store, leadership) is real
    etcd, the generation is fixed, events and requests are recorded."""
    rdzv = types.SimpleNamespace(key=lambda *parts: prefix + "/".join(parts), store=store, is_leader=True,
                                 generation=None)
    gen = Generation(number=0, state=GenState.ACTIVE, members=(Member("n0", 0, "127.0.0.1", 1, 0),), world_size=1)
    posted: list = []

    async def nothing(*_a) -> None:
        return None
    return AgentPort(node_id="n0", addr="127.0.0.1", settings=SwapSettings(1, 1), events=_Events(),
                     rdzv=rdzv, slots=None, generation=lambda: gen,  # type: ignore[arg-type]
                     spawned_generation=lambda: 0, master=lambda: ("", 0), set_generation=lambda g: None,
                     spawn_spare=nothing, publish_status=nothing, post=posted.append)


async def _seed_taintable_rank(store: EtcdStore, keys: Keys) -> None:
    status = NodeStatus(node_id="n0", workers=(WorkerRow(slot=0, state="running", rank=0, managed=True),
                                               WorkerRow(slot=1, state="spare", managed=True, spare=True)))
    await store.put_json(keys.status("n0"), status.to_json())
    taint = Taint(id="t1", effect=TaintEffect.MIGRATE, reason="ecc", source="tpassctl", node_id="n0", slot=0, rank=0)
    await store.put_json(keys.taint("t1"), taint.to_json())


async def _planned(store: EtcdStore, keys: Keys, timeout: float = 10.0) -> list[SwapPlan]:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        plans = [SwapPlan.from_json(d) for _k, d, _r in await store.get_prefix_json(keys.family("swaps"))
                 if d.get("taint_id") == "t1"]
        if plans:
            return plans
        await asyncio.sleep(0.05)
    return []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [GARBAGE, b'{"v": 1, "id": "x", "leaver": 5}', b"[1, 2]"],
                         ids=["10-bytes", "leaver-5", "json-list"])
def test_coordinator_skips_a_malformed_plan_and_still_swaps(etcd_server, run_id, caplog, bad):
    caplog.set_level(logging.WARNING)

    async def main() -> None:
        prefix = f"/tpassrun/v1/{run_id}/"
        keys = Keys(prefix)
        async with EtcdStore(_cfg(etcd_server.endpoint)) as store:
            await _put_raw(store, keys.swap("x"), bad)
            await _seed_taintable_rank(store, keys)
            coordinator = Coordinator(_fake_agent(store, prefix))
            ticks = 0
            tick = coordinator._leader_tick

            async def counted() -> None:
                nonlocal ticks
                ticks += 1
                await tick()
            coordinator._leader_tick = counted  # type: ignore[method-assign]
            task = asyncio.ensure_future(coordinator.run())
            try:
                plans = await _planned(store, keys)
                assert plans and plans[0].leaver == SlotRef("n0", 0, 0) and plans[0].joiner.slot == 1
                before = ticks
                await asyncio.sleep(1.0)        # nothing changes: the coordinator must sit still
                assert ticks - before <= 2, f"{ticks - before} ticks in 1 s with nothing to do"
                assert not task.done()
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    asyncio.run(main())
    assert "swap coordinator tick failed" not in caplog.text
    assert caplog.text.count("swaps/x") + caplog.text.count("non-JSON") <= 1


@pytest.mark.timeout(60)
def test_participant_survives_a_plan_with_an_invalid_leaver(etcd_server, run_id, caplog):
    """The swapper task died on `leaver: 5` (later plans were never followed, nothing was logged)."""
    caplog.set_level(logging.WARNING)

    async def main() -> None:
        prefix = f"/tpassrun/v1/{run_id}/"
        keys = Keys(prefix)
        async with EtcdStore(_cfg(etcd_server.endpoint)) as store:
            await store.put_json(keys.swap("early"), {"v": 1, "id": "early", "leaver": 5})
            swapper = Swapper(_fake_agent(store, prefix))
            seen: list[str] = []

            async def on_plan(plan: SwapPlan) -> None:
                seen.append(plan.id)
            swapper._on_plan = on_plan  # type: ignore[method-assign]
            task = asyncio.ensure_future(swapper._follow_plans())
            try:
                await asyncio.sleep(0.3)
                await store.put_json(keys.swap("late-bad"), {"v": 1, "id": "late-bad", "leaver": 5})
                good = SwapPlan(id="good", kind=SwapKind.PLANNED, generation=0, leaver=SlotRef("n0", 0, 0),
                                joiner=SlotRef("n0", 1, 0), donor=None, phase=Phase.PAUSE, reason="t", nodes=("n0",))
                await store.put_json(keys.swap("good"), good.to_json())
                for _ in range(100):
                    if seen:
                        break
                    await asyncio.sleep(0.05)
                assert seen == ["good"] and not task.done()
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    asyncio.run(main())
    assert caplog.text.count("swaps/early") == 1 and caplog.text.count("swaps/late-bad") == 1


@pytest.mark.timeout(60)
def test_a_non_json_generation_does_not_spin_the_leader(etcd_server, run_id, caplog):
    """A non-JSON `generation` sent the leader into a CAS busy loop (~570 requests/s)."""
    caplog.set_level(logging.WARNING)

    async def main() -> None:
        s = RendezvousSettings(run_id=run_id, min_nodes=1, max_nodes=1, lease_ttl=5, last_call_timeout=0.1)
        async with EtcdRendezvous(_cfg(etcd_server.endpoint), s, NodeInfo("a", "127.0.0.1", 1)) as rdzv:
            gen = await asyncio.wait_for(rdzv.join(), 20)
            store = rdzv.store
            calls = 0
            for name in ("cas_json_rev", "get_json", "read_json"):
                real = getattr(store, name)

                def counted(*a, _real=real, **kw):
                    nonlocal calls
                    calls += 1
                    return _real(*a, **kw)
                setattr(store, name, counted)
            await _put_raw(store, rdzv.key("generation"), GARBAGE)
            await asyncio.sleep(1.5)
            assert calls <= 5, f"{calls} etcd requests in 1.5 s after a malformed generation"
            assert rdzv.generation is not None and rdzv.generation.number == gen.number
            # The leader put the last good record back over the garbage, once.
            doc, _rev = await store.get_json(rdzv.key("generation"))
            assert Generation.from_json(doc) == gen.with_revision(0)
            # The next write goes on from there.
            await rdzv.request_restart(gen, "after garbage")
            doc, _rev = await store.get_json(rdzv.key("generation"))
            assert Generation.from_json(doc).number == gen.number + 1
    asyncio.run(main())
    assert caplog.text.count("malformed generation") == 1
