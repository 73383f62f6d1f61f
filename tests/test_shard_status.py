"""What mirroring sharded state costs, as an operator sees it: the status rows (tpassctl status --json), the live
view's summary, the console line of the event log (pure: records, tui, console)."""

from __future__ import annotations

from tpassrun.ops.console import Describer
from tpassrun.ops.tui import mirror_usage, summary_line
from tpassrun.records import NodeStatus, WorkerRow

MIB = 1 << 20


def _doc() -> dict:
    a = NodeStatus("a", (WorkerRow(0, "running", rank=0, step=5, managed=True, shard_held=3 * MIB,
                                   shard_bytes=MIB, shard_mirrored=4, shard_sent=5 * MIB),
                         WorkerRow(1, "spare", spare=True, managed=True)), mirror_held=2 * MIB)
    b = NodeStatus("b", (WorkerRow(0, "running", rank=1, step=5, managed=True, shard_held=3 * MIB,
                                   shard_bytes=MIB, shard_mirrored=5, shard_sent=5 * MIB),), mirror_held=MIB)
    return {"generation": {"number": 0, "state": "active", "world_size": 2},
            "status": {s.node_id: s.to_json() for s in (a, b)}}


def test_status_rows_carry_the_mirror_figures_and_old_rows_read_as_before():
    row = WorkerRow(0, "running", rank=0, shard_held=3 * MIB, shard_bytes=MIB, shard_mirrored=4, shard_sent=9)
    assert WorkerRow.from_json(row.to_json()) == row
    plain = WorkerRow(1, "running", rank=1)
    assert "shard_held" not in plain.to_json() and WorkerRow.from_json(plain.to_json()) == plain
    node = NodeStatus("a", (row,), mirror_held=7)
    assert NodeStatus.from_json(node.to_json()) == node


def test_the_live_view_says_what_the_mirror_costs():
    doc = _doc()
    assert mirror_usage(doc) == "mirror 3.0 MiB/rank local, 2.0 MiB/refresh, 3.0 MiB held for buddies"
    assert "mirror 3.0 MiB/rank local" in summary_line(doc)
    doc["status"] = {k: {**v, "workers": [w for w in v["workers"] if not w.get("shard_held")]}
                     for k, v in doc["status"].items()}
    for v in doc["status"].values():
        v.pop("mirror_held", None)
    assert mirror_usage(doc) is None and "mirror" not in summary_line(doc)


def test_the_console_says_where_a_ranks_shard_goes_and_what_it_costs():
    line = Describer().describe({"event": "shard_mirror", "rank": 1, "bytes_per_refresh": 2 * MIB, "local_held": 6 * MIB,
                   "interval": 1, "buddy": "b-123-x", "mirrored_step": None, "mono": 0.0})
    assert line is not None and "[rank 1]" in line and "2.0 MiB every 1 step(s)" in line and "6.0 MiB" in line


def test_the_console_says_when_a_ranks_shard_is_not_mirrored():
    # HSDP: a rank with declared replicas keeps local copies only (worker_shards._shard_retarget)
    line = Describer().describe({"event": "shard_mirror", "rank": 2, "bytes_per_refresh": 0, "local_held": 6 * MIB,
                                 "interval": 1, "buddy": None, "mirrored_step": None, "mono": 0.0})
    assert line is not None and "[rank 2]" in line and "not mirrored" in line and "6.0 MiB" in line
