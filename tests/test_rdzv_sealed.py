"""The rendezvous's own records sealed with the run key, against a real etcd without authentication: many
``EtcdRendezvous`` in one process, and a writer without the key (what anyone who reaches such an etcd can do)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

import pytest

from tpassrun.records import rendezvous_guard
from tpassrun.records.provenance import MAC_FIELD, RunKey, seal
from tpassrun.rendezvous import (
    EtcdConfig,
    EtcdRendezvous,
    EtcdStore,
    Generation,
    GenState,
    Member,
    NodeInfo,
    RecordGuard,
    RendezvousKeyError,
    RendezvousSettings,
)

pytestmark = pytest.mark.timeout(60)


def _cfg(endpoint: str) -> EtcdConfig:
    return EtcdConfig.from_endpoint(endpoint, {"read_timeout": "5"})


def _settings(run_id: str, min_nodes: int, max_nodes: int, **kw) -> RendezvousSettings:
    base = dict(last_call_timeout=0.3, lease_ttl=3, join_timeout=30)
    return RendezvousSettings(run_id=run_id, min_nodes=min_nodes, max_nodes=max_nodes, **{**base, **kw})


@contextlib.asynccontextmanager
async def _agents(endpoint: str, s: RendezvousSettings, ids: list[str],
                  guard: RecordGuard) -> AsyncIterator[list[EtcdRendezvous]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(EtcdRendezvous(_cfg(endpoint), s, NodeInfo(n, "127.0.0.1", 2),
                                                              guard=guard)) for n in ids]


@contextlib.asynccontextmanager
async def _stranger(endpoint: str) -> AsyncIterator[EtcdStore]:
    """A client without the run key."""
    async with EtcdStore(_cfg(endpoint)) as store:
        yield store


async def _until(predicate, what: str, timeout: float = 20.0) -> None:
    """Poll until ``predicate()`` (plain or async) holds (a deadline that only catches a hang)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        ok = predicate()
        if asyncio.iscoroutine(ok):
            ok = await ok
        if ok:
            return
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.02)


