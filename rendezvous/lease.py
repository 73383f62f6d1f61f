"""When this node's etcd lease is surely alive: the fencing rule, pure (the keepalive in :mod:`.etcd_io` feeds
it acknowledgements and asks it what to do; the clock is the caller's monotonic one).

etcd expires a lease ``ttl`` seconds after the last refresh it *received*. We only know when we *sent* the
refresh it acknowledged, which is earlier, so ``sent + ttl`` (the reply's TTL, to be exact) is a lower bound of
etcd's expiry: until then nobody can have seen our keys vanish, so nobody can have been handed our ranks. Past
it they may have been. So a node fences itself (stops its workers) only when that bound is ``margin`` away:
killing the workers takes time, while the others need only a watch event to learn that the lease is gone.
Nothing else counts: not how long etcd has been unreachable, not half the TTL, not a fixed number of seconds.
An etcd outage or a partition of the node shorter than ``ttl - margin - refresh_every`` therefore costs nothing.

What makes that budget large is refreshing often (``refresh_every``: the newest acknowledgement is at most that
old when an outage starts), and retrying at once when etcd answers again (the connection probes every half
second, :mod:`.etcd_link`; the keepalive is woken when it is back and its first refresh's reply is etcd's own
count of the lease: a TTL of 0 means it expired, and it is re-granted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LeaseClock:
    """The lease as this node knows it: ``deadline`` is the earliest time etcd may expire it (monotonic)."""

    ttl: float
    deadline: float = math.inf   # before the first grant there is nothing to lose
    epoch: int = 0               # bumped when a refresh found the lease expired (it is then re-granted)

    @property
    def margin(self) -> float:
        """Kept before the deadline: the time to stop our workers before anyone can act on our expiry."""
        return min(1.0, self.ttl / 6)

    @property
    def refresh_every(self) -> float:
        """The keepalive period. ttl/10, not etcd clientv3's ttl/3: an outage shorter than the lease is survived
        only if the last acknowledged refresh is recent when it starts (a 10 s lease survives ~8 s, not ~5.7)."""
        return max(0.2, self.ttl / 10)

    @property
    def request_timeout(self) -> float:
        """How long one refresh may go unanswered before the connection is presumed dead and replaced (a
        partition drops packets: nothing ever fails). Longer than a loaded etcd's answer, far shorter than the
        budget, so the reconnect probes find the healed link in time."""
        return min(3.0, max(1.0, self.ttl / 5))

    def acknowledged(self, sent: float, ttl_left: float) -> bool:
        """etcd acknowledged a refresh we sent at ``sent`` with ``ttl_left`` seconds of lease (its reply). Returns
        False when the reply says the lease is gone (``ttl_left <= 0``): the caller calls :meth:`expired`."""
        if ttl_left <= 0:
            return False
        self.deadline = max(self.deadline, sent + ttl_left)   # a late reply to an older refresh moves nothing back
        return True

    def expired(self) -> None:
        """A refresh found the lease expired: a new epoch, not sure of anything until :meth:`granted`."""
        self.epoch += 1
        self.deadline = -math.inf

    def granted(self, sent: float, ttl: float) -> None:
        """A new lease, asked for at ``sent`` (the first, or one re-granted after an expiry)."""
        self.deadline = sent + ttl

    def fence_at(self) -> float:
        """When the node must stop its workers if no refresh is acknowledged before."""
        return self.deadline - self.margin

    def sure(self, now: float) -> bool:
        """Whether the lease is surely alive now (no fencing needed, decisions under it are safe)."""
        return now < self.fence_at()

    def next_refresh(self, now: float, last_attempt: float, failed: bool) -> float:
        """Seconds to wait before the next refresh. After a refusal (not an outage: those are waited out by the
        connection) retry soon while the lease is within two periods of its fencing time."""
        if failed and self.fence_at() - now < 2 * self.refresh_every:
            return min(0.25, self.refresh_every)
        return max(0.0, last_attempt + self.refresh_every - now)
