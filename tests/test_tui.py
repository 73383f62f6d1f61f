"""The live view: hand-made ``tpassctl status --json`` documents rendered to text, golden frames at 80x24 and
200x50, keys, and ``watch()`` driven by a fake fetch. No network, no etcd: a frame is a pure function of the
document, the view state, the size and an injected clock.

Golden frames live in ``tests/golden/tui/*.txt`` (plain text, no colours). After a deliberate layout change,
regenerate them with ``TPASSRUN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_tui.py -k golden`` and
review the diff."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import io
import os
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from tpassrun.ops.tui import TaintState, ViewState, apply_key, render_status, summary_line, swap_timeline, taint_state
from tpassrun.ops.tui_live import WatchTracker, run_outcome, watch

T0 = 1_700_000_000.0


def worker(slot: int, rank: int | None, state: str, **extra: Any) -> dict:
    return {"slot": slot, "rank": rank, "local_rank": slot, "pid": 4000 + slot, "state": state,
            "step": 17 if state == "running" else 0, "managed": True, "spare": state == "spare",
            "last_step_ms": 12.5 if state == "running" else 0.0, "quarantine_reason": None, **extra}


def run_doc(**changes: Any) -> dict:
    """A healthy 2-node run: n0 ranks 0-1, n1 ranks 2-3, one spare slot on n1, no swap, no taint."""
    doc = {
        "v": 1, "run_id": "job-7", "leader": "n0", "closed": None, "nodes": {},
        "generation": {"v": 1, "number": 3, "state": "active", "world_size": 4, "reason": "", "spare_nodes": [],
                       "waiting": [], "lost": [],
                       "members": [{"node_id": "n0", "group_rank": 0, "addr": "10.0.0.1", "nproc": 2,
                                    "rank_offset": 0},
                                   {"node_id": "n1", "group_rank": 1, "addr": "10.0.0.2", "nproc": 2,
                                    "rank_offset": 2}]},
        "status": {"n0": {"v": 1, "node_id": "n0", "time": T0, "workers": [worker(0, 0, "running"),
                                                                             worker(1, 1, "running")]},
                   "n1": {"v": 1, "node_id": "n1", "time": T0, "workers": [worker(0, 2, "running"),
                                                                             worker(1, 3, "running"),
                                                                             worker(2, None, "spare")]}},
        "taints": {}, "swaps": {}, "health": {},
    }
    doc.update(changes)
    return doc


PHASE_TIMES = {"pause": 0.0, "boundary": 0.1, "transfer": 0.5, "send": 0.6, "reform": 1.5, "done": 2.0}


def swap_plan(phase: str, *, kind: str = "planned", history: list | None = None) -> dict:
    if history is None:
        order = list(PHASE_TIMES)
        reached = order[:order.index(phase) + 1] if phase in order else ["pause", "boundary"]
        history = [[p, T0 + PHASE_TIMES[p]] for p in reached]
        if phase == "aborted":
            history.append(["aborted", T0 + 0.3])
    return {"v": 1, "id": "s-1", "kind": kind, "generation": 3, "phase": phase, "reason": "maintenance",
            "leaver": {"node": "n1", "slot": 1, "rank": 3}, "joiner": {"node": "n1", "slot": 2, "rank": 3},
            "donor": None, "boundary": 120, "attempt": 0, "nodes": ["n0", "n1"], "history": history}


GOLDEN = Path(__file__).parent / "golden" / "tui"
UPDATE_GOLDEN = os.environ.get("TPASSRUN_UPDATE_GOLDEN") == "1"


def frame(doc: dict, width: int = 80, height: int | None = 24, now: float | None = T0 + 2.0,
          view: ViewState | None = None) -> str:
    """What a person sees: the frame as plain text (no colours), trailing spaces dropped."""
    view = ViewState() if view is None else view
    console = Console(width=width, height=height or 1000, record=True, file=io.StringIO(), color_system=None,
                      force_terminal=False, legacy_windows=False, _environ={})
    console.print(render_status(doc, now=now, width=width, height=height, view=view))
    return "\n".join(line.rstrip() for line in console.export_text(styles=False).splitlines()) + "\n"


def text(doc: dict, now: float | None = None) -> str:
    return frame(doc, width=140, height=None, now=now)


def row(out: str, *cells: str) -> str:
    """The first line that starts with the first cell and holds the others, with runs of spaces collapsed (column
    widths are rich's business)."""
    lines = [" ".join(line.split()) for line in out.splitlines()]
    return next((line for line in lines if line.startswith(cells[0].strip()) and all(c in line for c in cells)), "")


def test_no_swap_shows_summary_and_one_row_per_node():
    doc = run_doc()
    out = text(doc, now=T0 + 1.5)
    assert out.splitlines()[0] == "gen 3 active  world 4  step 17  spares 1  swaps 0"
    assert "run job-7  leader n0  nodes 2  status 1.5s old" in out
    assert "no alerts" in out
    assert row(out, "n0 ") == "n0 member 0 0-1 RR 17 12.5 1.5s - -"
    assert row(out, "n1 ") == "n1 member 1 2-3 RRs 17 12.5 1.5s - -"
    assert summary_line(doc) == "gen 3 | world 4 | ranks 4 running | step 17 (12.5ms/step 80.0/s) | spares 1 | no swap"


@pytest.mark.parametrize("phase", ["pause", "boundary", "transfer", "send", "reform"])
def test_active_swap_in_each_phase_is_the_first_alert_with_its_timeline(phase):
    doc = run_doc(swaps={"s-1": swap_plan(phase)})
    lines = frame(doc).splitlines()
    assert lines[2] == "▶ swap s-1 planned n1/1 r3 → n1/2 r3 at step 120 2.0s (maintenance)"
    assert f"▶{phase} +{PHASE_TIMES[phase]:.2f}" in lines[3] and "·done" in lines[3]
    assert "swaps 1 (1 live)" in lines[0]
    assert summary_line(doc) == f"gen 3 | world 4 | ranks 4 running | step 17 (12.5ms/step 80.0/s) | spares 1 | swap s-1 {phase}"
    marks = {s.phase: s.mark for s in swap_timeline(swap_plan(phase))}
    order = list(PHASE_TIMES)
    assert [marks[p] for p in order] == (["done"] * order.index(phase) + ["current"]
                                         + ["pending"] * (len(order) - order.index(phase) - 1))


def test_finished_swaps_leave_the_alerts_and_the_last_one_is_listed():
    doc = run_doc(swaps={"s-1": swap_plan("done"), "s-2": {**swap_plan("aborted"), "id": "s-2"}})
    out = frame(doc)
    assert "▶ swap" not in out and "swaps 2" in out
    assert "✓ swap s-1 done in 2.00s n1/1 r3 → n1/2 r3 (maintenance)" in out
    assert summary_line(doc).endswith("| no swap")
    aborted = swap_timeline(swap_plan("aborted"))
    assert [(s.phase, s.mark) for s in aborted] == [("pause", "done"), ("boundary", "done"), ("transfer", "pending"),
                                                    ("send", "pending"), ("reform", "pending"), ("done", "pending"),
                                                    ("aborted", "aborted")]


def test_unplanned_swap_skips_the_boundary_and_a_retry_shows_the_last_entry():
    history = [["pause", T0], ["transfer", T0 + 0.2], ["send", T0 + 0.3], ["transfer", T0 + 1.0], ["send", T0 + 1.2]]
    plan = {**swap_plan("send", kind="unplanned", history=history), "attempt": 1,
            "donor": {"node": "n0", "slot": 0, "rank": 0}}
    steps = {s.phase: s for s in swap_timeline(plan)}
    assert steps["boundary"].mark == "skipped" and steps["boundary"].offset is None
    assert steps["transfer"].offset == pytest.approx(1.0) and steps["send"].mark == "current"
    out = text(run_doc(swaps={"s-1": plan}))
    assert "unplanned n1/1 r3 → n1/2 r3 from n0/0 r0" in out and "attempt 2" in out
    assert "–boundary" in out and "▶send +1.20" in out


@pytest.mark.parametrize("record, state", [
    ({}, TaintState.PENDING),
    ({"state": "wait: no spare available for rank 3; the swap waits for one"}, TaintState.WAITING),
    ({"state": "migrating", "handled_by": "s-1"}, TaintState.MIGRATING),
    ({"state": "quarantined", "handled_by": "s-1"}, TaintState.QUARANTINED),
    ({"state": "no spare is left", "handled_by": "restart"}, TaintState.RESTART),
    ({"state": "fallback: rank 3 does not use tpassrun.init()"}, TaintState.RESTART),
    ({"state": "reject: rank 9 is not running in generation 3"}, TaintState.REJECTED),
])
def test_taint_states(record, state):
    assert taint_state(record) is state


def test_taint_waiting_for_a_spare():
    doc = run_doc(taints={"t9": {"v": 1, "id": "t9", "node_id": "n1", "rank": 3, "local_rank": 1,
                                 "effect": "migrate", "source": "tpassctl", "reason": "bad fan",
                                 "state": "wait: no spare available for rank 3; the swap waits for one"}})
    doc["status"]["n1"]["workers"].pop()  # the spare is gone
    out = frame(doc)
    assert "spares 0  " in out
    assert out.splitlines()[2] == "! taint t9 n1/1 r3 waiting (migrate, tpassctl): bad fan"
    assert summary_line(doc) == "gen 3 | world 4 | ranks 4 running | step 17 (12.5ms/step 80.0/s) | spares 0 | taints 1 waiting | no swap"


def test_quarantined_slot_and_its_settled_taint():
    doc = run_doc()
    doc["status"]["n0"]["workers"] = [worker(0, 0, "running"),
                                      worker(1, None, "quarantined", quarantine_reason="gpu1: ECC errors 12 > 0"),
                                      worker(2, 1, "running")]
    doc["taints"] = {"t1": {"id": "t1", "node_id": "n0", "slot": 1, "rank": 1, "effect": "migrate",
                            "source": "health", "reason": "gpu1: ECC", "state": "quarantined", "handled_by": "s-0"}}
    out = frame(doc, view=ViewState(expanded=True))
    assert row(out, "n0 ").startswith("n0 member 0 0-1 RQR ")
    assert row(out, "slot 1") == "slot 1 quarantined rank - pid 4001 0 -"
    assert "· taint t1 n0/1 r1 quarantined (migrate, health): gpu1: ECC" in out
    assert summary_line(doc) == "gen 3 | world 4 | ranks 4 running | step 17 (12.5ms/step 80.0/s) | spares 1 | quarantined 1 | no swap"


def test_unhealthy_verdicts_are_alerts_and_healthy_ones_a_node_column():
    doc = run_doc(health={
        "n0": {"v": 1, "verdicts": [{"device": "gpu1", "status": "failing", "effect": "migrate",
                                     "reason": "ECC errors 12 > 0"},
                                    {"device": "gpu0", "status": "healthy", "effect": "none", "reason": "ok"}]},
        "n1": {"v": 1, "verdicts": []}})
    out = frame(doc, width=200, height=50)
    assert "! health n0 gpu1 failing → migrate: ECC errors 12 > 0" in out
    assert row(out, "n0 ").endswith("- 1 bad") and row(out, "n1 ").endswith("- ok")
    assert "gpu0" not in out
    assert "| unhealthy 1 |" in summary_line(doc)


def test_dead_slot_is_an_alert():
    doc = run_doc()
    doc["status"]["n1"]["workers"][0]["state"] = "dead"
    out = frame(doc)
    assert "! dead n1/0 rank 2 pid 4000" in out and row(out, "n1 ").startswith("n1 member 1 2-3 XRs")


def test_forming_closed_lost_and_waiting_runs():
    doc = run_doc(closed={"v": 1, "reason": "worker failed"})
    doc["generation"].update(state="forming", lost=["n1"], waiting=["n2"], reason="node n1 lost")
    out = frame(doc)
    assert out.startswith("gen 3 forming")
    for fact in ("lost: n1", "waiting for: n2", "run closed: worker failed"):
        assert fact in out.splitlines()[1], fact
    assert row(out, "n1 ").startswith("n1 LOST 2-3")
    assert summary_line(doc).startswith("gen 3 forming | ")
    assert summary_line(doc).endswith("| closed: worker failed")


@pytest.mark.parametrize("doc", [
    {},
    {"run_id": "r", "generation": None, "leader": None, "status": None, "taints": None, "swaps": None,
     "health": None},
    {"run_id": "r", "status": {"n5": {}}, "health": {"n5": None}, "taints": {"t": None}, "swaps": {"s": None}},
    {"run_id": "r", "generation": {"number": 1, "members": [{"node_id": "n0"}]},
     "status": {"n0": {"workers": [None, {"slot": 0}]}}, "swaps": {"s": {"phase": "transfer", "history": [["pause"]]}}},
])
def test_empty_and_missing_fields_render(doc):
    before = copy.deepcopy(doc)
    for expanded in (False, True):
        out = frame(doc, view=ViewState(expanded=expanded))
        assert "run " in out and len(out.splitlines()) <= 24
    line = summary_line(doc)
    assert line.startswith("gen ") and "\n" not in line
    assert doc == before                       # rendering never mutates the document


def test_empty_doc_facts():
    out = frame({})
    assert out.startswith("gen - ") and "spares 0  " in out and "no alerts" in out
    assert summary_line({}) == "gen - | world - | ranks 0 running | step - | spares 0 | no swap"
    assert row(frame({"run_id": "r", "status": {"n5": {}}}), "n5") == "n5 other - no status - - -"


@pytest.mark.parametrize("reason", ["[/]", "[bold]x", "[/bold] [red]y[/red] [link=http://a]z"])
def test_user_text_with_rich_markup_renders_literally(reason):
    """Issue 11: a taint reason "[/]" used to break the status view for good."""
    doc = run_doc(taints={"t[/]": {"id": "t[/]", "node_id": "n[b]1", "rank": 3, "effect": "migrate",
                                   "source": "[i]me", "reason": reason, "state": "pending"}})
    doc["generation"]["members"][1]["node_id"] = "n[b]1"
    doc["status"]["n[b]1"] = doc["status"].pop("n1")
    doc["status"]["n[b]1"]["workers"][0]["quarantine_reason"] = reason
    doc["health"] = {"n0": {"verdicts": [{"device": "[dev]", "status": "failing", "effect": "fail", "reason": reason}]}}
    out = frame(doc, width=200, height=50, view=ViewState(expanded=True))
    assert f"! taint t[/] n[b]1 r3 pending (migrate, [i]me): {reason}" in out
    assert f"! health n0 [dev] failing → fail: {reason}" in out
    assert row(out, "n[b]1 ").startswith("n[b]1 member 1 2-3") and reason[:20] in out.split("slot 0", 2)[2]


def test_ctl_plain_status_escapes_user_text(capsys):
    from tpassrun.ops.ctl import RunSnapshot
    from tpassrun.ops.ctl_render import render_status as _render_status
    from tpassrun.records import HealthRecord, NodeStatus, SwapPlan, Taint, WorkerRow

    plan = SwapPlan.from_json({"v": 1, "id": "s1", "kind": "planned", "generation": 0, "phase": "done",
                               "reason": "[/] [bold]y", "leaver": {"node": "n", "slot": 0, "rank": 0},
                               "joiner": {"node": "n", "slot": 1, "rank": 0}})
    snap = RunSnapshot("run[/]", taints={"t1": Taint.from_json({"v": 1, "id": "t1", "node_id": "n[/]", "reason": "[/]",
                                                                "effect": "migrate", "state": "[bold]w"})},
                       swaps={"s1": plan},
                       health={"n[/]": HealthRecord(node_id="n[/]", verdicts=({"device": "d", "status": "failing",
                                                                             "reason": "[bold]x"},))},
                       status={"n[/]": NodeStatus(node_id="n[/]", workers=(WorkerRow(slot=0, state="[red]z"),))})
    _render_status(snap)
    out = capsys.readouterr().out
    for literal in ("run[/]", "[/] [bold]y", "[bold]x", "[bold]w", "[red]z", "n[/]"):
        assert literal in out, literal


# ---------------------------------------------------------------------------------------------- fitting, golden
def big_run(nodes: int, *, spares: int = 1) -> dict:
    """``nodes`` x 8 ranks with host-like node ids, ``spares`` spare slots per node, healthy."""
    names = [f"dgx-a100-{i:03d}-{31000 + i}-{i * 2654435761 % 65536:04x}" for i in range(nodes)]
    doc = run_doc()
    doc["generation"]["members"] = [{"node_id": n, "group_rank": i, "addr": f"10.1.{i // 250}.{i % 250 + 1}",
                                     "nproc": 8, "rank_offset": 8 * i} for i, n in enumerate(names)]
    doc["generation"]["world_size"] = 8 * nodes
    doc["status"] = {n: {"time": T0 + 1.5, "addr": f"10.1.{i // 250}.{i % 250 + 1}",
                         "workers": [worker(s, 8 * i + s, "running", step=1234, total=5000,
                                            last_step_ms=142.25 + (i % 7))
                                     for s in range(8)] + [worker(8 + k, None, "spare") for k in range(spares)]}
                     for i, n in enumerate(names)}
    doc["health"] = {n: {"verdicts": [{"device": f"gpu{g}", "status": "healthy", "effect": "none", "reason": "ok"}
                                      for g in range(8)]} for n in names}
    return doc


def eventful_run(nodes: int) -> dict:
    """A run in trouble: a planned swap in flight on the last node, a waiting taint, an unhealthy GPU."""
    doc = big_run(nodes, spares=2)
    names = list(doc["status"])
    last, first = names[-1], names[0]
    rank = 8 * (nodes - 1) + 3
    doc["swaps"] = {"s-7f3a": {**swap_plan("transfer"), "id": "s-7f3a", "reason": "taint t-91: xid 79",
                               "leaver": {"node": last, "slot": 3, "rank": rank},
                               "joiner": {"node": last, "slot": 9, "rank": rank}},
                    "s-1c02": {**swap_plan("done"), "id": "s-1c02", "reason": "tpassctl drain",
                               "leaver": {"node": first, "slot": 5, "rank": 5},
                               "joiner": {"node": first, "slot": 8, "rank": 5}}}
    doc["status"][last]["workers"][3]["state"] = "leaving"
    doc["status"][first]["workers"][5].update(state="quarantined", rank=None, quarantine_reason="drained")
    doc["status"][first]["workers"][8].update(state="running", rank=5, step=1234, spare=False)
    doc["taints"] = {"t-91": {"id": "t-91", "node_id": last, "slot": 3, "rank": rank, "effect": "migrate",
                              "source": "health", "reason": "gpu3: xid 79 (fell off the bus)", "state": "migrating",
                              "handled_by": "s-7f3a"}}
    doc["health"][last]["verdicts"][3].update(status="failing", effect="migrate", reason="xid 79 (fell off the bus)")
    return doc


GOLDEN_CASES = [(nodes, w, h) for nodes in (1, 2, 8, 64) for (w, h) in ((80, 24), (200, 50))]


def check_golden(name: str, out: str) -> None:
    path = GOLDEN / f"{name}.txt"
    if UPDATE_GOLDEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(out, encoding="utf-8")
    assert path.exists(), f"{path} missing: run with TPASSRUN_UPDATE_GOLDEN=1 to create it"
    assert out == path.read_text(encoding="utf-8"), f"{name}: frame differs from {path}"


@pytest.mark.parametrize("nodes, width, height", GOLDEN_CASES)
def test_golden_frames(nodes, width, height):
    out = frame(eventful_run(nodes), width=width, height=height)
    lines = out.splitlines()
    assert len(lines) <= height and max(map(len, lines)) <= width
    assert lines[0].startswith("gen 3 active") and lines[2].startswith("▶ swap s-7f3a planned")
    assert lines[-1].startswith("page 1/")
    check_golden(f"{nodes}n_{width}x{height}", out)


@pytest.mark.parametrize("name, view", [("64n_80x24_page3", ViewState(page=2)),
                                        ("64n_80x24_filter", ViewState(node_filter="-06")),
                                        ("2n_80x24_expanded", ViewState(expanded=True)),
                                        ("8n_80x24_typing_filter", ViewState(editing="a100-00"))])
def test_golden_frames_with_keys(name, view):
    nodes = int(name.split("n_")[0])
    out = frame(eventful_run(nodes), view=view)
    assert len(out.splitlines()) <= 24
    check_golden(name, out)


@pytest.mark.parametrize("width, height", [(80, 24), (200, 50), (60, 12), (100, 30)])
def test_64_nodes_fit_every_size_and_pages_cover_every_node(width, height):
    doc = eventful_run(64)
    seen: list[str] = []
    page = 0
    while True:
        out = frame(doc, width=width, height=height, view=ViewState(page=page))
        lines = out.splitlines()
        assert len(lines) <= height and max(map(len, lines)) <= width
        footer = lines[-1]
        seen += [line.split()[0] for line in lines if line.startswith("dgx-")]
        total = int(footer.split()[1].split("/")[1])
        if page + 1 >= total:
            break
        page += 1
    assert len(seen) == 64                                    # every node on exactly one page
    if width >= 80:
        assert len(set(seen)) == 64                           # and told apart
    assert frame(doc, width=width, height=height, view=ViewState(page=page + 5)) == out   # past the end: last page


def test_many_alerts_keep_node_rows_on_screen():
    doc = big_run(64)
    doc["taints"] = {f"t{i}": {"id": f"t{i}", "node_id": "n", "effect": "migrate", "reason": "r", "state": "pending"}
                     for i in range(40)}
    lines = frame(doc).splitlines()
    assert len(lines) == 24
    assert any(line.startswith("… ") and "more alerts" in line for line in lines)
    assert sum(line.startswith("dgx-") for line in lines) >= 3


# ---------------------------------------------------------------------------------------------- keys
def test_keys_page_filter_expand_and_quit():
    v = ViewState()
    v, q = apply_key(v, "n")
    assert (v.page, q) == (1, False)
    v, _ = apply_key(v, "p")
    v, _ = apply_key(v, "p")
    assert v.page == 0
    v, _ = apply_key(v, "/")
    for key in "a1x":
        v, q = apply_key(v, key)
        assert not q                             # "q" typed into a filter is text, not quit
    v, _ = apply_key(v, "\x7f")
    assert v.editing == "a1"
    v, _ = apply_key(v, "\r")
    assert (v.node_filter, v.editing, v.page) == ("a1", None, 0)
    v, _ = apply_key(v, "e")
    assert v.expanded
    v, _ = apply_key(v, "\x1b")
    assert v.node_filter == ""
    assert apply_key(v, "q")[1] and apply_key(v, "\x03")[1]


def test_escape_sequences_are_one_key():
    from tpassrun.ops.tui_live import _split_keys

    assert _split_keys("n\x1b[6~q\x1b[A") == ["n", "\x1b[6~", "q", "\x1b[A"]


# ---------------------------------------------------------------------------------------------- the end of a run
def test_outcome_from_the_closed_record():
    assert run_outcome(run_doc()) is None
    assert run_outcome(run_doc(closed={"reason": "succeeded"})).code == 0
    failed = run_outcome(run_doc(closed={"reason": "workers failed: rank 1 exited 1"}))
    assert failed.code == 1 and failed.message == "run job-7 ended: workers failed: rank 1 exited 1"
    gen_closed = run_doc()
    gen_closed["generation"].update(state="closed", reason="succeeded")
    assert run_outcome(gen_closed).code == 0


def test_tracker_survives_short_outages_and_gives_up_after_lost_after():
    tracker = WatchTracker(lost_after=10.0)
    assert tracker.update(run_doc(), None, now=0.0) is None
    assert tracker.update(None, "fetch failed: lost etcd", now=1.0) is None
    assert tracker.update(None, "fetch failed: lost etcd", now=10.9) is None
    assert tracker.update(run_doc(), None, now=11.0) is None                 # back: the clock restarts
    assert tracker.update(None, "fetch failed: lost etcd", now=12.0) is None
    end = tracker.update(None, "fetch failed: lost etcd", now=22.0)
    assert end is not None and end.code == 3 and "no answer for 10s" in end.message
    assert "last seen: gen 3 | world 4" in end.message


class FakeFetch:
    """Returns the scripted documents (an Exception instance is raised), then repeats the last one."""

    def __init__(self, script: list) -> None:
        self.script = list(script)
        self.calls = 0

    async def __call__(self) -> dict:
        self.calls += 1
        item = self.script[min(self.calls, len(self.script)) - 1]
        if isinstance(item, Exception):
            raise item
        return item


@pytest.mark.timeout(10)
def test_watch_off_a_terminal_prints_one_line_per_change_and_exits_with_the_outcome():
    swapping = run_doc(swaps={"s-1": swap_plan("send")})
    script = [run_doc(), run_doc(), swapping, swapping, ConnectionError("etcd down"), ConnectionError("etcd down"),
              run_doc(), run_doc(closed={"v": 1, "reason": "workers failed: rank 1"})]
    buf = io.StringIO()
    console = Console(file=buf, width=60)
    assert not console.is_terminal
    assert asyncio.run(watch(FakeFetch(script), interval=0, console=console)) == 1
    lines = buf.getvalue().splitlines()
    stamps = [ln[:20] for ln in lines[:-1]]            # off a terminal every status line says when
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", t) for t in stamps), lines
    assert [ln[20:] for ln in lines[:-1]] + lines[-1:] == [
        "gen 3 | world 4 | ranks 4 running | step 17 (12.5ms/step 80.0/s) | spares 1 | no swap",
        "gen 3 | world 4 | ranks 4 running | step 17 (12.5ms/step 80.0/s) | spares 1 | swap s-1 send",
        "fetch failed: ConnectionError: etcd down",
        "gen 3 | world 4 | ranks 4 running | step 17 (12.5ms/step 80.0/s) | spares 1 | no swap",
        "gen 3 | world 4 | ranks 4 running | step 17 (12.5ms/step 80.0/s) | spares 1 | no swap | closed: workers failed: rank 1",
        "run job-7 ended: workers failed: rank 1",
    ]


@pytest.mark.timeout(10)
def test_watch_gives_up_when_etcd_is_gone_for_good():
    clock = iter(range(0, 1000, 4))
    buf = io.StringIO()
    code = asyncio.run(watch(FakeFetch([run_doc(), ConnectionError("lost etcd")]), interval=0,
                             console=Console(file=buf, width=200), clock=lambda: float(next(clock)), lost_after=10))
    assert code == 3 and "lost the run: no answer for 10s" in buf.getvalue().splitlines()[-1]


def terminal(width: int = 80, height: int = 24) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=width, height=height, force_terminal=True, color_system=None,
                   legacy_windows=False, _environ={}), buf