def _logged(caplog, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


def _forged_generation(gen: Generation) -> dict:
    """The job's generation with an attacker's node in it (what a forged record would steer agents with)."""
    evil = Member("evil", len(gen.members), "6.6.6.6", 2, gen.world_size)
    return Generation(number=gen.number + 1, state=GenState.ACTIVE, members=(*gen.members, evil),
                      world_size=gen.world_size + 2, bootstrap=("6.6.6.6", 29500)).to_json()


# --- bootstrap ------------------------------------------------------------------------------------------------
def test_a_forged_bootstrap_address_is_waited_past_and_the_waiter_gets_the_genuine_one(etcd_server, run_id, caplog):
    caplog.set_level(logging.WARNING)
    guard = rendezvous_guard(RunKey.generate())

    async def main() -> None:
        async with _agents(etcd_server.endpoint, _settings(run_id, 2, 2), ["a", "b"], guard) as (a, b):
            gen = (await asyncio.gather(a.join(), b.join()))[0]
            key = a.key("bootstrap", str(gen.number))
            async with _stranger(etcd_server.endpoint) as store:
                # one there before the waiter reads, one while it watches (with a MAC of the wrong key)
                await store.put_json(key, {"v": 1, "number": gen.number, "addr": "6.6.6.6", "port": 29500})
                waiter = asyncio.ensure_future(b.wait_bootstrap(gen, timeout=30))
                await _until(lambda: (_logged(caplog, "refusing bootstrap address") >= 1), "first refusal")
                await store.put_json(key, seal(key, {"v": 1, "number": gen.number, "addr": "6.6.6.6", "port": 1},
                                               RunKey.generate()))
                await _until(lambda: (_logged(caplog, "refusing bootstrap address") >= 2), "second refusal")
                assert not waiter.done()
                await a.publish_bootstrap(gen, "10.1.2.3", 29400)
                assert await asyncio.wait_for(waiter, 20) == ("10.1.2.3", 29400)

    asyncio.run(main())


def test_a_forged_closed_record_is_ignored(etcd_server, run_id, caplog):
    caplog.set_level(logging.WARNING)

    async def main() -> None:
        s = _settings(run_id, 1, 1)
        async with _stranger(etcd_server.endpoint) as store:
            await store.put_json(s.run_prefix + "closed", {"v": 1, "reason": "forged", "node_id": "evil", "time": 1.0})
        async with _agents(etcd_server.endpoint, s, ["a"], rendezvous_guard(RunKey.generate())) as (a,):
            assert (await asyncio.wait_for(a.join(), 20)).member_ids == ("a",)

    asyncio.run(main())
    assert _logged(caplog, "refusing closed record") == 1


# --- generation -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("forgery", ["no-mac", "other-key"])
def test_a_forged_generation_is_refused_and_the_leader_restores_the_genuine_one(etcd_server, run_id, caplog, forgery):
    caplog.set_level(logging.WARNING)
    run_key = RunKey.generate()

    async def main() -> None:
        async with _agents(etcd_server.endpoint, _settings(run_id, 2, 2), ["a", "b"],
                           rendezvous_guard(run_key)) as agents:
            gen = (await asyncio.gather(*(r.join() for r in agents)))[0]
            events = [r.events() for r in agents]
            key = agents[0].key("generation")
            forged = _forged_generation(gen)
            if forgery == "other-key":
                forged = seal(key, forged, RunKey.generate())
            async with _stranger(etcd_server.endpoint) as store:
                await store.put_json(key, forged)

                async def restored() -> bool:
                    doc, _rev = await store.get_json(key)
                    return doc is not None and doc.get("members") == gen.to_json()["members"] and MAC_FIELD in doc
                await _until(restored, "the leader put the genuine generation back")
                doc, _rev = await store.get_json(key)
            assert Generation.from_json(doc) == gen and rendezvous_guard(run_key).problem(key, doc) is None
            for r, stream in zip(agents, events):
                assert r.generation == gen and r.generation.member("evil") is None
                assert stream.queue.empty(), "a refused generation must not reach the agents as an event"
                await stream.aclose()

    asyncio.run(main())
    assert _logged(caplog, "refusing the generation record") == 2           # once per agent
    assert _logged(caplog, "restored generation") == 1


# --- registrations --------------------------------------------------------------------------------------------
def test_a_forged_registration_never_enters_a_generation(etcd_server, run_id, caplog):
    caplog.set_level(logging.WARNING)
    run_key = RunKey.generate()
    guard = rendezvous_guard(run_key)

    async def main() -> None:
        s = _settings(run_id, 2, 4, last_call_timeout=0.5)
        prefix = s.run_prefix
        async with _stranger(etcd_server.endpoint) as store:
            # forming: a registration without a MAC, and one sealed with another key
            await store.put_json(prefix + "nodes/evil", NodeInfo("evil", "6.6.6.6", 2).to_json())
            await store.put_json(prefix + "nodes/evil2", seal(prefix + "nodes/evil2",
                                                              NodeInfo("evil2", "6.6.6.6", 2).to_json(), RunKey.generate()))
            async with _agents(etcd_server.endpoint, s, ["a", "b"], guard) as (a, b):
                gen = (await asyncio.gather(a.join(), b.join()))[0]
                assert sorted(gen.member_ids) == ["a", "b"] and gen.spare_nodes == () and gen.waiting == ()
                # active: a forged registration is not annotated; a genuine newcomer is, after it
                await store.put_json(prefix + "nodes/evil3", NodeInfo("evil3", "6.6.6.6", 2).to_json())
                await _until(lambda: (_logged(caplog, "node evil3's registration") >= 1), "evil3 refused")
                async with _agents(etcd_server.endpoint, s, ["c"], guard) as (c,):
                    join_c = asyncio.ensure_future(c.join())
                    await _until(lambda: (a.generation.waiting == ("c",)), "c waiting")
                    join_c.cancel()
                latest = a.generation
                for node in ("evil", "evil2", "evil3"):
                    assert not latest.includes(node) and node not in latest.waiting
                assert {i.node_id for i in await a.registrations()} == {"a", "b"}
            await store.delete_prefix(prefix + "nodes/")

    asyncio.run(main())
    assert _logged(caplog, "refusing node evil2's registration") >= 1     # by the leader (once per reader)
    assert "was sealed with another run key" in caplog.text


# --- leader ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("squatter", ["no-mac", "other-key", "garbage"])
def test_a_squatter_at_leader_does_not_stop_the_job_from_electing_one(etcd_server, run_id, squatter):
    run_key = RunKey.generate()

    async def main() -> None:
        s = _settings(run_id, 2, 2)
        key = s.run_prefix + "leader"
        value = {"v": 1, "node_id": "evil", "addr": "6.6.6.6", "pid": 1}
        async with _stranger(etcd_server.endpoint) as store:

            async def squat() -> None:
                if squatter == "garbage":
                    await store._call(lambda c: c.put(key.encode(), b"0123456789"))
                else:
                    await store.put_json(key, seal(key, value, RunKey.generate()) if squatter == "other-key" else value)

            async def one_leader(agents: list[EtcdRendezvous]) -> bool:
                doc, _rev = await store.get_json(key)
                leaders = [r for r in agents if r.is_leader]
                return (len(leaders) == 1 and doc is not None and doc.get("node_id") == leaders[0].node.node_id
                        and all(r.leader == leaders[0].node.node_id for r in agents))

            if squatter != "other-key":
                await squat()          # there before anyone starts (a key sealed by another run fails the start)
            async with _agents(etcd_server.endpoint, s, ["a", "b"], rendezvous_guard(run_key)) as agents:
                await asyncio.gather(*(r.join() for r in agents))
                await _until(lambda: one_leader(agents), "one leader after the squatter")
                await squat()          # over the job's leader key while it runs
                await _until(lambda: one_leader(agents), "one leader again")
                doc, _rev = await store.get_json(key)
                assert rendezvous_guard(run_key).problem(key, doc) is None

    asyncio.run(main())


def test_without_a_key_garbage_at_leader_no_longer_stops_an_election(etcd_server, run_id):
    async def main() -> None:
        s = _settings(run_id, 1, 1)
        async with _stranger(etcd_server.endpoint) as store:
            await store._call(lambda c: c.put((s.run_prefix + "leader").encode(), b"0123456789"))
        async with _agents(etcd_server.endpoint, s, ["a"], RecordGuard()) as (a,):
            gen = await asyncio.wait_for(a.join(), 20)
            assert a.is_leader and gen.member_ids == ("a",)

    asyncio.run(main())


# --- agents given different keys ------------------------------------------------------------------------------
def test_an_agent_with_another_key_fails_at_once_and_is_never_taken_in(etcd_server, run_id, caplog):
    """A joiner that finds the job's leader or generation sealed with another key stops with one line (instead of
    waiting for its join timeout); the job's leader never takes a registration of another key in."""
    caplog.set_level(logging.WARNING)
    ours, theirs = RunKey.generate(), RunKey.generate()

    async def main() -> None:
        s = _settings(run_id, 2, 2)
        async with _agents(etcd_server.endpoint, s, ["a"], rendezvous_guard(ours)) as (a,):
            join_a = asyncio.ensure_future(a.join())
            await _until(lambda: a.is_leader, "a leads")
            # before any generation: the leader record tells
            with pytest.raises(RendezvousKeyError) as first:
                async with _agents(etcd_server.endpoint, s, ["b"], rendezvous_guard(theirs)):
                    pass
            # a registration of another key is never taken in (b's own never got written: it left first)
            key = s.run_prefix + "nodes/b2"
            async with _stranger(etcd_server.endpoint) as store:
                await store.put_json(key, seal(key, NodeInfo("b2", "127.0.0.1", 2).to_json(), theirs))
                await _until(lambda: _logged(caplog, "node b2's registration") >= 1, "b2 refused")
                await store.delete(key)
            async with _agents(etcd_server.endpoint, s, ["c"], rendezvous_guard(ours)) as (c,):
                gen = (await asyncio.gather(join_a, c.join()))[0]
                assert sorted(gen.member_ids) == ["a", "c"]
                # once a generation formed: the generation (or the leader record) tells, whoever reads it first
                with pytest.raises(RendezvousKeyError) as second:
                    async with _agents(etcd_server.endpoint, s, ["d"], rendezvous_guard(theirs)):
                        pass
                assert a.generation == gen and (a.is_leader or c.is_leader)
        for exc in (first.value, second.value):
            text = str(exc)
            assert "\n" not in text and "was sealed with another run key" in text, text
            assert "run_key_file" in text and "$TPASSRUN_RUN_KEY" in text
        assert "node a's leader record was sealed with another run key" in str(first.value)

    asyncio.run(main())


def test_a_joiner_whose_key_differs_from_a_generation_written_while_it_waits_stops_at_once(etcd_server, run_id):
    """The generation arrives through the watch while the joiner (here the leader itself, with no generation
    yet) waits: its join ends with the one-line error, and it decides nothing more as leader."""
    ours, theirs = RunKey.generate(), RunKey.generate()

    async def main() -> None:
        s = _settings(run_id, 2, 2)
        key = s.run_prefix + "generation"
        async with _agents(etcd_server.endpoint, s, ["a"], rendezvous_guard(ours)) as (a,):
            join_a = asyncio.ensure_future(a.join())
            await _until(lambda: a.is_leader, "a leads")
            gen = Generation(number=0, state=GenState.ACTIVE, members=(Member("x", 0, "127.0.0.1", 2, 0),),
                             world_size=2)
            async with _stranger(etcd_server.endpoint) as store:
                await store.put_json(key, seal(key, gen.to_json(), theirs))
                with pytest.raises(RendezvousKeyError, match="the generation record was sealed with another run key"):
                    await asyncio.wait_for(join_a, 20)
                doc, _rev = await store.get_json(key)
                assert rendezvous_guard(theirs).problem(key, doc) is None     # not overwritten by the leaving agent

    asyncio.run(main())


def test_an_agent_without_a_key_next_to_agents_with_one(etcd_server, run_id, caplog):
    """Its registration carries no MAC: the others refuse it as a stranger's. It checks nothing, but a job whose
    records carry a MAC is not one it can join: it stops at once."""
    caplog.set_level(logging.WARNING)

    async def main() -> None:
        s = _settings(run_id, 1, 2, last_call_timeout=0)
        async with _agents(etcd_server.endpoint, s, ["a"], rendezvous_guard(RunKey.generate())) as (a,):
            await a.join()
            with pytest.raises(RendezvousKeyError, match="was sealed with a run key, and this agent was given none"):
                async with _agents(etcd_server.endpoint, s, ["k"], rendezvous_guard(None)):
                    pass
            key = s.run_prefix + "nodes/k2"
            async with _stranger(etcd_server.endpoint) as store:
                await store.put_json(key, NodeInfo("k2", "127.0.0.1", 2).to_json())
                await _until(lambda: _logged(caplog, "node k2's registration at") >= 1, "k2 refused")
                await store.delete(key)
            assert not a.generation.includes("k2") and "k2" not in a.generation.waiting

    asyncio.run(main())


def test_without_any_key_nothing_is_sealed_and_everything_works_as_before(etcd_server, run_id):
    async def main() -> None:
        s = _settings(run_id, 2, 3, last_call_timeout=0.2)
        async with _agents(etcd_server.endpoint, s, ["a", "b"], rendezvous_guard(None)) as (a, b):
            gen = (await asyncio.gather(a.join(), b.join()))[0]
            await a.publish_bootstrap(gen, "127.0.0.1", 29400)
            assert await b.wait_bootstrap(gen, 10) == ("127.0.0.1", 29400)
            await b.request_restart(gen, "test")
            await _until(lambda: a.generation.number > gen.number, "a saw the restart")
            again = (await asyncio.gather(a.join(), b.join()))[0]
            assert again.number == gen.number + 1 and sorted(again.member_ids) == ["a", "b"]
            async with _stranger(etcd_server.endpoint) as store:      # a hand-written registration still counts
                await store.put_json(s.run_prefix + "nodes/h", NodeInfo("h", "127.0.0.1", 2).to_json())
                await _until(lambda: a.generation.waiting == ("h",), "h waiting")
                await store.delete(s.run_prefix + "nodes/h")
                for rest in ("generation", "leader", "nodes/a", "bootstrap/0"):
                    doc, _rev = await store.get_json(s.run_prefix + rest)
                    assert doc is not None and MAC_FIELD not in doc, rest
            await a.close("done")
            async with _stranger(etcd_server.endpoint) as store:
                doc, _rev = await store.get_json(s.run_prefix + "closed")
                assert doc["reason"] == "done" and MAC_FIELD not in doc

    asyncio.run(main())


# --- readers outside the rendezvous ---------------------------------------------------------------------------
def test_state_is_never_streamed_to_an_address_from_an_unsealed_registration(etcd_server, run_id):
    """A spare node's address comes from its registration (``nodes/<id>``): a participant checks a plan's joiner
    address against it before streaming a rank's state, and one without the run's MAC is no registration."""
    import types

    from tpassrun.records import Keys, Phase, SlotRef, SwapKind, SwapPlan, provenance
    from tpassrun.swapper import Swapper
    from tpassrun.swapper.agentport import AgentPort, SwapSettings

    run_key = RunKey.generate()
    prefix = f"/tpassrun/v1/{run_id}/"
    keys = Keys(prefix)
    gen = Generation(number=0, state=GenState.ACTIVE, members=(Member("n0", 0, "127.0.0.1", 1, 0),),
                     spare_nodes=("s",), world_size=1)
    plan = SwapPlan(id="s-1", kind=SwapKind.PLANNED, generation=0, leaver=SlotRef("n0", 0, 0),
                    joiner=SlotRef("s", 0, 0), donor=None, phase=Phase.SEND, reason="t", nodes=("n0", "s"),
                    joiner_addr=("10.9.9.9", 4000), secret="ab" * 32)

    async def nothing(*_a) -> None:
        return None

    async def refusal(store: EtcdStore, registration: dict) -> str | None:
        await store.put_json(keys.node("s"), registration)
        rdzv = types.SimpleNamespace(key=lambda *parts: prefix + "/".join(parts), store=store, is_leader=False,
                                     generation=gen)
        port = AgentPort(node_id="n0", addr="127.0.0.1", settings=SwapSettings(1, 1), events=None,  # type: ignore
                         rdzv=rdzv, slots=None, generation=lambda: gen, spawned_generation=lambda: 0,  # type: ignore
                         master=lambda: ("", 0), set_generation=lambda g: None, spawn_spare=nothing,
                         publish_status=nothing, post=lambda e: None)
        swapper = Swapper(port)
        swapper.phases.transfers_seen.add((plan.id, plan.attempt))
        return await swapper.phases.refuse_destination(plan)

    async def main() -> tuple[str | None, str | None]:
        unregister = provenance.register(prefix, run_key)
        try:
            async with _stranger(etcd_server.endpoint) as store:
                info = NodeInfo("s", "10.9.9.9", 1).to_json()
                forged = await refusal(store, info)
                genuine = await refusal(store, seal(keys.node("s"), info, run_key))
                await store.delete(keys.node("s"))
                return forged, genuine
        finally:
            unregister()

    forged, genuine = asyncio.run(main())
    assert forged is not None and "is not the address of node 's' (None)" in forged
    # past the address check with the sealed one (then refused for having no spare slot in this bare setup)
    assert genuine is not None and "not a spare" in genuine


# --- real agents ----------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_agents_given_different_run_keys_end_with_one_line(tmp_path, etcd_server, run_id):
    """Two real ``tpassrun`` agents of one run, each with its own key: the one that comes to the other's run stops
    with one line and exit code 1 instead of waiting for its join timeout; the first waits on for its peers."""
    import secrets

    from faults import Job

    from tpassrun.records.provenance import RUN_KEY_ENV

    def agent(name: str) -> Job:
        return Job.agent(str(tmp_path / name), str(tmp_path / "train"), endpoint=etcd_server.endpoint, run_id=run_id,
                         nnodes="2", nproc=1, env={RUN_KEY_ENV: secrets.token_hex(32)})

    async def leader_elected() -> None:
        async with _stranger(etcd_server.endpoint) as store:
            async def elected() -> bool:
                doc, _rev = await store.get_json(f"/tpassrun/v1/{run_id}/leader")
                return doc is not None and MAC_FIELD in doc
            await _until(elected, "the first agent leads", timeout=120)

    first, second = agent("a").start(), agent("b")
    try:
        asyncio.run(leader_elected())
        assert second.start().wait(120) == 1, second.log()[-3000:]
        first.assert_running("the second agent's error")
    finally:
        first.kill()
        second.kill()
    log = second.log()
    assert log.count("sealed with another run key") == 1, log[-3000:]      # the error, not a warning too
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("tpassrun: error: node "), log[-3000:]
    assert "leader record was sealed with another run key" in errors[0] and "run_key_file" in errors[0]
    assert "Traceback" not in log
