"""What a node is called on screen: a name unique in the run, as short as that allows (pure).

A node id is ``host-pid-rand`` (tpassrun/rendezvous). An operator calls a machine by its host name, so that is the
name while it names one node of the run; when hosts share a name (several agents on one machine, two clusters'
``node01``) the agent's pid is added (``vm-23353``), and the whole id is the last resort. ``tpassctl --node``
accepts each of these forms (tpassrun/ops/ctl.py).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

#: event fields that hold node ids (one, or a list of them)
NODE_FIELDS = ("node", "lost_node", "pool_node", "joined", "target_node", "buddy", "members", "nodes", "to", "also",
               "silent", "waiting", "spare_nodes")


def split_id(node_id: str) -> tuple[str, str | None]:
    """``host-pid-rand`` -> (host, pid); any other text -> (text, None)."""
    parts = node_id.rsplit("-", 2)
    return (parts[0], parts[1]) if len(parts) == 3 and parts[1].isdigit() else (node_id, None)


def short_host(host: str) -> str:
    """``gpu-a17.cluster.example.com`` -> ``gpu-a17``."""
    return host.split(".", 1)[0] or host


def node_names(node_ids: Iterable[Any]) -> dict[str, str]:
    """Each id's name among ``node_ids``: its short host, else its host, else ``host-pid``, else the id, whichever
    is the first to name that node alone."""
    ids = sorted({str(n) for n in node_ids if n is not None})
    forms: dict[str, list[str]] = {}
    for n in ids:
        host, pid = split_id(n)
        forms[n] = [short_host(host), host] + ([f"{host}-{pid}"] if pid is not None else []) + [n]
    taken: dict[str, int] = {}
    for n in ids:
        for name in dict.fromkeys(forms[n]):
            taken[name] = taken.get(name, 0) + 1
    return {n: next((f for f in forms[n] if taken[f] == 1), n) for n in ids}


class NodeNames:
    """The names of the nodes a stream of events has named so far (the console's, ``tpassctl events``'): a
    second node on a host already seen gives both ``host-pid`` names from then on."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._names: dict[str, str] = {}

    def see(self, ev: Mapping[str, Any]) -> None:
        new = set()
        for key in NODE_FIELDS:
            value = ev.get(key)
            for v in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(v, str) and v and v not in self._ids:
                    new.add(v)
        if new:
            self._ids |= new
            self._names = node_names(self._ids)

    def __call__(self, node: Any) -> str:
        text = str(node or "?")
        if text not in self._names:
            self._ids.add(text)
            self._names = node_names(self._ids)
        return self._names.get(text, text)