@pytest.mark.timeout(10)
def test_watch_on_a_terminal_draws_frames_follows_keys_and_exits_on_success():
    console, buf = terminal()
    keys: asyncio.Queue[str] = asyncio.Queue()
    docs = [eventful_run(64)] * 3 + [{**eventful_run(64), "closed": {"reason": "succeeded"}}]
    for key in "n":
        keys.put_nowait(key)
    code = asyncio.run(watch(FakeFetch(docs), interval=0.01, console=console, keys=keys, clock=lambda: T0 + 2.0))
    out = buf.getvalue()
    assert code == 0
    assert "page 1/" in out and "page 2/" in out and "▶ swap s-7f3a" in out
    assert out.rstrip().endswith("run job-7 ended: succeeded")


@pytest.mark.timeout(10)
def test_watch_on_a_terminal_quits_on_q_and_shows_fetch_errors():
    console, buf = terminal()
    keys: asyncio.Queue[str] = asyncio.Queue()

    class Then(FakeFetch):
        async def __call__(self) -> dict:
            if self.calls == 2:
                keys.put_nowait("q")
            return await super().__call__()

    code = asyncio.run(watch(Then([run_doc(), ConnectionError("etcd down"), ConnectionError("etcd down")]),
                             interval=0.01, console=console, keys=keys))
    out = buf.getvalue()
    assert code == 0 and "fetch failed: ConnectionError: etcd down" in out and "run job-7" in out


