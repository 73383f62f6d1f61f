"""The rich status view: a dashboard of one run, drawn from the document ``tpassctl status --json`` prints.

Everything that decides *what* to show is a pure function of that document (and, for ages, an injected
``now``): :func:`summary_line`, :func:`taint_state`, :func:`swap_timeline` and :func:`render_status`, which
returns a rich renderable and writes nothing. Only :func:`watch` has effects: it polls ``fetch()`` and either
redraws a ``Live`` view (a terminal) or prints one summary line per change (CI logs, pipes), so a log never
fills with redrawn frames.

The document is read defensively: every field may be missing or ``null`` (a run that is still forming, an
agent that has not published yet, an older agent), and the view says so instead of raising.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

__all__ = ["TaintState", "TimelineStep", "render_status", "summary_line", "swap_timeline", "taint_state", "watch"]

# The planner's phase order (tpassrun/swap.py); repeated here so the view never imports the agent side.
PHASES = ("pause", "boundary", "transfer", "send", "reform", "done")
TERMINAL_PHASES = ("done", "aborted")

WORKER_STYLES = {"running": "green", "spare": "cyan", "leaving": "yellow", "done": "blue", "dead": "bold red",
                 "quarantined": "red", "idle": "dim"}
GENERATION_STYLES = {"active": "bold green", "forming": "bold yellow", "closed": "bold red"}
HEALTH_STYLES = {"healthy": "green", "unknown": "yellow", "degraded": "dark_orange", "failing": "bold red"}


class TaintState(str, enum.Enum):
    """Where a taint is in its life, as the swap coordinator records it in ``taints/<id>``."""

    PENDING = "pending"          # written, not yet looked at by the leader
    WAITING = "waiting"          # no spare free: the swap waits for one
    MIGRATING = "migrating"      # a swap plan is moving the rank
    QUARANTINED = "quarantined"  # the swap is done; the slot stays out until untainted
    RESTART = "restart"          # no swap possible: the group restarts without the slot
    REJECTED = "rejected"        # nothing to move (the rank is not running)


TAINT_STYLES = {TaintState.PENDING: "yellow", TaintState.WAITING: "bold yellow", TaintState.MIGRATING: "cyan",
                TaintState.QUARANTINED: "red", TaintState.RESTART: "magenta", TaintState.REJECTED: "dim"}


def taint_state(taint: Mapping[str, Any]) -> TaintState:
    """Classify a taint record. The coordinator writes ``state`` as a word (``migrating``, ``quarantined``) or as
    ``"<action>: <reason>"`` for decisions that did not plan a swap, and ``handled_by: "restart"`` on fallback."""
    state = str(taint.get("state") or "")
    if taint.get("handled_by") == "restart" or state.startswith("fallback"):
        return TaintState.RESTART
    for known in (TaintState.QUARANTINED, TaintState.MIGRATING, TaintState.WAITING):
        if state == known.value:
            return known
    if state.startswith("wait"):
        return TaintState.WAITING
    if state.startswith("reject"):
        return TaintState.REJECTED
    return TaintState.PENDING


@dataclass(frozen=True)
class TimelineStep:
    """One phase of a swap as the timeline shows it. ``offset`` is seconds since the swap started."""

    phase: str
    mark: str          # "done" | "current" | "pending" | "skipped" | "aborted"
    offset: float | None = None


def swap_timeline(plan: Mapping[str, Any]) -> list[TimelineStep]:
    """The pause -> ... -> done timeline of a swap plan from its ``history`` of ``[phase, wall_time]``.

    A phase entered more than once (a moved boundary, a retried transfer) shows its *last* entry, so the
    offsets stay in order. A phase the plan jumped over (unplanned swaps go pause -> transfer) is ``skipped``.
    """
    entered: dict[str, float] = {}
    for item in plan.get("history") or ():
        if isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], (int, float)):
            entered[str(item[0])] = float(item[1])
    start = min(entered.values()) if entered else None
    current = str(plan.get("phase") or "")
    reached = PHASES.index(current) if current in PHASES else max(
        (PHASES.index(p) for p in entered if p in PHASES), default=-1)

    steps = []
    for i, phase in enumerate(PHASES):
        when = entered.get(phase)
        offset = None if when is None or start is None else when - start
        if phase == current:
            mark = "done" if phase == "done" else "current"
        elif i < reached or (current == "aborted" and when is not None):
            mark = "done" if when is not None else "skipped"
        else:
            mark = "pending"
        steps.append(TimelineStep(phase, mark, offset))
    if current == "aborted":
        when = entered.get("aborted")
        steps.append(TimelineStep("aborted", "aborted", None if when is None or start is None else when - start))
    return steps


# ---------------------------------------------------------------------------------------------- reading the doc
def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _workers(doc: Mapping[str, Any]) -> list[dict]:
    """Every worker row of every node, with its node id."""
    rows = []
    for node_id, status in sorted(_dict(doc.get("status")).items()):
        for w in _dict(status).get("workers") or ():
            if isinstance(w, dict):
                rows.append({"node_id": node_id, **w})
    return rows


def _is_spare(worker: Mapping[str, Any]) -> bool:
    return bool(worker.get("spare")) or worker.get("state") == "spare"


def _active_swaps(doc: Mapping[str, Any]) -> list[tuple[str, dict]]:
    swaps = sorted(_dict(doc.get("swaps")).items())
    return [(sid, s) for sid, s in swaps if isinstance(s, dict) and s.get("phase") not in TERMINAL_PHASES]


def _node_order(doc: Mapping[str, Any]) -> list[str]:
    """Members in group-rank order, then spare nodes, then anything else that published a status."""
    gen = _dict(doc.get("generation"))
    order = [str(m.get("node_id")) for m in gen.get("members") or () if isinstance(m, dict)]
    order += [str(n) for n in gen.get("spare_nodes") or ()]
    order += sorted(_dict(doc.get("status")))
    return list(dict.fromkeys(order))


def _unhealthy(doc: Mapping[str, Any]) -> list[tuple[str, dict]]:
    out = []
    for node_id, health in sorted(_dict(doc.get("health")).items()):
        for v in _dict(health).get("verdicts") or ():
            if isinstance(v, dict) and v.get("status") not in (None, "healthy"):
                out.append((node_id, v))
    return out


def summary_line(doc: Mapping[str, Any]) -> str:
    """One plain line for logs: ``gen 3 | world 4 | ranks 4 running | spares 1 | swap s-1 reform``."""
    gen = _dict(doc.get("generation"))
    workers = _workers(doc)
    running = sum(1 for w in workers if w.get("state") == "running" and w.get("rank") is not None)
    spares = sum(1 for w in workers if _is_spare(w))
    quarantined = sum(1 for w in workers if w.get("state") == "quarantined")
    world = gen.get("world_size")

    gen_part = f"gen {gen['number']}" if gen.get("number") is not None else "gen -"
    if gen.get("state") not in (None, "active"):
        gen_part += f" {gen['state']}"
    parts = [gen_part, f"world {world if world is not None else '-'}",
             f"ranks {running} running" if world in (None, running) else f"ranks {running}/{world} running",
             f"spares {spares}"]
    if quarantined:
        parts.append(f"quarantined {quarantined}")
    waiting = sum(1 for t in _dict(doc.get("taints")).values() if taint_state(_dict(t)) == TaintState.WAITING)
    if waiting:
        parts.append(f"taints {waiting} waiting")
    unhealthy = _unhealthy(doc)
    if unhealthy:
        parts.append(f"unhealthy {len(unhealthy)}")
    active = _active_swaps(doc)
    parts += [f"swap {sid} {s.get('phase')}" for sid, s in active] or ["no swap"]
    closed = doc.get("closed")
    if closed:
        parts.append(f"closed: {_dict(closed).get('reason', '')}".rstrip(": "))
    return " | ".join(parts)


# ---------------------------------------------------------------------------------------------- rendering
def _text(value: Any, default: str = "-") -> str:
    return default if value is None or value == "" else str(value)


def _styled(value: Any, styles: Mapping[Any, str]) -> Text:
    return Text(_text(value), style=styles.get(value, ""))


def _age(when: Any, now: float | None) -> str:
    if now is None or not isinstance(when, (int, float)):
        return ""
    return f"  (status {max(0.0, now - when):.1f}s old)"


def _header(doc: Mapping[str, Any]) -> Text:
    gen = _dict(doc.get("generation"))
    head = Text.assemble("run ", (_text(doc.get("run_id"), "?"), "bold"))
    if gen:
        state = gen.get("state")
        head.append(f"  generation {_text(gen.get('number'))} ")
        head.append(_text(state), style=GENERATION_STYLES.get(state, "bold"))
        head.append(f"  world size {_text(gen.get('world_size'))}")
    else:
        head.append("  no generation formed yet", style="yellow")
    head.append(f"  leader {_text(doc.get('leader'))}")
    if gen.get("reason"):
        head.append(f"\n{gen['reason']}", style="dim")
    closed = doc.get("closed")
    if closed:
        head.append(f"\nclosed: {_text(_dict(closed).get('reason'), 'yes')}", style="bold red")
    if gen.get("lost"):
        head.append(f"\nlost nodes: {', '.join(map(str, gen['lost']))}", style="red")
    if gen.get("waiting"):
        head.append(f"\nwaiting nodes: {', '.join(map(str, gen['waiting']))}", style="yellow")
    return head


def _node_role(doc: Mapping[str, Any], node_id: str) -> str:
    gen = _dict(doc.get("generation"))
    member = next((m for m in gen.get("members") or () if isinstance(m, dict) and m.get("node_id") == node_id), None)
    if member is not None:
        first, n = member.get("rank_offset", 0), member.get("nproc", 0)
        role = f"member {member.get('group_rank', '?')}, ranks {first}-{first + n - 1}" if n else "member"
    elif node_id in (gen.get("spare_nodes") or ()):
        role = "spare node"
    else:
        role = "not a member"
    return role + (", LOST" if node_id in (gen.get("lost") or ()) else "")


def _node_title(doc: Mapping[str, Any], node_id: str, now: float | None) -> Text:
    status = _dict(_dict(doc.get("status")).get(node_id))
    addr = status.get("addr") or _dict(_dict(doc.get("nodes")).get(node_id)).get("addr")
    detail = f"{_node_role(doc, node_id)}{'  ' + addr if addr else ''}{_age(status.get('time'), now)}"
    return Text.assemble((node_id, "bold"), "  ", (detail, "dim"))


def _node_table(doc: Mapping[str, Any], node_id: str, now: float | None) -> Table:
    table = Table("slot", "rank", "pid", "state", "step", "last step ms", "note", box=box.SIMPLE_HEAD, show_edge=False,
                  title=_node_title(doc, node_id, now), title_justify="left", pad_edge=False)
    workers = [w for w in _workers(doc) if w["node_id"] == node_id]
    if not workers:
        table.add_row("-", "-", "-", Text("no status published", style="dim"), "", "", "")
    for w in sorted(workers, key=lambda w: (w.get("slot") is None, w.get("slot") or 0)):
        last = w.get("last_step_ms")
        note = w.get("quarantine_reason") or ("" if w.get("managed", True) else "not using tpassrun.init()")
        table.add_row(_text(w.get("slot")), _text(w.get("rank")), _text(w.get("pid")),
                      _styled(w.get("state"), WORKER_STYLES), _text(w.get("step")),
                      f"{last:.1f}" if isinstance(last, (int, float)) and last > 0 else "-",
                      Text(str(note), style="red" if w.get("quarantine_reason") else "dim"))
    return table


def _busy_nodes(doc: Mapping[str, Any]) -> set[str]:
    """Nodes worth their own table in a big run: a slot that is not plainly running or spare, a swap or a
    taint touching them, or no status at all."""
    busy = {str(_dict(p.get(k)).get("node")) for _sid, p in _active_swaps(doc) for k in ("leaver", "joiner", "donor")}
    busy |= {str(_dict(t).get("node_id")) for t in _dict(doc.get("taints")).values()}
    busy |= {w["node_id"] for w in _workers(doc) if w.get("state") not in ("running", "spare")}
    busy |= set(_node_order(doc)) - {w["node_id"] for w in _workers(doc)}
    return busy


def _nodes_overview(doc: Mapping[str, Any], node_ids: list[str], now: float | None) -> Table:
    """One row per node, for runs too big for a table per node."""
    table = Table("node", "role", "slots", "step", "slowest step ms", "status age", box=box.SIMPLE_HEAD,
                  show_edge=False, title="nodes", title_justify="left", pad_edge=False)
    by_node: dict[str, list[dict]] = {n: [] for n in node_ids}
    for w in _workers(doc):
        by_node.setdefault(w["node_id"], []).append(w)
    for node_id in node_ids:
        workers = by_node[node_id]
        counts: dict[str, int] = {}
        for w in workers:
            counts[str(w.get("state"))] = counts.get(str(w.get("state")), 0) + 1
        slots = Text(", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no status published",
                     style="" if workers else "dim")
        steps = sorted({w["step"] for w in workers if w.get("state") == "running" and isinstance(w.get("step"), int)})
        step = "-" if not steps else str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
        lasts = [w["last_step_ms"] for w in workers if isinstance(w.get("last_step_ms"), (int, float))]
        when = _dict(_dict(doc.get("status")).get(node_id)).get("time")
        age = f"{max(0.0, now - when):.1f}s" if now is not None and isinstance(when, (int, float)) else "-"
        table.add_row(node_id, _node_role(doc, node_id), slots, step,
                      f"{max(lasts):.1f}" if lasts and max(lasts) > 0 else "-", age)
    return table


def _node_sections(doc: Mapping[str, Any], now: float | None, detail_nodes: int) -> list[RenderableType]:
    nodes = _node_order(doc)
    if len(nodes) <= detail_nodes:
        return [_node_table(doc, node_id, now) for node_id in nodes]
    busy = _busy_nodes(doc)
    detailed = [n for n in nodes if n in busy][:detail_nodes]
    return [_nodes_overview(doc, nodes, now), *(_node_table(doc, n, now) for n in detailed)]


def _spares(doc: Mapping[str, Any]) -> Text:
    order = {n: i for i, n in enumerate(_node_order(doc))}
    spares = sorted((w for w in _workers(doc) if _is_spare(w)),
                    key=lambda w: (order.get(w["node_id"], 0), str(w.get("slot"))))
    slots = [f"{w['node_id']}/{_text(w.get('slot'))}" for w in spares]
    if len(slots) > 12:  # the count matters more than the list in a big run
        slots = slots[:12] + [f"... {len(slots) - 12} more ({len(slots)} in all)"]
    nodes = [str(n) for n in _dict(doc.get("generation")).get("spare_nodes") or ()]
    line = Text("spares: ", style="bold")
    line.append(", ".join(slots) if slots else "none", style="cyan" if slots else "yellow")
    if nodes:
        line.append(f"   spare nodes: {', '.join(nodes)}", style="cyan")
    return line


_MARKS = {"done": ("✓", "green"), "current": ("▶", "bold yellow"), "pending": ("·", "dim"),
          "skipped": ("–", "dim"), "aborted": ("✗", "bold red")}


def _timeline_text(plan: Mapping[str, Any]) -> Text:
    out = Text()
    for i, step in enumerate(swap_timeline(plan)):
        if i:
            out.append(" → ", style="dim")
        symbol, style = _MARKS[step.mark]
        out.append(f"{symbol} {step.phase}", style=style)
        if step.offset is not None:
            out.append(f" +{step.offset:.2f}s", style="dim")
    return out


def _ref(ref: Any) -> str:
    r = _dict(ref)
    if not r:
        return "-"
    return f"{_text(r.get('node'), '?')}/{_text(r.get('slot'), '?')}" + (
        f" (rank {r['rank']})" if r.get("rank") is not None else "")


def _swap_block(sid: str, plan: Mapping[str, Any], now: float | None) -> RenderableType:
    title = Text.assemble(("swap ", "bold"), (sid, "bold magenta"),
                          f"  {_text(plan.get('kind'), '?')}  {_ref(plan.get('leaver'))} → {_ref(plan.get('joiner'))}")
    if plan.get("donor"):
        title.append(f"  state from {_ref(plan.get('donor'))}")
    if plan.get("boundary") is not None:
        title.append(f"  boundary step {plan['boundary']}")
    if plan.get("attempt"):
        title.append(f"  attempt {int(plan['attempt']) + 1}", style="yellow")
    history = [h[1] for h in plan.get("history") or () if isinstance(h, (list, tuple)) and len(h) == 2
               and isinstance(h[1], (int, float))]
    if history and now is not None:
        title.append(f"  running {max(0.0, now - min(history)):.1f}s", style="dim")
    lines: list[RenderableType] = [title, Text("  ").append_text(_timeline_text(plan))]
    if plan.get("reason"):
        lines.append(Text(f"  {plan['reason']}", style="dim"))
    return Group(*lines)


def _recent_swaps(doc: Mapping[str, Any], limit: int = 3) -> Table | None:
    """The last few finished swaps, newest first, with how long each took."""
    finished = []
    for sid, plan in _dict(doc.get("swaps")).items():
        if not isinstance(plan, dict) or plan.get("phase") not in TERMINAL_PHASES:
            continue
        times = [h[1] for h in plan.get("history") or () if isinstance(h, (list, tuple)) and len(h) == 2
                 and isinstance(h[1], (int, float))]
        finished.append((max(times, default=0.0), sid, plan, (max(times) - min(times)) if times else None))
    if not finished:
        return None
    table = Table("swap", "result", "leaver → joiner", "took", "reason", box=box.SIMPLE_HEAD, show_edge=False, title="recent swaps",
                  title_justify="left", pad_edge=False)
    for _end, sid, plan, took in sorted(finished, key=lambda f: f[:2], reverse=True)[:limit]:
        phase = plan.get("phase")
        table.add_row(sid, Text(str(phase), style="green" if phase == "done" else "bold red"),
                      f"{_ref(plan.get('leaver'))} → {_ref(plan.get('joiner'))}",
                      "-" if took is None else f"{took:.2f}s", _text(plan.get("reason"), ""))
    return table


def _taints(doc: Mapping[str, Any]) -> Table | None:
    taints = _dict(doc.get("taints"))
    if not taints:
        return None
    table = Table("id", "target", "effect", "source", "state", "reason", box=box.SIMPLE_HEAD, show_edge=False, title="taints",
                  title_justify="left", pad_edge=False)
    for tid, t in sorted(taints.items()):
        t = _dict(t)
        target = _text(t.get("node_id"), "?")
        if t.get("slot") is not None or t.get("local_rank") is not None:
            target += f"/{t.get('slot', t.get('local_rank'))}"
        if t.get("rank") is not None:
            target += f" (rank {t['rank']})"
        state = taint_state(t)
        label = state.value + (f" by {t['handled_by']}" if state == TaintState.MIGRATING and t.get("handled_by")
                               else "")
        table.add_row(tid, target, _text(t.get("effect")), _text(t.get("source")),
                      Text(label, style=TAINT_STYLES[state]), _text(t.get("reason"), ""))
    return table


def _health(doc: Mapping[str, Any], all_rows: int = 16) -> RenderableType | None:
    """Every verdict when there are few; otherwise only the ones that are not healthy, and a count of the rest."""
    health = _dict(doc.get("health"))
    if not health:
        return None
    table = Table("node", "device", "status", "effect", "reason", box=box.SIMPLE_HEAD, show_edge=False,
                  title="health", title_justify="left", pad_edge=False)
    per_node = {n: [v for v in _dict(h).get("verdicts") or () if isinstance(v, dict)] for n, h in health.items()}
    show_healthy = sum(map(len, per_node.values())) <= all_rows
    hidden = 0
    for node_id, h in sorted(health.items()):
        h = _dict(h)
        verdicts = per_node[node_id]
        for v in sorted(verdicts, key=lambda v: str(v.get("device"))):
            if v.get("status") == "healthy" and not show_healthy:
                hidden += 1
                continue
            effect = v.get("effect")
            table.add_row(node_id, _text(v.get("device")), _styled(v.get("status"), HEALTH_STYLES),
                          Text(_text(effect), style="" if effect in (None, "none") else "bold"),
                          _text(v.get("reason"), ""))
        for sensor, why in sorted(_dict(h.get("unavailable")).items()):
            table.add_row(node_id, str(sensor), Text("unavailable", style="dim"), "", str(why))
        if not verdicts and not h.get("unavailable"):
            table.add_row(node_id, "-", Text("no verdicts yet", style="dim"), "", "")
    if not hidden:
        return table
    note = Text(f"{hidden} healthy devices not listed", style="green")
    return Group(table, note) if table.row_count else Group(Text("health", style="italic"), note)


def render_status(doc: Mapping[str, Any], *, now: float | None = None, detail_nodes: int = 8) -> RenderableType:
    """The dashboard for one ``tpassctl status --json`` document (pure; ``now`` only adds ages).

    Up to ``detail_nodes`` nodes get a table each; a bigger run gets one row per node plus tables for the
    nodes where something is happening (a swap, a taint, a slot that is neither running nor spare), which
    keeps the view on one screen and a frame cheap to draw.
    """
    doc = _dict(doc)
    sections: list[RenderableType] = [_header(doc)]
    sections += _node_sections(doc, now, detail_nodes)
    swaps: list[RenderableType] = [_swap_block(sid, plan, now) for sid, plan in _active_swaps(doc)]
    sections.append(Group(_spares(doc), *(swaps or [Text("no swap in progress", style="dim")])))
    sections += [t for t in (_recent_swaps(doc), _taints(doc), _health(doc)) if t is not None]
    spaced: list[RenderableType] = []
    for section in sections:
        spaced += [section, Text()]
    return Group(*spaced[:-1])


# ---------------------------------------------------------------------------------------------- effects
async def _poll(fetch: Callable[[], Awaitable[dict]]) -> tuple[dict | None, str | None]:
    """One fetch; a failure (etcd briefly unreachable) is shown, not raised, so the view outlives it."""
    try:
        return await fetch(), None
    except Exception as exc:  # noqa: BLE001 - any fetch error is reported in the view and retried
        return None, f"fetch failed: {type(exc).__name__}: {exc}"


async def watch(fetch: Callable[[], Awaitable[dict]], *, interval: float = 0.5, console: Console | None = None,
                clock: Callable[[], float] = time.time) -> None:
    """Show the run until cancelled (Ctrl-C under ``asyncio.run`` cancels this task).

    On a terminal: a ``Live`` dashboard redrawn every ``interval`` seconds. ``auto_refresh=False`` keeps all
    drawing on this task (rich would otherwise redraw from its own thread while we swap the renderable).
    Elsewhere: one summary line each time it changes, so CI logs stay readable.
    """
    console = console or Console()
    if not console.is_terminal:
        last = None
        while True:
            doc, error = await _poll(fetch)
            line = error or summary_line(doc or {})
            if line != last:
                console.print(line, markup=False, highlight=False, soft_wrap=True)
                last = line
            await asyncio.sleep(interval)

    view: RenderableType = Text("waiting for the first status...", style="dim")
    with Live(view, console=console, auto_refresh=False) as live:
        while True:
            doc, error = await _poll(fetch)
            if doc is not None:
                view = render_status(doc, now=clock())
                live.update(view, refresh=True)
            else:
                # Keep the last good frame on screen and say why it is not fresh.
                live.update(Group(view, Text(error or "", style="bold red")), refresh=True)
            await asyncio.sleep(interval)


if __name__ == "__main__":  # pragma: no cover - debug aid: tpassctl status --json | python -m tpassrun.tui
    import json
    import sys

    Console().print(render_status(json.load(sys.stdin), now=time.time()))
