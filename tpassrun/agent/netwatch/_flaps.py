"""Pure: flaps told apart from outages, and said in one line (no clock, no I/O).

A flap: the link of the node's own interface goes down and comes back (its operstate, or its etcd connection lost
and restored); if nothing of the job broke meanwhile (no fence, no lease lost), it was *ridden out*.
"""

from __future__ import annotations

from dataclasses import dataclass

ECHO_S = 30.0     # an etcd connection lost this soon after the interface came back: the same outage, seen late


@dataclass(frozen=True)
class Flap:
    """A link outage that ended: how long, how it was seen, and whether the job rode it out."""

    seconds: float
    seen_by: str               # "interface" (its operstate) | "etcd" (its connection lost and restored)
    ridden_out: bool


@dataclass
class FlapBook:
    """Bookkeeping of this node's link outages. Feed it what the agent sees; it returns each outage once over.

    Two witnesses: the interface's operstate (exact, when the fault is on this host's own link) and the etcd
    connection (lost / restored: a fault anywhere on the path). One outage seen by both is one flap, timed by the
    interface when it saw it. A fence or a lost lease meanwhile means it was not ridden out."""

    _down_since: float | None = None
    _seen_by: str = ""
    _etcd_since: float | None = None
    _broken: bool = False
    _iface_ended: float | None = None     # when the interface last came back (its etcd echo is the same outage)
    _etcd_ended: float | None = None      # when an outage only etcd saw last ended

    @property
    def down(self) -> bool:
        return self._down_since is not None or self._etcd_since is not None

    def interface(self, up: bool, now: float, *, flapped: bool = False) -> Flap | None:
        """The interface's state now; ``flapped``: it went down and up again since the last sample."""
        if not up:
            if self._down_since is None or self._seen_by != "interface":
                self._down_since, self._seen_by = now, "interface"
            return None
        if self._down_since is not None and self._seen_by == "interface":
            return self._end(now - self._down_since, "interface", now)
        recent = self._etcd_ended is not None and now - self._etcd_ended < ECHO_S
        if flapped and self._etcd_since is None and not recent:
            return self._end(0.0, "interface", now)
        return None

    def etcd_lost(self, now: float) -> None:
        if self._etcd_since is None:
            self._etcd_since = now
        echo = self._iface_ended is not None and now - self._iface_ended < ECHO_S
        if self._down_since is None and not echo:
            self._down_since, self._seen_by = now, "etcd"

    def etcd_restored(self, now: float, lasted: float) -> Flap | None:
        self._etcd_since = None
        if self._down_since is not None and self._seen_by == "etcd":
            return self._end(max(lasted, now - self._down_since), "etcd", now)
        return None

    def broken(self) -> None:
        """A fence or a lost lease: the outage in progress (if any) was not ridden out."""
        self._broken = True

    def _end(self, seconds: float, seen_by: str, now: float) -> Flap:
        flap = Flap(round(seconds, 2), seen_by, not self._broken)
        if seen_by == "interface":
            self._iface_ended = now
        else:
            self._etcd_ended = now
        self._down_since, self._seen_by, self._broken = None, "", False
        if self._etcd_since is not None and seen_by == "interface":
            self._etcd_since = None     # the etcd side of the same outage: said once, here
        return flap


def flap_line(node: str, flap: Flap) -> str:
    how = "" if flap.seen_by == "interface" else " (its etcd connection)"
    if flap.ridden_out:
        return f"link to node {node} lost for {flap.seconds:.1f} s{how}, ridden out"
    return f"link to node {node} lost for {flap.seconds:.1f} s{how}; the node was fenced"