# ---------------------------------------------------------------------------------------------- tpassrun --tui
def test_panel_draws_the_bottom_lines_under_a_scroll_region_for_the_workers():
    from tpassrun.ops.tui_panel import panel_bytes, panel_height

    assert [panel_height(r) for r in (10, 24, 50, 5)] == [5, 8, 16, 0]
    raw = panel_bytes(eventful_run(8), 80, 24, T0 + 2.0).decode()
    assert raw.startswith("\x1b7\x1b[1;16r") and raw.endswith("\x1b8")   # save, workers scroll in lines 1-16
    assert raw.count("\x1b[2K") == 8 and "\x1b[17;1H\x1b[2K" in raw and "\x1b[24;1H\x1b[2K" in raw
    plain = re.sub("\x1b\\[[0-9;]*m", "", raw)                           # colours off
    assert "gen 3 active" in plain and "q quit" not in plain             # the launcher reads no keys
    assert panel_bytes(run_doc(), 80, 5, T0) == b""


@pytest.mark.timeout(10)
def test_panel_is_off_without_a_terminal_and_gives_the_terminal_back(tmp_path):
    import pty

    from tpassrun.ops.tui_panel import run_panel

    async def never() -> dict:
        raise AssertionError("no terminal: nothing is fetched")

    with open(tmp_path / "out", "wb") as f:
        asyncio.run(run_panel(never, fd=f.fileno()))
    master, slave = pty.openpty()
    try:
        import fcntl
        import struct
        import termios

        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        os.set_blocking(master, False)

        async def fetch() -> dict:
            return run_doc()

        async def main() -> None:
            task = asyncio.create_task(run_panel(fetch, fd=slave, interval=0.01, clock=lambda: T0))
            await asyncio.sleep(0.2)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        asyncio.run(main())
        out = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(master, 65536):
                out += chunk
        plain = re.sub(b"\x1b\\[[0-9;]*m", b"", out)
        assert b"gen 3 active" in plain and plain.endswith(b"\x1b8") and b"\x1b[r" in plain.split(b"gen 3 active")[-1]
    finally:
        os.close(master)
        os.close(slave)


