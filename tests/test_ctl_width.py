"""tpassctl's output fits 80 columns (issue 28, item 6): its tables were cut at 80 columns (ids ending in an
ellipsis), its run list was one 160-column line per run. Now lines wrap, tables fold, and nothing a command
takes (a taint id, a run id, a node id) is cut."""

from __future__ import annotations

import io

import pytest

from tpassrun.ops.ctl_render import render_status, run_list_lines
from tpassrun.ops.ctl_width import columns, wrap
from tpassrun.ops.names import node_names
from tpassrun.ops.registry import RunEntry

REASON = "the fan of this node's second GPU reports 0 rpm since 03:12; the vendor asks for a reseat (ticket 12345)"


def test_a_line_wraps_at_words_each_continuation_indented_and_off_a_terminal_stays_whole():
    text = "I1128 22:24:27.561193 22326 tpassrun/agent] [node vm] " + REASON
    lines = wrap(text, 80)
    assert len(lines) == 3 and all(len(ln) <= 80 for ln in lines) and lines[1].startswith("    second GPU")
    assert " ".join(ln.strip() for ln in lines) == text
    assert wrap(text, None) == [text]
    assert all(len(ln) <= 40 for ln in wrap("x" * 100, 40))                  # a long id folds, never cut
    assert wrap("  item " + "y " * 50, 40)[1].startswith("      y")          # a list item stays an item


def test_the_width_is_columns_else_the_terminals_else_none():
    assert columns(io.StringIO(), {"COLUMNS": "80"}) == 80
    assert columns(io.StringIO(), {"COLUMNS": "12"}) == 40                   # no narrower than that
    assert columns(io.StringIO(), {}) is None                                # a pipe, a file: whole lines


def test_the_run_list_is_two_lines_a_run_within_80_columns_its_id_whole():
    now = 1_800_000_000.0
    r = RunEntry(run_id="e4bfde18-92ab-48a1-ba27-46c1fbda5370", endpoint="etcd-a.cluster.example:2379", pid=22326,
                 started=now - 3725, nproc=8, spares=1, script="train_ddp.py --steps 100000 --step-sleep 0.1 ...")
    lines = [w for ln in run_list_lines(r, now) for w in wrap(ln, 80)]
    assert lines[0].startswith("  e4bfde18-92ab-48a1-ba27-46c1fbda5370  started ") and "(up 1h02m)" in lines[0]
    assert all(len(ln) <= 80 for ln in lines), lines
    assert "train_ddp.py --steps 100000" in lines[1] and "8+1 slots" in "".join(lines) and "pid 22326" in "".join(lines)


def test_a_node_is_its_host_when_that_names_one_node_of_the_run():
    assert node_names(["gpu-a17-3301-9f2c", "gpu-a18.dc.example-4410-77aa"]) == {
        "gpu-a17-3301-9f2c": "gpu-a17", "gpu-a18.dc.example-4410-77aa": "gpu-a18"}
    both = node_names(["vm-1-aaaa", "vm-2-bbbb"])                # two agents on one host: host and pid
    assert both == {"vm-1-aaaa": "vm-1", "vm-2-bbbb": "vm-2"}
    same_pid = node_names(["vm-1-aaaa", "vm-1-bbbb", "db-7-cccc"])   # the pid too (two machines called vm)
    assert same_pid == {"vm-1-aaaa": "vm-1-aaaa", "vm-1-bbbb": "vm-1-bbbb", "db-7-cccc": "db"}


def test_status_tables_fit_80_columns_and_keep_ids_whole(capsys, monkeypatch):
    from tpassrun.ops.ctl import RunSnapshot
    from tpassrun.records import HealthRecord, NodeStatus, Taint, WorkerRow

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("NO_COLOR", "1")
    nodes = [f"gpu-node-{i:03d}.cluster.example.com-{3300 + i}-9f2c" for i in range(2)]
    rows = tuple(WorkerRow(slot=s, state="quarantined" if s == 3 else "running", rank=s, local_rank=s,
                           pid=100000 + s, step=123456, managed=True, total=200000) for s in range(4))
    taint = Taint.from_json({"v": 1, "id": "td67609b0ed91", "node_id": nodes[1], "slot": 3, "rank": 7,
                             "reason": REASON, "effect": "migrate", "state": "no spare free: waiting for one"})
    snap = RunSnapshot("e4bfde18-92ab-48a1-ba27-46c1fbda5370", taints={"td67609b0ed91": taint},
                       status={n: NodeStatus(node_id=n, workers=rows) for n in nodes},
                       health={nodes[0]: HealthRecord(node_id=nodes[0], verdicts=(
                           {"device": "gpu1", "status": "degraded", "effect": "migrate", "reason": REASON},))})
    render_status(snap)
    out = capsys.readouterr().out
    assert max(len(ln) for ln in out.splitlines()) <= 80, out
    assert "…" not in out, out
    assert "td67609b0ed91" in out and REASON.split()[0] in out
    assert "│ gpu-node-000 " in out and "│ gpu-node-001 " in out and "quarantined" in out   # the host, the state whole


def test_node_accepts_every_name_the_console_and_status_show():
    """``--node`` takes the id, the host (when it names one node), its short name, or ``host-pid`` (what the
    console and status show when hosts share a name: tpassrun/ops/names.py)."""
    from tpassrun.ops.ctl import RunSnapshot, _resolve_node
    from tpassrun.ops.registry import CtlError
    from tpassrun.records import NodeStatus

    ids = ["vm-11-aaaa", "vm-22-bbbb", "gpu7.example.com-5-cccc"]
    snap = RunSnapshot("r", status={n: NodeStatus(node_id=n, workers=()) for n in ids})
    assert _resolve_node(snap, "vm-22") == "vm-22-bbbb" and _resolve_node(snap, "vm-11-aaaa") == "vm-11-aaaa"
    assert _resolve_node(snap, "gpu7") == _resolve_node(snap, "gpu7.example.com") == "gpu7.example.com-5-cccc"
    with pytest.raises(CtlError, match="runs several nodes"):
        _resolve_node(snap, "vm")
