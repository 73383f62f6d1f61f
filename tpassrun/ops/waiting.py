"""What the run is waiting for, and since when, for the live view (``tpassrun --tui``): an event listener.

The console says a wait every few seconds (``waiting for nodes (10.00 s)``, ``waiting for pool P for 15.00 s of
--pool-wait 60.00 s``); the panel shows the newest one as an alert with its age, counted on every redraw, until
what it waited for came (a claim, a generation, a recovery) or was given up. Pure but for the clock it is given.
"""

from __future__ import annotations

from typing import Any, Mapping

#: events that end a wait (what it waited for came, or it was given up)
_ENDS = frozenset({"pool_gave_up", "generation_joined", "swap_resumed", "ranks_recovered", "node_recovered",
                   "training_resumed", "agent_exit"})


class WaitNote:
    """Feed it events (``EventLog.add_listener``); :meth:`doc` is the live view's ``waiting`` field."""

    def __init__(self) -> None:
        self.what: str = ""
        self.since: float = 0.0          # wall time the wait began

    def __call__(self, ev: Mapping[str, Any]) -> None:
        name, now = ev.get("event"), float(ev.get("time") or 0.0)
        if name == "pool_waiting":
            lost = str(ev.get("lost_node"))
            need = lost if lost.startswith("rank ") else f"node {lost} lost"     # ids whole, as the view's rows
            limit = ev.get("wait_limit")
            self.what = (f"{need}: pool {ev.get('pool')}" + (f" (--pool-wait {float(limit):g} s)" if limit else "")
                         + f": {ev.get('reason')}")
            self.since = now - float(ev.get("waited") or 0.0)
        elif name == "waiting_for_nodes":
            self.what = f"nodes: {ev.get('joined')} of {ev.get('needed')} joined"
            self.since = now - float(ev.get("seconds") or 0.0)
        elif name == "pool_claimed":
            self.what = (f"pool node {ev.get('pool_node')} claimed from pool {ev.get('pool')}: "
                         "its spares start (a joiner from cold)")
            self.since = now - float(ev.get("waited") or 0.0)
        elif name in _ENDS:
            self.what = ""

    def doc(self) -> dict[str, Any] | None:
        return {"what": self.what, "since": self.since} if self.what else None
