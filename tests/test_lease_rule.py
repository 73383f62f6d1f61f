"""The fencing rule (rendezvous.lease), pure: the clock is a number we pass, etcd's replies are arguments.

A node fences itself only when etcd may really have expired its lease: the send time of the last acknowledged
refresh + the TTL etcd replied, minus a margin. An outage shorter than the lease's budget costs nothing."""

from __future__ import annotations

import math

import pytest

from tpassrun.rendezvous.lease import LeaseClock

pytestmark = pytest.mark.timeout(10)


def lease_at(t: float, ttl: float = 10.0) -> LeaseClock:
    lease = LeaseClock(ttl)
    lease.granted(sent=t, ttl=ttl)
    return lease


def keepalive(lease: LeaseClock, start: float, end: float, down: tuple[float, float] = (math.inf, math.inf),
              rtt: float = 0.05, reconnect: float = 0.5) -> float | None:
    """Drive a keepalive from ``start`` to ``end`` (0.05 s ticks) with etcd unreachable during ``down``: a
    refresh every ``refresh_every`` while etcd answers, the first at once when the connection is back
    (``reconnect`` after the outage: it probes every 0.5 s). Returns when the node fenced, or None."""
    back = down[1] + reconnect
    t, last = start, start
    while t < end:
        if not lease.sure(t):
            return t
        reachable = not down[0] <= t < back
        due = t - last >= lease.refresh_every or (t >= back and last < back)
        if reachable and due:
            lease.acknowledged(sent=t, ttl_left=lease.ttl)
            last = t
        t = round(t + rtt, 6)
    return None


def test_fencing_waits_for_the_lease_deadline_minus_a_margin_not_half_the_ttl_or_the_outage():
    lease = lease_at(100.0)
    assert lease.margin == 1.0 and lease.fence_at() == 109.0
    assert lease.sure(104.9) and lease.sure(108.99)       # half the TTL gone, etcd silent for 8.99 s: still sure
    assert not lease.sure(109.0)


def test_the_deadline_counts_from_the_send_time_of_the_acknowledged_attempt():
    """A refresh retried through a reconnect counts from when the attempt etcd answered was sent (counting from
    the first attempt left the deadline behind, and a node fenced just after etcd had answered)."""
    lease = lease_at(0.0)
    assert lease.acknowledged(sent=7.5, ttl_left=10)
    assert lease.fence_at() == 16.5 and lease.sure(16.4)


def test_a_late_reply_to_an_older_refresh_moves_nothing_back():
    lease = lease_at(0.0)
    lease.acknowledged(sent=5.0, ttl_left=10)
    lease.acknowledged(sent=2.0, ttl_left=10)
    assert lease.deadline == 15.0


def test_a_reply_of_ttl_zero_is_an_expired_lease_sure_of_nothing_until_re_granted():
    lease = lease_at(0.0)
    assert not lease.acknowledged(sent=30.0, ttl_left=0)
    lease.expired()
    assert lease.epoch == 1 and not lease.sure(30.1)
    lease.granted(sent=30.2, ttl=10)
    assert lease.sure(30.3) and lease.fence_at() == pytest.approx(39.2)


@pytest.mark.parametrize("ttl, margin, every", [(10, 1.0, 1.0), (30, 1.0, 3.0), (2, 1 / 3, 0.2), (1, 1 / 6, 0.2)])
def test_margin_and_period_scale_with_the_ttl(ttl, margin, every):
    lease = LeaseClock(ttl)
    assert lease.margin == pytest.approx(margin) and lease.refresh_every == pytest.approx(every)
    assert 1.0 <= lease.request_timeout <= 3.0


@pytest.mark.parametrize("outage", [3.0, 4.5, 5.6, 6.0, 7.0])
@pytest.mark.parametrize("phase", [0.0, 0.35, 0.7, 0.95])
def test_an_outage_shorter_than_the_budget_never_fences_whatever_its_phase(outage, phase):
    """The chaos and CI cases: 4.5-6 s partitions and a 5.6 s etcd restart with a 10 s lease fenced a node with
    a ttl/3 keepalive. Now any outage up to ttl - margin - refresh_every - reconnect (~7.5 s) costs nothing."""
    lease = lease_at(0.0)
    start = 20.0 + phase * lease.refresh_every
    assert keepalive(lease, 0.0, 60.0, down=(start, start + outage)) is None


def test_an_outage_longer_than_the_lease_fences_before_etcd_can_expire_it():
    lease = lease_at(0.0)
    fenced = keepalive(lease, 0.0, 60.0, down=(20.0, 35.0))
    assert fenced is not None and fenced < lease.deadline <= 20.0 + lease.ttl
    assert lease.deadline - fenced >= lease.margin - 1e-9


def test_after_a_fence_the_lease_is_sure_again_once_etcd_acknowledges_it():
    """What the agent waits for before it joins again (a fenced node re-fenced at every new generation while its
    lease still looked lost)."""
    lease = lease_at(0.0)
    fenced = keepalive(lease, 0.0, 60.0, down=(20.0, 35.0))
    assert fenced is not None and not lease.sure(35.0)
    lease.acknowledged(sent=35.1, ttl_left=10)     # etcd was restarted: it kept the lease (a new TTL)
    assert lease.sure(35.2) and keepalive(lease, 35.2, 80.0) is None


def test_next_refresh_is_periodic_and_retries_soon_near_the_fencing_time():
    lease = lease_at(0.0)
    assert lease.next_refresh(now=0.4, last_attempt=0.0, failed=False) == pytest.approx(0.6)
    assert lease.next_refresh(now=2.0, last_attempt=0.0, failed=False) == 0.0
    assert lease.next_refresh(now=1.0, last_attempt=1.0, failed=True) == pytest.approx(1.0)  # far from fencing
    assert lease.next_refresh(now=7.5, last_attempt=7.5, failed=True) == 0.25                 # close to it
