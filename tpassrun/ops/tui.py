"""The live status view: one frame of a run, drawn from the document ``tpassctl status --json`` prints.

Layout (htop/k9s style), top to bottom, sized to the terminal::

    tpassrun <run>  gen 3 active  world 512  step 1234  12.5 ms/step  spares 63 free  swaps 2 (1 active)
    leader <node>  nodes 64  status 0.4s old  [lost / waiting nodes, run closed]
    ▶ swap s-1 planned n9/1 r73 → n9/8 r73 at step 120 1.2s         <- alerts: swaps in flight with their
        ✓pause +0.00  ✓boundary +0.10  ▶transfer +0.50  ·send ...      phase timeline, taints, unhealthy
    ! taint t9 n1/1 r3 waiting (migrate, tpassctl): bad fan             verdicts, dead slots, last swap
    NODE  ROLE  RANKS  SLOTS  STEP  MS  AGE [ADDR  HEALTH]              <- one row per node (``e``: + slots)
    page 1/5  nodes 1-17 of 64  q quit  n/p page  / filter  e expand

Everything here is pure: :func:`render_status` maps (document, :class:`ViewState`, width, height, now) to a
rich renderable of at most ``height`` lines, and :func:`apply_key` maps a key to the next view. The effects
(polling etcd, the terminal, keys, the launcher's panel) live in :mod:`tpassrun.ops.tui_live`.

The document is read defensively: every field may be missing or ``null`` (a run that is still forming, an
agent that has not published yet, an older agent), and the view says so instead of raising. User text (taint
reasons, node ids, script output) is always put on screen as :class:`rich.text.Text`, never parsed as markup, and
with its control characters escaped (:func:`tpassrun.ops.cleantext.clean`: the whole document, once per frame).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any, Mapping

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from tpassrun.ops.cleantext import clean, clean_tree

__all__ = ["RunProgress", "TaintState", "TimelineStep", "duration_text", "step_info", "ViewState", "apply_key",
           "render_status", "summary_line", "swap_timeline",
           "taint_state"]

# The planner's phase order (tpassrun/plan/swap.py); repeated here so the view never imports the agent side.
PHASES = ("pause", "boundary", "transfer", "send", "reform", "done")
TERMINAL_PHASES = ("done", "aborted")

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
def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _workers(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every worker row of every node, with its node id."""
    rows = []
    for node_id, status in sorted(_dict(doc.get("status")).items()):
        for w in _dict(status).get("workers") or ():
            if isinstance(w, dict):
                rows.append({"node_id": node_id, **w})
    return rows


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def mirror_usage(doc: Mapping[str, Any], workers: list[dict[str, Any]] | None = None) -> str | None:
    """What mirroring sharded state costs (tpassrun/worker/shards.py), or None when nothing is mirrored: host memory of
    the local copies per rank (the largest), bytes one refresh sends (all ranks), and what the agents' mirror
    stores hold for other nodes."""
    rows = [w for w in (workers if workers is not None else _workers(doc))
            if isinstance(w.get("shard_held"), int) and w["shard_held"] > 0]
    held = sum(int(_dict(s).get("mirror_held") or 0) for s in _dict(doc.get("status")).values())
    if not rows and not held:
        return None
    parts = []
    if rows:
        parts.append(f"{_mib(max(w['shard_held'] for w in rows))}/rank local")
        parts.append(f"{_mib(sum(int(w.get('shard_bytes') or 0) for w in rows))}/refresh")
    if held:
        parts.append(f"{_mib(held)} held for buddies")
    return "mirror " + ", ".join(parts)


def _is_spare(worker: Mapping[str, Any]) -> bool:
    return bool(worker.get("spare")) or worker.get("state") == "spare"


