"""The status view: hand-made ``tpassctl status --json`` documents rendered to text, and ``watch()`` driven by a
fake fetch. No network, no etcd: the view is a pure function of the document."""

from __future__ import annotations

import asyncio
import copy
import io
from typing import Any

import pytest
from rich.console import Console

from tpassrun.tui import TaintState, render_status, summary_line, swap_timeline, taint_state, watch

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


def text(doc: dict, now: float | None = None) -> str:
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(render_status(doc, now=now))
    return console.export_text()


def row(out: str, *cells: str) -> str:
    """The first line holding every cell, with runs of spaces collapsed (column widths are rich's business)."""
    lines = [" ".join(line.split()) for line in out.splitlines()]
    return next((line for line in lines if all(c in line for c in cells)), "")


def test_no_swap_shows_header_nodes_and_spares():
    doc = run_doc()
    out = text(doc, now=T0 + 1.5)
    for fact in ("run job-7", "generation 3 active", "world size 4", "leader n0", "member 0, ranks 0-1",
                 "member 1, ranks 2-3", "spares: n1/2", "no swap in progress", "status 1.5s old", "12.5"):
        assert fact in out, fact
    assert "taints" not in out and "health" not in out
    assert summary_line(doc) == "gen 3 | world 4 | ranks 4 running | spares 1 | no swap"


@pytest.mark.parametrize("phase", ["pause", "boundary", "transfer", "send", "reform"])
def test_active_swap_in_each_phase(phase):
    doc = run_doc(swaps={"s-1": swap_plan(phase)})
    out = text(doc)
    assert f"▶ {phase} +{PHASE_TIMES[phase]:.2f}s" in out
    assert "swap s-1  planned  n1/1 (rank 3) → n1/2 (rank 3)  boundary step 120" in out
    assert "· done" in out and "no swap in progress" not in out
    assert summary_line(doc) == f"gen 3 | world 4 | ranks 4 running | spares 1 | swap s-1 {phase}"
    marks = {s.phase: s.mark for s in swap_timeline(swap_plan(phase))}
    order = list(PHASE_TIMES)
    assert [marks[p] for p in order] == (["done"] * order.index(phase) + ["current"]
                                         + ["pending"] * (len(order) - order.index(phase) - 1))


def test_finished_swaps_leave_the_active_view_and_list_as_recent():
    doc = run_doc(swaps={"s-1": swap_plan("done"), "s-2": {**swap_plan("aborted"), "id": "s-2"}})
    out = text(doc)
    assert "no swap in progress" in out and "recent swaps" in out
    assert row(out, "s-1").startswith("s-1 done") and row(out, "s-2").startswith("s-2 aborted")
    assert "2.00s" in out        # s-1 took pause -> done
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
    assert "unplanned" in out and "state from n0/0 (rank 0)" in out and "attempt 2" in out
    assert "– boundary" in out and "▶ send +1.20s" in out


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
    out = text(doc)
    assert "spares: none" in out
    assert row(out, "t9") == "t9 n1/1 (rank 3) migrate tpassctl waiting bad fan"
    assert summary_line(doc) == "gen 3 | world 4 | ranks 4 running | spares 0 | taints 1 waiting | no swap"


def test_quarantined_slot_shows_its_reason():
    doc = run_doc()
    doc["status"]["n0"]["workers"] = [worker(0, 0, "running"),
                                      worker(1, None, "quarantined", quarantine_reason="gpu1: ECC errors 12 > 0"),
                                      worker(2, 1, "running")]
    doc["taints"] = {"t1": {"id": "t1", "node_id": "n0", "slot": 1, "rank": 1, "effect": "migrate",
                            "source": "health", "reason": "gpu1: ECC", "state": "quarantined", "handled_by": "s-0"}}
    out = text(doc)
    assert row(out, "4001") == "1 - 4001 quarantined 0 - gpu1: ECC errors 12 > 0"
    assert row(out, "t1 ").startswith("t1 n0/1 (rank 1) migrate health quarantined")
    assert summary_line(doc) == "gen 3 | world 4 | ranks 4 running | spares 1 | quarantined 1 | no swap"


def test_health_verdicts_per_device():
    doc = run_doc(health={
        "n0": {"v": 1, "verdicts": [{"device": "gpu1", "status": "failing", "effect": "migrate",
                                     "reason": "ECC errors 12 > 0"},
                                    {"device": "gpu0", "status": "healthy", "effect": "none", "reason": "ok"}],
               "unavailable": {"nvml": "NVML Shared Library Not Found"}},
        "n1": {"v": 1, "verdicts": []}})
    out = text(doc)
    assert row(out, "gpu0") == "n0 gpu0 healthy none ok"
    assert row(out, "gpu1") == "n0 gpu1 failing migrate ECC errors 12 > 0"
    assert row(out, "nvml") == "n0 nvml unavailable NVML Shared Library Not Found"
    assert row(out, "no verdicts yet") == "n1 - no verdicts yet"
    assert "| unhealthy 1 |" in summary_line(doc)