def test_a_lost_run_ends_with_the_exit_code_in_its_launchers_event_log(tmp_path):
    from tpassrun.ops.tui_live import outcome_from_event_log

    log = tmp_path / "events.jsonl"
    assert outcome_from_event_log(str(log)) is None and outcome_from_event_log(None) is None
    log.write_text('{"event": "swap_done"}\nnot json\n')
    assert outcome_from_event_log(str(log)) is None
    log.write_text('{"event": "generation_ended"}\n{"event": "agent_exit", "code": 1}\n')
    end = outcome_from_event_log(str(log))
    assert end.code == 1 and "exited with 1" in end.message
    tracker = WatchTracker(lost_after=10.0, on_lost=lambda: outcome_from_event_log(str(log)))
    tracker.update(run_doc(), None, now=0.0)
    assert tracker.update(None, "fetch failed: lost etcd", now=0.5).code == 1   # at once, no 10 s wait
    log.write_text('{"event": "agent_exit", "code": 0}\n')
    clock = iter(range(100))
    buf = io.StringIO()
    code = asyncio.run(watch(FakeFetch([run_doc(), ConnectionError("lost etcd")]), interval=0,
                             console=Console(file=buf, width=200), clock=lambda: float(next(clock)),
                             on_lost=lambda: outcome_from_event_log(str(log))))
    assert code == 0 and buf.getvalue().splitlines()[-1].startswith("the run ended: its launcher exited with 0")