def _active_swaps(doc: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    swaps = sorted(_dict(doc.get("swaps")).items())
    return [(sid, s) for sid, s in swaps if isinstance(s, dict) and s.get("phase") not in TERMINAL_PHASES]


def _node_order(doc: Mapping[str, Any]) -> list[str]:
    """Members in group-rank order, then spare nodes, then anything else that published a status."""
    gen = _dict(doc.get("generation"))
    order = [str(m.get("node_id")) for m in gen.get("members") or () if isinstance(m, dict)]
    order += [str(n) for n in gen.get("spare_nodes") or ()]
    order += sorted(_dict(doc.get("status")))
    return list(dict.fromkeys(order))


def _unhealthy(doc: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
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
             _plain_progress(workers), f"spares {spares}"]
    if quarantined:
        parts.append(f"quarantined {quarantined}")
    waiting = sum(1 for t in _dict(doc.get("taints")).values() if taint_state(_dict(t)) == TaintState.WAITING)
    if waiting:
        parts.append(f"taints {waiting} waiting")
    unhealthy = _unhealthy(doc)
    if unhealthy:
        parts.append(f"unhealthy {len(unhealthy)}")
    mirror = mirror_usage(doc, workers)
    if mirror is not None:
        parts.append(mirror)
    active = _active_swaps(doc)
    parts += [f"swap {sid} {s.get('phase')}" for sid, s in active] or ["no swap"]
    closed = doc.get("closed")
    if closed:
        parts.append(f"closed: {_dict(closed).get('reason', '')}".rstrip(": "))
    return clean(" | ".join(parts))


# ---------------------------------------------------------------------------------------------- the view's state
@dataclass(frozen=True)
class ViewState:
    """What the person at the terminal chose: the page, a node filter, expanded rows. Keys change it through
    :func:`apply_key`; the frame is a pure function of (document, view, size, now)."""

    page: int = 0
    node_filter: str = ""
    expanded: bool = False
    editing: str | None = None   # the filter being typed after "/" (None: not typing)


def apply_key(view: ViewState, key: str) -> tuple[ViewState, bool]:
    """(the new view, quit?) after one key. ``q`` quits, ``n``/``p`` page (also space/PgDn, PgUp), ``/`` or
    ``a`` starts typing a node filter (Enter applies it, Esc clears it), ``e`` expands nodes to their ranks."""
    if view.editing is not None:
        if key in ("\r", "\n"):
            return replace(view, node_filter=view.editing.strip(), editing=None, page=0), False
        if key == "\x1b":
            return replace(view, node_filter="", editing=None, page=0), False
        if key in ("\x7f", "\b"):
            return replace(view, editing=view.editing[:-1]), False
        if key.isprintable():
            return replace(view, editing=view.editing + key), False
        return view, False
    if key in ("q", "Q", "\x03"):
        return view, True
    if key in ("n", " ", "\x1b[6~", "\x1b[B", "j"):
        return replace(view, page=view.page + 1), False
    if key in ("p", "\x1b[5~", "\x1b[A", "k"):
        return replace(view, page=max(0, view.page - 1)), False
    if key in ("/", "a", "f"):
        return replace(view, editing=view.node_filter), False
    if key == "e":
        return replace(view, expanded=not view.expanded, page=0), False
    if key == "\x1b":
        return replace(view, node_filter="", page=0), False
    return view, False


# ---------------------------------------------------------------------------------------------- rendering
# One letter per slot, so a node of 8 ranks and a spare is one short cell: "RRRRRRRR s".
SLOT_GLYPHS = {"running": ("R", "green"), "spare": ("s", "cyan"), "leaving": ("L", "yellow"), "done": ("D", "blue"),
               "dead": ("X", "bold red"), "quarantined": ("Q", "red"), "idle": (".", "dim")}
_MARKS = {"done": ("✓", "green"), "current": ("▶", "bold yellow"), "pending": ("·", "dim"),
          "skipped": ("–", "dim"), "aborted": ("✗", "bold red")}
KEYS_HELP = "q quit  n/p page  / filter  e expand"


def _text(value: Any, default: str = "-") -> str:
    """User-supplied values (taint reasons, node ids, script output) only ever reach the screen through this
    and :class:`rich.text.Text`, never through rich markup, so ``[/]`` or ``[bold]`` show literally."""
    return default if value is None or value == "" else str(value)


def _line(*parts: Any, style: str = "") -> Text:
    """One screen line: never wraps (a long reason is cut with an ellipsis), so the frame height is exact."""
    out = Text(style=style, no_wrap=True, overflow="ellipsis")
    for part in parts:
        if isinstance(part, tuple):
            out.append(_text(part[0], ""), style=part[1])
        else:
            out.append(_text(part, ""))
    return out


def _ref(ref: Any) -> str:
    r = _dict(ref)
    if not r:
        return "-"
    rank = f" r{r['rank']}" if r.get("rank") is not None else ""
    return f"{_text(r.get('node'), '?')}/{_text(r.get('slot'), '?')}{rank}"


def _history_times(plan: Mapping[str, Any]) -> list[float]:
    return [float(h[1]) for h in plan.get("history") or () if isinstance(h, (list, tuple)) and len(h) == 2
            and isinstance(h[1], (int, float))]


@dataclass(frozen=True)
class RunProgress:
    """Where the run is: the slowest running rank's step, the total its ``sess.run`` was given, the slowest
    last step time (what an ETA is made of). Derived from the ``status/`` worker rows, nothing else."""

    step: int | None = None
    total: int = 0
    step_ms: float = 0.0

    @classmethod
    def of(cls, workers: list[dict[str, Any]]) -> "RunProgress":
        running = [w for w in workers if w.get("state") == "running" and w.get("rank") is not None]
        steps = [w["step"] for w in running if isinstance(w.get("step"), int)]
        totals = [w["total"] for w in running if isinstance(w.get("total"), int) and w["total"] > 0]
        lasts = [w["last_step_ms"] for w in running if isinstance(w.get("last_step_ms"), (int, float))
                 and w["last_step_ms"] > 0]
        return cls(step=min(steps) if steps else None, total=max(totals) if totals else 0,
                   step_ms=float(max(lasts)) if lasts else 0.0)

    @property
    def eta_s(self) -> float | None:
        if self.step is None or not self.total or self.step_ms <= 0:
            return None
        return max(0, self.total - self.step) * self.step_ms / 1000.0

    @property
    def steps_per_s(self) -> float | None:
        return 1000.0 / self.step_ms if self.step_ms > 0 else None


def duration_text(seconds: float) -> str:
    """``42s``, ``3m07s``, ``2h05m``: an ETA or an uptime."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _plain_progress(workers: list[dict[str, Any]]) -> str:
    where, pace = step_info(workers)
    return f"{where} ({pace})" if pace else where


def step_info(workers: list[dict[str, Any]]) -> tuple[str, str]:
    """(where, pace) of the run: the slowest running rank's step (of its total, with an ETA when known), and the
    slowest last step time with the steps per second it makes."""
    p = RunProgress.of(workers)
    where = "step -" if p.step is None else (f"step {p.step}/{p.total}" if p.total else f"step {p.step}")
    eta = p.eta_s
    if eta is not None:
        where += f"  ETA {duration_text(eta)}"
    pace = f"{p.step_ms:.1f}ms/step {p.steps_per_s:.1f}/s" if p.step_ms > 0 else ""
    return where, pace


def _summary(doc: Mapping[str, Any], now: float | None, workers: list[dict[str, Any]]) -> list[Text]:
    gen = _dict(doc.get("generation"))
    where, pace = step_info(workers)
    spares = sum(1 for w in workers if _is_spare(w))
    swaps = _dict(doc.get("swaps"))
    active = len(_active_swaps(doc))
    gen_state = _text(gen.get("state"), "")
    first = _line((f"gen {_text(gen.get('number'))} ", "bold"), (gen_state, GENERATION_STYLES.get(gen_state, "bold")),
                  f"  world {_text(gen.get('world_size'))}  {where}  ",
                  (f"spares {spares}", "cyan" if spares else "yellow"),
                  f"  swaps {len(swaps)}" + (f" ({active} live)" if active else ""))
    nodes = _node_order(doc)
    second = _line("run ", (_text(doc.get("run_id"), "?"), "bold"), style="dim")
    closed = doc.get("closed")
    if closed:
        second.append(f"  run closed: {_text(_dict(closed).get('reason'), 'yes')}", style="bold red")
    elif gen.get("reason") and gen_state != "active":
        second.append(f"  {gen['reason']}", style="yellow")
    if gen.get("lost"):
        second.append(f"  lost: {', '.join(map(str, gen['lost']))}", style="bold red")
    if gen.get("waiting"):
        second.append(f"  waiting for: {', '.join(map(str, gen['waiting']))}", style="yellow")
    second.append(f"  leader {_text(doc.get('leader'))}  nodes {len(nodes)}")
    mirror = mirror_usage(doc, workers)
    if mirror is not None:
        second.append(f"  {mirror}")
    times = [t for s in _dict(doc.get("status")).values() if isinstance(t := _dict(s).get("time"), (int, float))]
    if now is not None and times:
        second.append(f"  status {max(0.0, now - min(times)):.1f}s old")
    if pace:
        second.append(f"  {pace}")
    return [first, second]


def _timeline(plan: Mapping[str, Any]) -> Text:
    out = _line("  ")
    for i, step in enumerate(swap_timeline(plan)):
        symbol, style = _MARKS[step.mark]
        out.append((" " if i else "") + f"{symbol}{step.phase}", style=style)
        if step.offset is not None:
            out.append(f" +{step.offset:.2f}", style="dim")
    return out


def _alerts(doc: Mapping[str, Any], now: float | None, workers: list[dict[str, Any]]) -> list[Text]:
    """Most urgent first: swaps in flight (with their phase timeline), live taints, unhealthy verdicts, dead
    slots, then settled taints and the last finished swap."""
    urgent: list[Text] = []
    waiting = _dict(doc.get("waiting"))      # tpassrun --tui: what this agent waits for (tpassrun/ops/waiting.py)
    if waiting.get("what"):
        age = f" {max(0.0, now - float(waiting.get('since') or now)):.0f}s" if now is not None else ""
        urgent.append(_line(("… waiting", "bold yellow"), (age, "yellow"), ": ", _text(waiting.get("what"), "")))
    for sid, plan in _active_swaps(doc):
        line = _line(("▶ swap ", "bold magenta"), (sid, "bold magenta"),
                     f" {_text(plan.get('kind'), '?')} {_ref(plan.get('leaver'))} → {_ref(plan.get('joiner'))}")
        if plan.get("donor"):
            line.append(f" from {_ref(plan.get('donor'))}")
        if plan.get("boundary") is not None:
            line.append(f" at step {plan['boundary']}")
        if plan.get("attempt"):
            line.append(f" attempt {int(plan['attempt']) + 1}", style="yellow")
        times = _history_times(plan)
        if times and now is not None:
            line.append(f" {max(0.0, now - min(times)):.1f}s", style="dim")
        if plan.get("reason"):
            line.append(f" ({plan['reason']})", style="dim")
        urgent += [line, _timeline(plan)]
    settled: list[Text] = []
    for tid, t in sorted(_dict(doc.get("taints")).items()):
        t = _dict(t)
        state = taint_state(t)
        target = _text(t.get("node_id"), "?")
        if t.get("slot") is not None or t.get("local_rank") is not None:
            target += f"/{t.get('slot', t.get('local_rank'))}"
        if t.get("rank") is not None:
            target += f" r{t['rank']}"
        line = _line(("! taint " if state != TaintState.QUARANTINED else "· taint ", TAINT_STYLES[state]),
                     (tid, "bold"), f" {target} ", (state.value, TAINT_STYLES[state]),
                     f" ({_text(t.get('effect'))}, {_text(t.get('source'))}): ", (_text(t.get("reason"), ""), ""))
        (settled if state in (TaintState.QUARANTINED, TaintState.REJECTED) else urgent).append(line)
    for node_id, v in _unhealthy(doc):
        status = _text(v.get("status"))
        urgent.append(_line(("! health ", HEALTH_STYLES.get(status, "bold")), f"{node_id} {_text(v.get('device'))} ",
                            (status, HEALTH_STYLES.get(status, "bold")), f" → {_text(v.get('effect'))}: ",
                            _text(v.get("reason"), "")))
    for w in workers:
        if w.get("state") == "dead":
            urgent.append(_line(("! dead ", "bold red"), f"{w['node_id']}/{_text(w.get('slot'))} rank "
                                f"{_text(w.get('rank'))} pid {_text(w.get('pid'))}"))
    finished = [(max(_history_times(p), default=0.0), sid, p) for sid, p in _dict(doc.get("swaps")).items()
                if isinstance(p, dict) and p.get("phase") in TERMINAL_PHASES]
    if finished:
        _end, sid, plan = max(finished, key=lambda f: f[:2])
        times = _history_times(plan)
        took = f" in {max(times) - min(times):.2f}s" if times else ""
        ok = plan.get("phase") == "done"
        settled.append(_line(("✓ swap " if ok else "✗ swap ", "green" if ok else "bold red"), (sid, "bold"),
                             f" {plan.get('phase')}{took} {_ref(plan.get('leaver'))} → {_ref(plan.get('joiner'))}",
                             (f" ({plan['reason']})" if plan.get("reason") else "", "dim")))
    return urgent + settled


def _members(doc: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    gen = _dict(doc.get("generation"))
    return {str(m.get("node_id")): m for m in gen.get("members") or () if isinstance(m, dict)}


def _node_role(doc: Mapping[str, Any], node_id: str, members: Mapping[str, dict[str, Any]]) -> tuple[str, str]:
    """(role, ranks) of a node: ``("member 3", "24-31")``, ``("spare node", "-")``."""
    gen = _dict(doc.get("generation"))
    member = members.get(node_id)
    lost = node_id in (gen.get("lost") or ())
    if member is not None:
        first, n = member.get("rank_offset", 0), member.get("nproc", 0)
        ranks = f"{first}-{first + n - 1}" if isinstance(first, int) and isinstance(n, int) and n else "-"
        return ("LOST" if lost else f"member {_text(member.get('group_rank'), '?')}"), ranks
    if node_id in (gen.get("spare_nodes") or ()):
        return "spare node", "-"
    if node_id in (gen.get("waiting") or ()):
        return "waiting", "-"
    return ("LOST" if lost else "other"), "-"


def _node_rows(doc: Mapping[str, Any], view: ViewState, now: float | None,
               workers: list[dict[str, Any]]) -> list[tuple[list[Any], str]]:
    """Table rows ([cells], style) per node, each followed by its slot rows when expanded."""
    by_node: dict[str, list[dict[str, Any]]] = {}
    for w in workers:
        by_node.setdefault(w["node_id"], []).append(w)
    unhealthy: dict[str, int] = {}
    for node_id, _v in _unhealthy(doc):
        unhealthy[node_id] = unhealthy.get(node_id, 0) + 1
    wanted = view.node_filter.lower()
    members = _members(doc)
    groups = []
    for node_id in _node_order(doc):
        status = _dict(_dict(doc.get("status")).get(node_id))
        if wanted and wanted not in node_id.lower() and wanted not in str(status.get("addr", "")).lower():
            continue
        workers = sorted(by_node.get(node_id, []), key=lambda w: (w.get("slot") is None, str(w.get("slot"))))
        role, ranks = _node_role(doc, node_id, members)
        slots = Text(no_wrap=True, overflow="ellipsis", end="")
        for w in workers:
            glyph, style = SLOT_GLYPHS.get(str(w.get("state")), ("?", "bold"))
            slots.append(glyph, style=style)
        if not workers:
            slots.append("no status", style="dim")
        steps = sorted({w["step"] for w in workers if w.get("state") == "running" and isinstance(w.get("step"), int)})
        step = "-" if not steps else str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
        lasts = [w["last_step_ms"] for w in workers if isinstance(w.get("last_step_ms"), (int, float))]
        when = status.get("time")
        age = f"{max(0.0, now - when):.1f}s" if now is not None and isinstance(when, (int, float)) else "-"
        health = f"{unhealthy[node_id]} bad" if node_id in unhealthy else "ok" if node_id in _dict(
            doc.get("health")) else "-"
        cells = [node_id, role, ranks, slots, step, f"{max(lasts):.1f}" if lasts and max(lasts) > 0 else "-", age,
                 _text(status.get("addr")), health]
        rows = [(cells, "bold red" if role == "LOST" else "")]
        if view.expanded:
            for w in workers:
                last = w.get("last_step_ms")
                note = w.get("quarantine_reason") or ("" if w.get("managed", True) else "no tpassrun.init()")
                rows.append(([f"  slot {_text(w.get('slot'))}", _text(w.get("state")), f"rank {_text(w.get('rank'))}",
                              f"pid {_text(w.get('pid'))}", _text(w.get("step")),
                              f"{last:.1f}" if isinstance(last, (int, float)) and last > 0 else "-", "", "",
                              _text(note, "")], "dim" if w.get("state") != "dead" else "red"))
        groups.append(rows)
    return [row for g in groups for row in g]


def _pages(rows: list[Any], per_page: int) -> int:
    return max(1, -(-len(rows) // max(1, per_page)))


def _node_table(rows: list[tuple[list[Any], str]], width: int) -> Table:
    wide = width >= 120
    table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, header_style="bold")
    fixed = 11 + 9 + (12 + 9 + 8 + 6 + 16 + 24 if wide else 10 + 7 + 6 + 5) + (9 if wide else 7)  # widths + gaps
    table.add_column("NODE", min_width=8, max_width=max(8, min(48, width - fixed)), no_wrap=True, overflow="ellipsis")
    table.add_column("ROLE", width=11, no_wrap=True, overflow="ellipsis")
    table.add_column("RANKS", width=9, no_wrap=True, overflow="ellipsis")
    table.add_column("SLOTS", width=12 if wide else 10, no_wrap=True, overflow="ellipsis")
    table.add_column("STEP", width=9 if wide else 7, justify="right", no_wrap=True, overflow="ellipsis")
    table.add_column("MS", width=8 if wide else 6, justify="right", no_wrap=True, overflow="ellipsis")
    table.add_column("AGE", width=6 if wide else 5, justify="right", no_wrap=True, overflow="ellipsis")
    if wide:
        table.add_column("ADDR", width=16, no_wrap=True, overflow="ellipsis")
        table.add_column("HEALTH", width=24, no_wrap=True, overflow="ellipsis")
    for cells, style in rows:
        table.add_row(*(c if isinstance(c, Text) else Text(_text(c, "")) for c in cells[:9 if wide else 7]),
                      style=style)
    return table


def render_status(doc: Mapping[str, Any], *, now: float | None = None, width: int = 80, height: int | None = 24,
                  view: ViewState = ViewState(), keys: bool = True) -> RenderableType:
    """One frame of the live view for a ``tpassctl status --json`` document (pure; ``now`` only adds ages).

    The frame is at most ``height`` lines of ``width`` columns: two summary lines, the alerts (as many as fit,
    keeping at least a few node rows), a node table of one row per node (``view.expanded``: plus one per slot),
    paged, and a footer with the page and (``keys``) the keys. ``height=None`` draws every row.
    """
    doc = clean_tree(_dict(doc))   # every string of it may be anyone's: none may drive the terminal
    view = replace(view, node_filter=clean(view.node_filter),
                   editing=clean(view.editing) if view.editing is not None else None)
    workers = _workers(doc)   # read once: a 512-node run has thousands of worker rows
    top = _summary(doc, now, workers)
    alerts = _alerts(doc, now, workers) or [_line("no alerts", style="dim")]
    rows = _node_rows(doc, view, now, workers)
    if height is None:
        shown, page, pages, per_page = rows, 0, 1, len(rows)
    else:
        room = max(1, height - len(top) - 2)                   # minus the table header and the footer
        keep_rows = min(len(rows) or 1, max(3, room // 2))     # alerts never push every node off the screen
        if len(alerts) > room - keep_rows:
            hidden = len(alerts) - max(0, room - keep_rows - 1)
            alerts = alerts[:max(0, room - keep_rows - 1)] + [
                _line((f"… {hidden} more alerts (tpassctl status --json shows all)", "yellow"))]
        per_page = max(1, room - len(alerts))
        pages = _pages(rows, per_page)
        page = min(view.page, pages - 1)
        shown = rows[page * per_page:(page + 1) * per_page]
    start = 0 if height is None else page * per_page
    footer = _line(f"page {page + 1}/{pages}", style="reverse" if height is not None else "")
    what = "rows" if view.expanded else "nodes"
    footer.append(f"  {what} {start + 1 if shown else 0}-{start + len(shown)} of {len(rows)}")
    if view.node_filter or view.editing is not None:
        footer.append(f"  filter: {view.editing if view.editing is not None else view.node_filter}")
        footer.append("_  (enter/esc)" if view.editing is not None else "")
    if keys:
        footer.append(f"  {KEYS_HELP}")
    footer.pad_right(max(0, width - footer.cell_len))
    return Group(*top, *alerts, _node_table(shown, width), footer)