def test_forming_closed_lost_and_waiting_runs():
    doc = run_doc(closed={"v": 1, "reason": "worker failed"})
    doc["generation"].update(state="forming", lost=["n1"], waiting=["n2"], reason="node n1 lost")
    out = text(doc)
    for fact in ("generation 3 forming", "node n1 lost", "closed: worker failed", "lost nodes: n1",
                 "waiting nodes: n2", "LOST"):
        assert fact in out, fact
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
    out = text(doc)
    assert "run " in out
    line = summary_line(doc)
    assert line.startswith("gen ") and "\n" not in line
    assert doc == before                       # rendering never mutates the document


def test_empty_doc_facts():
    out = text({})
    assert "no generation formed yet" in out and "spares: none" in out
    assert summary_line({}) == "gen - | world - | ranks 0 running | spares 0 | no swap"
    assert "no status published" in text({"run_id": "r", "status": {"n5": {}}})


# ---------------------------------------------------------------------------------------------- watch()
class FakeFetch:
    """Returns the scripted documents (an Exception instance is raised), then repeats the last one and says so."""

    def __init__(self, script: list) -> None:
        self.script = list(script)
        self.calls = 0
        self.exhausted = asyncio.Event()

    async def __call__(self) -> dict:
        self.calls += 1
        item = self.script[min(self.calls, len(self.script)) - 1]
        if self.calls >= len(self.script):
            self.exhausted.set()
        if isinstance(item, Exception):
            raise item
        return item


async def _watch_until_exhausted(fetch: FakeFetch, console: Console) -> None:
    task = asyncio.create_task(watch(fetch, interval=0, console=console))
    await asyncio.wait_for(fetch.exhausted.wait(), 5)
    await asyncio.sleep(0)  # let the last document be drawn
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


@pytest.mark.timeout(10)
def test_watch_off_a_terminal_prints_one_line_per_change_and_stops_on_cancel():
    swapping = run_doc(swaps={"s-1": swap_plan("send")})
    script = [run_doc(), run_doc(), swapping, swapping, ConnectionError("etcd down"), ConnectionError("etcd down"),
              run_doc()]
    buf = io.StringIO()
    console = Console(file=buf, width=60)
    assert not console.is_terminal
    asyncio.run(_watch_until_exhausted(FakeFetch(script), console))
    assert buf.getvalue().splitlines() == [
        "gen 3 | world 4 | ranks 4 running | spares 1 | no swap",
        "gen 3 | world 4 | ranks 4 running | spares 1 | swap s-1 send",
        "fetch failed: ConnectionError: etcd down",
        "gen 3 | world 4 | ranks 4 running | spares 1 | no swap",
    ]


@pytest.mark.timeout(10)
def test_watch_on_a_terminal_draws_the_dashboard_and_stops_on_cancel():
    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=True, color_system=None, _environ={})
    script = [run_doc(), ConnectionError("etcd down"), run_doc(swaps={"s-1": swap_plan("reform")})]
    asyncio.run(_watch_until_exhausted(FakeFetch(script), console))
    out = buf.getvalue()
    assert "run job-7" in out and "fetch failed: ConnectionError: etcd down" in out
    assert "▶ reform" in out


def big_run(nodes: int) -> dict:
    doc = run_doc()
    doc["generation"]["members"] = [{"node_id": f"n{i}", "group_rank": i, "addr": f"10.0.0.{i}", "nproc": 8,
                                     "rank_offset": 8 * i} for i in range(nodes)]
    doc["generation"]["world_size"] = 8 * nodes
    doc["status"] = {f"n{i}": {"time": T0, "workers": [worker(s, 8 * i + s, "running") for s in range(8)]
                               + [worker(8, None, "spare")]} for i in range(nodes)}
    doc["health"] = {f"n{i}": {"verdicts": [{"device": f"gpu{g}", "status": "healthy", "effect": "none",
                                             "reason": "ok"} for g in range(8)]} for i in range(nodes)}
    return doc


def test_a_big_run_gets_one_row_per_node_and_tables_only_where_something_happens():
    doc = big_run(12)
    doc["status"]["n5"]["workers"][3]["state"] = "dead"
    doc["health"]["n5"]["verdicts"][3].update(status="failing", effect="fail", reason="xid 79")
    doc["swaps"] = {"s-1": {**swap_plan("send"), "leaver": {"node": "n9", "slot": 1, "rank": 73},
                            "joiner": {"node": "n9", "slot": 8, "rank": 73}}}
    out = text(doc, now=T0 + 2.0)
    assert row(out, "n5 member 5") == "n5 member 5, ranks 40-47 1 dead, 7 running, 1 spare 17 12.5 2.0s"
    assert row(out, "n11 member 11") == "n11 member 11, ranks 88-95 8 running, 1 spare 17 12.5 2.0s"
    tables = [line.split()[0] for line in out.splitlines() if "status 2.0s old" in line]
    assert tables == ["n5", "n9"]              # only the node with a dead slot and the one swapping
    assert "spares: n0/8, n1/8" in out and "more (" not in out
    assert row(out, "gpu3") == "n5 gpu3 failing fail xid 79"
    assert "95 healthy devices not listed" in out and row(out, "gpu0") == ""
    assert summary_line(doc) == "gen 3 | world 96 | ranks 95/96 running | spares 12 | unhealthy 1 | swap s-1 send"


def test_a_big_run_lists_at_most_twelve_spares():
    out = text(big_run(20))
    assert "spares: n0/8, n1/8, n2/8" in out and "... 8 more (20 in all)" in out
    assert "160 healthy devices not listed" in out and "\nhealth" in out
