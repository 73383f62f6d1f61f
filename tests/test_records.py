"""The control plane's etcd records (tpassrun/records/__init__.py): round trips, strict decoding, one key layout."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from tpassrun.records import (
    Failure,
    Fallback,
    HealthRecord,
    Keys,
    MirrorKey,
    NodeStatus,
    Phase,
    RecordError,
    Report,
    RunClosed,
    SlotRef,
    SwapKind,
    SwapPlan,
    Taint,
    TaintEffect,
    WorkerRow,
    leader_of,
    load,
)

PLAN = SwapPlan(id="s-1", kind=SwapKind.UNPLANNED, generation=3, leaver=SlotRef("n0", 1, 5),
                joiner=SlotRef("n1", 2, 5), donor=SlotRef("n0", 0, 4), phase=Phase.SEND, reason="died",
                nodes=("n0", "n1"), boundary=17, joiner_addr=("10.0.0.2", 29500), light_b64="AAAA", attempt=1,
                excluded_spares=(("n1", 3),), taint_id=None, history=(("pause", 1.5), ("send", 2.0)))
SAMPLES = [
    PLAN,
    Report(node="n1", phase=Phase.PAUSE, candidate=4, steps=(4, 4), joiner_addr=("h", 1), extra={"nbytes": 3}),
    Taint(id="t1", effect=TaintEffect.MIGRATE, reason="ecc", source="tpassctl", node_id="n0", slot=2, local_rank=1,
          rank=7, time=12.5, home_node="n1", home_slot=3, handled_by="s-1", state="migrating"),
    Failure(node="n0", slot=1, rank=5, code=-9, step=17, light=True, generation=3, time=1.0, handled="plan"),
    Failure(node="n0", slot=1, rank=5, code=-9, step=17, light=True, generation=3, replicas=(1, 5)),
    Failure(node="n0", slot=1, rank=5, code=-9, step=17, light=True, generation=3, replicas=(5,), alone="ZeRO-1"),
    NodeStatus(node_id="n0", workers=(WorkerRow(slot=0, state="running", rank=0, local_rank=0, pid=10, step=3,
                                                managed=True), WorkerRow(slot=1, state="spare", spare=True)),
               addr="127.0.0.1", pid=4, generation=2, restart_count=1, time=3.0),
    HealthRecord(node_id="n0", time=1.0, taints=("h-1",), polls=3, unavailable={"nvml": "no GPU"},
                 verdicts=({"device": "gpu0", "status": "healthy"},)),
    Fallback(reason="no spare", generation=2, slot=1),
    RunClosed(reason="succeeded", node_id="n0", time=2.0), MirrorKey(key="ab" * 32),
]


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_round_trip_through_json(record):
    doc = json.loads(json.dumps(record.to_json()))
    assert doc["v"] == 1
    assert type(record).from_json(doc) == record


@pytest.mark.parametrize("doc", [
    None, 5, "x", [], {**PLAN.to_json(), "v": 2}, {k: v for k, v in PLAN.to_json().items() if k != "v"},
    {**PLAN.to_json(), "leaver": 5},                 # issue 11: a plan with `leaver: 5` killed the swapper
    {**PLAN.to_json(), "leaver": {"node": "n0", "slot": -1}},
    {**PLAN.to_json(), "joiner": None},
    {**PLAN.to_json(), "phase": "warp"},
    {**PLAN.to_json(), "generation": "3"},
    {**PLAN.to_json(), "generation": True},
    {**PLAN.to_json(), "joiner_addr": ["h", 70000]},
    {**PLAN.to_json(), "history": [["pause"]]},
    {**PLAN.to_json(), "nodes": "n0"},
    {**PLAN.to_json(), "id": None},
])
def test_a_malformed_swap_plan_is_one_typed_error(doc):
    with pytest.raises(RecordError):
        SwapPlan.from_json(doc)


@pytest.mark.parametrize("cls,doc", [
    (Taint, {"v": 1, "id": "t", "effect": "none"}),
    (Taint, {"v": 1, "id": "t", "effect": "migrate", "rank": "3"}),
    (Taint, {"v": 1, "effect": "migrate"}),
    (Failure, {"v": 1, "node": "n", "slot": 0, "rank": 0, "code": 1, "light": "yes", "generation": 0}),
    (NodeStatus, {"v": 1, "node_id": "n", "workers": [None]}),
    (NodeStatus, {"v": 1, "node_id": "n", "workers": {"slot": 0}}),
    (Report, {"v": 1, "node": "n", "phase": "pause", "steps": ["a"]}),
    (HealthRecord, {"v": 1, "verdicts": "all good"}),
    (Fallback, {"reason": "no version"}),
])
def test_malformed_records_raise_record_error(cls, doc):
    with pytest.raises(RecordError):
        cls.from_json(doc)


def test_load_skips_a_malformed_value_and_logs_it_once_per_revision(caplog):
    caplog.set_level(logging.WARNING, logger="tpassrun.records")
    for _ in range(50):   # the coordinator re-reads on every change
        assert load(SwapPlan.from_json, "/p/swaps/x", {"v": 1, "leaver": 5}, 7) is None
    assert len(caplog.records) == 1 and "/p/swaps/x" in caplog.text
    assert load(SwapPlan.from_json, "/p/swaps/x", None, 8) is None     # a new value: said again
    assert len(caplog.records) == 2
    assert load(SwapPlan.from_json, "/p/swaps/s-1", PLAN.to_json(), 9) == PLAN


def test_taint_names_its_slot_not_a_local_rank():
    taint = Taint.from_json({"v": 1, "id": "t", "effect": "exclude", "node_id": "n", "slot": 4})
    assert (taint.slot, taint.local_rank, taint.rank) == (4, None, None)
    assert taint.handled("s-2", "quarantined", slot=5).to_json()["slot"] == 5
    assert leader_of({"node_id": "n0"}) == "n0"
    with pytest.raises(RecordError):
        leader_of({"node": "n0"})


def test_keys_build_every_family_and_reject_bad_parts():
    keys = Keys("/tpassrun/v1/run/")
    assert keys.taint("t1") == "/tpassrun/v1/run/taints/t1"
    assert keys.failure("n0", 2) == "/tpassrun/v1/run/failures/n0-2"
    assert keys.swap("s-1") == "/tpassrun/v1/run/swaps/s-1"
    assert keys.report("s-1", 3, "n0") == "/tpassrun/v1/run/reports/s-1/3/n0"
    assert keys.reports("s-1", 3) == "/tpassrun/v1/run/reports/s-1/3/"
    assert keys.status("n0").endswith("/status/n0") and keys.health("n0").endswith("/health/n0")
    assert keys.fallback("n0").endswith("/fallbacks/n0")
    assert keys.family("taints") == "/tpassrun/v1/run/taints/"
    assert keys.relative(keys.swap("a")) == "swaps/a" and keys.last(keys.swap("a")) == "a"
    for bad in ("", "a/b"):
        with pytest.raises(ValueError):
            keys.taint(bad)
    with pytest.raises(ValueError):
        keys.family("generation")


def test_internals_key_table_matches_the_key_layout():
    """docs/internals.md's etcd key table names exactly the families of :class:`Keys`, with the same patterns."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "internals.md").read_text()
    section = text.split("## etcd key layout", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `P ([^`]+)` \|", section, flags=re.M)
    assert sorted(rows) == sorted(Keys.FAMILIES.values())
