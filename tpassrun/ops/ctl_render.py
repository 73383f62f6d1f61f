"""``tpassctl status``'s tables and the run list, fitted to 80 columns (or the terminal's width).

Nothing a command takes is cut: ids (taints, swaps, runs) and node ids fold onto a second line instead of ending in
an ellipsis; a node is shown by a name unique in the run, as the launcher's console does (its host name, else
``host-pid``: tpassrun/ops/names.py); free text (reasons, states) wraps.
"""

from __future__ import annotations

import time
from typing import Any

from tpassrun.ops.cleantext import clean
from tpassrun.ops.console import cost_line
from tpassrun.ops.names import node_names
from tpassrun.ops.tally import HOW_TO_KNOW, RunTally
from tpassrun.ops.tui import duration_text, step_info
from tpassrun.records import RUN_KEY_ENV, RUN_KEY_FILE_CONF


def run_list_lines(r: Any, now: float) -> list[str]:
    """One run of the run list, in two lines that fit 80 columns: what to pick it by (its id, never cut) and when
    it started; then what it runs, its slots, its etcd and its launcher's pid (pure)."""
    day = time.strftime("%Y-%m-%d", time.localtime(r.started))
    started = time.strftime("%H:%M:%S" if day == time.strftime("%Y-%m-%d", time.localtime(now)) else "%Y-%m-%d %H:%M",
                            time.localtime(r.started))
    return [f"  {r.run_id}  started {started} (up {duration_text(now - r.started)})",
            f"      {r.script or '?'}  {r.nproc}+{r.spares} slots  etcd {r.endpoint}  pid {r.pid}"]


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


MAX_WHOLE = 28     # a column is kept whole when its cells are at most this wide (else: folded)


def render_status(snap: Any, costs: RunTally | None = None) -> None:
    """``tpassctl status``'s tables of a ``ctl.RunSnapshot``; ``costs``: the run's tally from its event log (the
    exit summary's line), when the run is on this machine."""
    from rich.console import Console
    from rich.table import Column, Table
    from rich.text import Text

    def new_table(title: str, *headers: str, whole: tuple[str, ...] = ("id", "node")) -> Table:
        # "fold", never "ellipsis": a cut id (a taint's, a node's) is of no use to the command that takes it
        table = Table(*(Column(h, overflow="fold") for h in headers), title=title, title_justify="left")
        kept[id(table)] = frozenset(whole)
        return table

    kept: dict[int, frozenset[str]] = {}

    def show(table: Table) -> None:
        # what a command takes or a glance looks for stays on one line; free text (reasons) wraps around it
        for col in table.columns:
            if col.header in kept[id(table)]:
                col.no_wrap = max([0] + [len(str(c)) for c in col._cells]) <= MAX_WHOLE   # else: folded
        console.print(table)

    gen = snap.generation
    names = node_names([*snap.status, *snap.nodes, *snap.health, *(t.node_id for t in snap.taints.values()),
                        *(gen.member_ids if gen else ())])

    def nd(node_id: Any) -> str:
        return names.get(str(node_id), str(node_id))

    def row(table: Table, *cells: Any) -> None:
        # User text (node ids, taint reasons, health reasons) is never parsed as rich markup: "[/]" stays literal.
        table.add_row(*(Text("-" if c is None else clean(c)) for c in cells))

    console = Console()
    head = Text.assemble("run ", (clean(snap.run_id), "bold"))
    if gen is not None:
        head.append(f"  generation {gen.number} ")
        head.append(gen.state.value, style="bold")
        head.append(clean(f"  world size {gen.world_size}" + (f"  ({gen.reason})" if gen.reason else "")))
    else:
        head.append("  no generation formed yet")
    console.print(head)
    where, pace = step_info(list(snap.workers()))
    console.print(Text(clean(f"{where}" + (f"  ({pace})" if pace else ""))))
    console.print(Text(clean(f"leader: {snap.leader or '-'}" + (f"   closed: {snap.closed.reason}" if snap.closed
                                                                     else ""))))
    if costs is not None:
        console.print(Text(clean(f"costs: {cost_line(costs, costs.code)}")))
        if not costs.known:
            console.print(Text(clean(f"unknown: {HOW_TO_KNOW}")))
    if snap.provenance == "unverified":
        console.print(Text(f"unverified: the job seals its records with a run key and tpassctl was given none "
                           f"(--rdzv-conf {RUN_KEY_FILE_CONF}=PATH or ${RUN_KEY_ENV})", style="yellow"))

    members = new_table("nodes", "node", "group rank", "addr", "nproc", "ranks", "role")
    if gen is not None:
        for m in gen.members:
            role = "lost" if m.node_id in gen.lost else "member"
            row(members, m.node_id, m.group_rank, m.addr, m.nproc, f"{m.rank_offset}-{m.rank_offset + m.nproc - 1}",
                role)
        for node_id in gen.spare_nodes:
            info = snap.nodes.get(node_id)
            row(members, node_id, "-", info.addr if info else "?", info.nproc if info else "?", "-", "spare node")
        for node_id in gen.waiting:
            info = snap.nodes.get(node_id)
            row(members, node_id, "-", info.addr if info else "?", "-", "-", "waiting")
    show(members)

    workers = new_table("workers", "node", "slot", "rank", "local", "pid", "state", "step", "spare",
                        whole=("node", "state"))
    for w in snap.workers():
        row(workers, nd(w["node_id"]), *(w.get(k, "-") for k in ("slot", "rank", "local_rank", "pid", "state", "step")),
            "yes" if w.get("spare") else "")
    show(workers)
    mirrored = [w for w in snap.workers() if w.get("shard_held")]
    if mirrored:
        mirror = new_table("sharded state mirror (host memory)", "node", "rank", "local copies", "per refresh",
                           "every", "mirrored step", "sent")
        for w in mirrored:
            row(mirror, nd(w["node_id"]), w.get("rank", "-"), _size(w["shard_held"]), _size(w.get("shard_bytes") or 0),
                f"{w['shard_interval']} step(s)" if w.get("shard_interval") else "(measuring)",
                w.get("shard_mirrored") if w.get("shard_mirrored") is not None else "-", _size(w.get("shard_sent") or 0))
        for node_id, status in sorted(snap.status.items()):
            if status.mirror_held:
                row(mirror, nd(node_id), "(buddy copies)", _size(status.mirror_held), "", "", "", "")
        show(mirror)

    if snap.taints:
        taints = new_table("taints", "id", "node", "slot", "rank", "effect", "reason", "state")
        for tid, t in sorted(snap.taints.items()):
            row(taints, tid, nd(t.node_id), t.slot, t.rank, t.effect.value, t.reason, t.state)
        show(taints)
    if snap.swaps:
        swaps = new_table("swaps", "id", "phase", "reason")
        for sid, s in sorted(snap.swaps.items()):
            row(swaps, sid, s.phase.value, s.reason)
        show(swaps)
    if snap.health:
        health = new_table("health", "node", "device", "status", "effect", "reason")
        for node_id, record in sorted(snap.health.items()):
            verdicts = record.verdicts
            if not verdicts:
                row(health, nd(node_id), "-", "no verdicts", "", "")
            for v in verdicts:
                row(health, nd(node_id), v.get("device"), v.get("status"), v.get("effect"), v.get("reason", ""))
        show(health)


