"""Issue 11: an etcd outage or a partition shorter than the lease costs nothing (one real etcd, agents in this
process). The node keeps its lease (same id, never found expired), never hears that it may have lost it (so its
agent does not fence), and nobody sees it lost. The rule itself is tested pure in ``test_lease_rule.py``."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from tpassrun.rendezvous import EtcdConfig, EtcdRendezvous, EventKind, NodeInfo, RendezvousSettings

TTL = 10   # the default lease; the outages below are the ones that fenced a node with it


@contextlib.asynccontextmanager
async def two_nodes(endpoints: dict[str, str], run_id: str):
    s = RendezvousSettings(run_id=run_id, min_nodes=2, max_nodes=2, last_call_timeout=0.3, lease_ttl=TTL,
                           join_timeout=20)
    async with contextlib.AsyncExitStack() as stack:
        nodes = [await stack.enter_async_context(EtcdRendezvous(
            EtcdConfig.from_endpoint(endpoint, {"read_timeout": "5", "reconnect_timeout": "30"}), s,
            NodeInfo(node_id, "127.0.0.1", 2))) for node_id, endpoint in endpoints.items()]
        await asyncio.wait_for(asyncio.gather(*(n.join() for n in nodes)), 20)
        yield nodes


async def kinds_seen(events, into: list[EventKind]) -> None:
    async for ev in events:
        into.append(ev.kind)


async def just_before_a_refresh(node: EtcdRendezvous) -> None:
    """The worst instant for an outage to start: the last acknowledged refresh is as old as it gets."""
    sent = node.store.keepalives
    while node.store.keepalives == sent:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.9 * node.store.lease_clock.refresh_every)


async def ride_out(node: EtcdRendezvous, outage) -> tuple[str | None, float]:
    """Run ``outage`` (blocking, in a thread) while watching ``node``'s lease; then wait until a refresh is
    acknowledged. ``(lease_lost's reason if it fired, seconds from the end of the outage to that refresh)``."""
    lost = asyncio.create_task(node.lease_lost())
    try:
        await asyncio.to_thread(outage)
        back = time.monotonic()
        acked = node.store.keepalives
        while node.store.keepalives == acked or not node.store.lease_sure():
            if lost.done():
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)
        return (lost.result() if lost.done() else None), time.monotonic() - back
    finally:
        lost.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await lost


@pytest.mark.timeout(60)
def test_a_partition_shorter_than_the_lease_costs_nothing(etcd_server, run_id):
    """b is cut off from etcd (a black hole: nothing refused, nothing answered) for 6 s with a 10 s lease, from
    just before a refresh: 4.5-6 s partitions fenced a node in the chaos bench."""
    from faults import EtcdProxy

    async def main():
        proxy = EtcdProxy(etcd_server.endpoint)
        try:
            async with two_nodes({"a": etcd_server.endpoint, "b": proxy.endpoint}, run_id) as (a, b):
                lease, seen = b.store.lease_id, []
                follower = asyncio.create_task(kinds_seen(a.events(), seen))
                await just_before_a_refresh(b)
                proxy.cut()
                reason, refreshed_in = await ride_out(b, lambda: (time.sleep(6.0), proxy.heal()))
                assert reason is None, f"b fenced itself over a 6 s partition: {reason}"
                assert b.store.lease_id == lease and b.store.lease_epoch == 0
                assert b.store.connection.outages == 1
                assert refreshed_in < 3.0, "the lease was not refreshed soon after the partition healed"
                follower.cancel()
                assert EventKind.NODE_LOST not in seen
        finally:
            proxy.close()
    asyncio.run(main())


@pytest.mark.timeout(90)
def test_an_etcd_restart_shorter_than_the_lease_costs_nothing(fresh_etcd, run_id):
    """etcd SIGKILLed, down 3 s, started again (the CI case: 5.6 s in all under load, with a 10 s lease)."""
    from faults import kill_etcd, start_etcd_again

    def restart() -> None:
        kill_etcd(fresh_etcd)
        time.sleep(3.0)
        start_etcd_again(fresh_etcd, timeout=30)

    async def main():
        async with two_nodes({"a": fresh_etcd.endpoint, "b": fresh_etcd.endpoint}, run_id) as (a, b):
            leases = [a.store.lease_id, b.store.lease_id]
            lost_a = asyncio.create_task(a.lease_lost())
            await just_before_a_refresh(b)
            reason, _ = await ride_out(b, restart)
            assert reason is None and not lost_a.done(), "a node fenced itself over an etcd restart"
            lost_a.cancel()
            assert [a.store.lease_id, b.store.lease_id] == leases
            assert a.store.lease_epoch == b.store.lease_epoch == 0
    asyncio.run(main())


def test_every_etcd_client_has_a_grpc_subchannel_of_its_own():
    """gRPC shares one subchannel per target between channels by default, with its connection attempt: each fresh
    reconnect probe then waited on the connect that began inside a partition (its SYN retransmitted 1, 3, 7, 15 s
    apart), and a healed link was found 6-13 s late. Each client made by the connection asks for its own."""
    from tpassrun.rendezvous.etcd_link import EtcdConnection

    for conf in ({}, {"cacert": __file__}):
        conn = EtcdConnection(EtcdConfig.from_endpoint("127.0.0.1:2379", conf))
        first, second = conn._new_client(), conn._new_client()
        assert first is not second
        assert all(dict(c._options).get("grpc.use_local_subchannel_pool") == 1 for c in (first, second))
