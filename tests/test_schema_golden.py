"""One schema (issue 23): every record, rendezvous value and channel message written by the one codec
(tpassrun/schema) is byte for byte what the hand-written codecs wrote, and reads back.

``tests/golden/schema.json`` was captured from the hand-written ``to_json`` / ``encode`` of commit b9502b2, before
the codec existed: never regenerate it from the code it checks. Per sample it holds the ``to_json`` dict as
``json.dumps`` writes it (key order too), the bytes etcd stores (``rendezvous.etcd_io``: sorted keys, compact) and
the same record sealed with a fixed run key (old records still verify, the seal signs the same canonical bytes).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from tpassrun.channel import protocol as P
from tpassrun.health import TaintEffect
from tpassrun.records import (
    Failure,
    Fallback,
    HealthRecord,
    MirrorKey,
    Move,
    NodeStatus,
    Phase,
    RecordError,
    Report,
    RunClosed,
    SlotRef,
    SwapKind,
    SwapPlan,
    Taint,
    WorkerRow,
    provenance,
)
from tpassrun.records.pool import Claim, HistoryEntry, JobSpec, PoolInfo, PoolNode
from tpassrun.rendezvous.state import Bootstrap, Closed, Generation, GenState, Leader, Member, NodeInfo
from tpassrun.schema import SchemaError, dump, load

GOLDEN = Path(__file__).resolve().parent / "golden" / "schema.json"
KEY = provenance.RunKey.from_text("golden-run-key-0123456789abcdef")
ETCD_KEY = "/tpassrun/v1/golden/"

SPEC = JobSpec(run_id="jobA", endpoint="127.0.0.1:2379", rdzv_conf="etcd_prefix=/x", nproc_per_node=2,
               entrypoint="train.py", args=("--steps", "5"), env={"A": "1"}, cwd="/w", run_key_box="ab12",
               nnodes="1:2", max_restarts=3)
ROW = WorkerRow(slot=1, state="running", rank=5, local_rank=1, pid=77, step=12, managed=True, last_step_ms=3.5,
                total=100, quarantine_reason=None, replicas=(1, 5))
SHARDED_ROW = WorkerRow(slot=0, state="running", rank=4, pid=70, step=12, managed=True, shard_held=1 << 20,
                        shard_bytes=4096, shard_mirrored=11, shard_sent=8192, shard_interval=2)
MOVE = Move(leaver=SlotRef(node="n2", slot=0, rank=4), joiner=SlotRef(node="s0", slot=1, rank=None),
            donor=SlotRef(node="n0", slot=0, rank=0), joiner_addr=("10.0.0.9", 4000))
MEMBERS = (Member(node_id="a", group_rank=0, addr="10.0.0.1", nproc=2, rank_offset=0),
           Member(node_id="b", group_rank=1, addr="10.0.0.2", nproc=2, rank_offset=2, spares=1, role="trainer"))
WORLD = P.WorldSpec(rank=3, world_size=4, role_rank=3, role_world_size=4, group_rank=1, local_world_size=2,
                    group_world_size=2)

RECORDS: dict[str, Any] = {
    "taint_full": Taint(id="t1", effect=TaintEffect.MIGRATE, reason="ecc", source="tpassctl", node_id="n0", slot=2,
                        local_rank=1, rank=7, time=12.5, device="gpu1", metric="ecc", status="fail", home_node="n1",
                        home_slot=3, handled_by="s-1", state="migrating"),
    "taint_min": Taint(id="t2", effect=TaintEffect.EXCLUDE, reason="", source="health"),
    "taint_int_time": Taint(id="t3", effect=TaintEffect.FAIL, reason="x", source="health", time=3),
    "failure_full": Failure(node="n0", slot=1, rank=5, code=-9, step=17, light=True, generation=3, time=1.0,
                            handled="plan", reason="why", replicas=(1, 5), alone="", sharded=True),
    "failure_min": Failure(node="n0", slot=0, rank=0, code=1, step=0, light=False, generation=0),
    "failure_alone": Failure(node="n0", slot=1, rank=5, code=-9, step=17, light=True, generation=3, replicas=(5,),
                             alone="ZeRO-1"),
    "fallback_full": Fallback(reason="no spare", generation=2, slot=1),
    "fallback_min": Fallback(reason=""),
    "status_full": NodeStatus(node_id="n0", workers=(ROW, SHARDED_ROW, WorkerRow(slot=2, state="spare", spare=True)),
                              addr="127.0.0.1", pid=4, generation=2, restart_count=1, time=3.0, mirror_held=1 << 30),
    "status_min": NodeStatus(node_id="n1", workers=()),
    "row_quarantined": WorkerRow(slot=3, state="quarantined", quarantine_reason="ecc"),
    "health_full": HealthRecord(node_id="n0", time=1.0, taints=("h-1", "h-2"), polls=3, unavailable={"nvml": "no GPU"},
                                readings=({"device": "gpu0", "metric": "temp", "value": 71.5},),
                                verdicts=({"device": "gpu0", "status": "healthy"},)),
    "health_min": HealthRecord(node_id="n0"),
    "closed": RunClosed(reason="succeeded", node_id="n0", time=2.0),
    "closed_min": RunClosed(reason="failed"),
    "mirror_key": MirrorKey(key="ab" * 32),
    "slot_ref": SlotRef(node="n0", slot=1, rank=None),
    "move": MOVE,
    "plan_single": SwapPlan(id="s-1", kind=SwapKind.UNPLANNED, generation=3, leaver=SlotRef("n0", 1, 5),
                            joiner=SlotRef("n1", 2, 5), donor=SlotRef("n0", 0, 4), phase=Phase.SEND, reason="died",
                            nodes=("n0", "n1"), boundary=17, joiner_addr=("10.0.0.2", 29500), light_b64="AAAA",
                            attempt=1, excluded_spares=(("n1", 3),), taint_id="t1", release=True,
                            history=(("pause", 1.5), ("send", 2.0)), secret="cd" * 16, outcome=None, restore=True,
                            shard_from=("10.0.0.3", 5000), shard_node="n0", superseded=True, replica_held=(4, 5)),
    "plan_node": SwapPlan(id="n-1", kind=SwapKind.NODE, generation=4, leaver=MOVE.leaver, joiner=MOVE.joiner,
                          donor=MOVE.donor, phase=Phase.ABORTED, reason="node lost", nodes=("n0", "s0"),
                          moves=(MOVE, Move(leaver=SlotRef("n2", 1, 5), joiner=SlotRef("s0", 0, None))),
                          lost_node="n2", light_from={4: "n3", 5: "n3"}, replaces="s0", store=("10.0.0.1", 29400),
                          store_host="n0", catch_up=(Move(SlotRef("n0", 0, 0), SlotRef("n0", 0, 0), SlotRef("n1", 0, 2)),),
                          shards_from={4: "n3"}, lost_also=("n4",), replacing={"n2": "s0", "n4": "s1"},
                          outcome="a second fault", history=(("pause", 1),)),
    "plan_min": SwapPlan(id="s-2", kind=SwapKind.PLANNED, generation=0, leaver=SlotRef("n0", 0, 0),
                         joiner=SlotRef("n1", 0), donor=None, phase=Phase.PAUSE, reason="", nodes=()),
    "report_full": Report(node="n1", phase=Phase.PAUSE, ok=False, candidate=4, steps=(4, 4), failed_steps=(5,),
                          post_commit=(6,), dead_steps=(4, 3), rings=(3, 4), dead_ring=(4,), mirror_steps=(2, 4),
                          mirror_addr=("10.0.0.4", 6000), final=True, joiner_addr=("h", 1), light_b64="QQ==",
                          error="boom", extra={"nbytes": 3, "nested": {"a": [1, 2]}}, held={4: (3, 4)},
                          joiner_addrs={4: ("h2", 2)}, stops={0: (0, 9, False), 2: (1, 8, True)},
                          shard_held={4: (2,)}, backs={2: 7}, replicas={0: (0, 2)}),
    "report_min": Report(node="n1", phase=Phase.DONE),
    "pool_info": PoolInfo(name="p1", created=12.25, fingerprint="abc123"),
    "pool_node": PoolNode(node_id="p1", host="h", nproc=2, since=5.0),
    "pool_node_serving": PoolNode(node_id="p2", host="h", nproc=4, since=5.0, state="serving", job="jobA"),
    "job_spec": SPEC,
    "job_spec_min": JobSpec(run_id="j", endpoint="e", rdzv_conf="", nproc_per_node=1, entrypoint="x", args=()),
    "claim": Claim(node_id="p1", job="jobA", claimer="leader", priority=3, since=1.0, reason="node lost", spec=SPEC,
                   waited=2.5),
    "claim_min": Claim(node_id="p1", job="jobA", claimer="leader", priority=0, since=1.0, reason=""),
    "history": HistoryEntry(time=1.0, node_id="p1", event="claimed", job="jobA", detail="for n2"),
    "history_min": HistoryEntry(time=1.0, node_id="p1", event="joined"),
    "node_info": NodeInfo(node_id="n", addr="h", nproc=4, spares=1, spare_node=True, pid=42, role="r", mirror_port=7),
    "node_info_min": NodeInfo(node_id="n", addr="h", nproc=1, pid=0),
    "member": MEMBERS[1],
    "generation": Generation(number=7, state=GenState.ACTIVE, members=MEMBERS, spare_nodes=("s",), world_size=4,
                             reason="swap", swap_id="sw", assignments={"3": {"node": "b", "slot": 1}},
                             bootstrap=("10.0.0.1", 29500), waiting=("w",), lost=("x",), formed=5),
    "generation_min": Generation(number=0, state=GenState.FORMING),
}

MESSAGES: dict[str, Any] = {
    "resume": P.Resume(),
    "send_state": P.SendState(addr="10.0.0.1", port=29400, swap_id="s-1", key="ab" * 32, rank=3,
                              replicated_only=True, rng=False),
    "reform": P.Reform(world=WORLD.with_store("10.0.0.1", 29500, "/tpassrun/s-1/0/", 7), rollback=True, resume=5),
    "exit": P.Exit(code=3), "raise": P.Raise(reason="no recovery"),
    "assign": P.Assign(world=WORLD, swap_id="s-1", key="cd" * 32, listen_host="10.0.0.2", timeout=5.0,
                       accept_timeout=15.0, max_bytes=1 << 20),
    "assign_mirror": P.Assign(world=WORLD, swap_id="s-2", key="cd" * 32, listen_host="h", attempt=2,
                              mirror_from=P.MirrorSource(target={"node": "n2", "addr": "h", "port": 7}, owner=3, step=40)),
    "light": P.Light(data="AAAA", step=17), "light_none": P.Light(data="AAAA"), "reserve": P.Reserve(nbytes=1 << 30),
    "abort": P.Abort(), "abort_join": P.AbortJoin(prefix="/p/"), "shard_rollback": P.ShardRollback(step=40),
    "mirror_info": P.MirrorInfo(buddy={"node": "n2", "addr": "h", "port": 1}, local=None),
    "catch_up": P.CatchUp(swap_id="n-x", key="ef" * 32, rank=1, listen_host="10.0.0.3", step=41),
    "break": P.Break(reason="node n3 was declared lost"), "watch": P.Watch(pid=7),
    "hello": P.Hello(pid=12, spare=True), "done": P.Done(step=99),
    "failed": P.Failed(step=4, error="RuntimeError: x", error_type="builtins.RuntimeError", failure="collective"),
    "raised": P.Raised(step=4, error="e", error_type="builtins.RuntimeError"),
    "replicas": P.Replicas(ranks=(1, 3), alone=""),
    "replicas_checked": P.ReplicasChecked(step=12, ok=False, action="repair", ranks=4, groups=1, nbytes=1 << 20,
                                          seconds=0.01, differ={"1": {"tensors": ["model.w"], "source": 0}},
                                          detail="rank 1 differs", recheck=True),
    "listening": P.Listening(port=4000, swap_id="s-1", attempt=1),
    "received": P.Received(ok=True, swap_id="s-1", nbytes=10, seconds=0.5, checksum="x", step=17, mirrored=True),
    "stranger": P.Stranger(swap_id="s-1", error="no key"), "light_ok": P.LightOk(ok=True, nbytes=10, step=17),
    "shard_rolled_back": P.ShardRolledBack(ok=False, step=40, error="no copy"),
    "mirror_info_request": P.MirrorInfoRequest(),
    "reformed": P.Reformed(ok=True, rank=3, world_size=4, generation=7, join_s=0.25, leave_s=0.5),
}


def etcd_bytes(doc: Any) -> str:
    """What ``rendezvous.etcd_io`` stores for a value (and what a reader's ``json.loads`` sees)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def capture() -> dict[str, Any]:
    out: dict[str, Any] = {"records": {}, "messages": {}}
    for name, record in RECORDS.items():
        doc = record.to_json()
        out["records"][name] = {"json": json.dumps(doc), "etcd": etcd_bytes(doc),
                                "sealed": etcd_bytes(provenance.seal(ETCD_KEY + name, doc, KEY))}
    for name, msg in MESSAGES.items():
        out["messages"][name] = {"line": P.encode(msg, slot=2).decode(), "bare": P.encode(msg).decode()}
    return out


if __name__ == "__main__":      # run once, at b9502b2, to capture the golden file
    GOLDEN.write_text(json.dumps(capture(), indent=1, sort_keys=True) + "\n")
    raise SystemExit(0)
GOLD = json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_a_record_is_written_as_before_and_reads_back(name):
    record, gold = RECORDS[name], GOLD["records"][name]
    doc = record.to_json()
    assert json.dumps(doc) == gold["json"]                  # the same keys, in the same order, the same values
    assert etcd_bytes(doc) == gold["etcd"]
    sealed = provenance.seal(ETCD_KEY + name, doc, KEY)
    assert etcd_bytes(sealed) == gold["sealed"]             # the seal signs the same canonical bytes
    old = json.loads(gold["sealed"])                        # a record sealed by the hand-written codec
    assert provenance.problem(ETCD_KEY + name, old, KEY) is None
    assert type(record).from_json(old) == record
    assert type(record).from_json(json.loads(gold["json"])) == record


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_a_message_is_encoded_as_before_and_decodes(name):
    msg, gold = MESSAGES[name], GOLD["messages"][name]
    assert P.encode(msg, slot=2).decode() == gold["line"] and P.encode(msg).decode() == gold["bare"]
    table = P.COMMANDS if type(msg) in P.COMMANDS.values() else P.REPLIES
    assert P.decode(gold["line"], table) == (msg, 2)


def test_every_record_type_and_message_kind_has_a_golden_sample():
    kinds = {type(m) for m in MESSAGES.values()}
    assert kinds == set(P.COMMANDS.values()) | set(P.REPLIES.values())
    assert set(GOLD["records"]) == set(RECORDS) and set(GOLD["messages"]) == set(MESSAGES)


def test_a_rows_shard_figures_are_written_only_with_its_held_bytes():
    row = WorkerRow(slot=3, state="spare", shard_bytes=9, shard_mirrored=2)
    assert "shard_bytes" not in row.to_json() and "total" not in row.to_json()
    assert WorkerRow.from_json(row.to_json()) == WorkerRow(slot=3, state="spare")


def test_the_rendezvous_writes_closed_leader_and_bootstrap_as_its_handler_did_by_hand():
    """At b9502b2 rendezvous/handler.py and leading.py wrote these three as dict literals (the first for
    records.RunClosed to read)."""
    assert json.dumps(Closed("done", "n0", 2.5).to_json()) == json.dumps({"v": 1, "reason": "done", "node_id": "n0",
                                                                          "time": 2.5})
    assert json.dumps(Leader("n0", "10.0.0.1", 7).to_json()) == json.dumps({"v": 1, "node_id": "n0",
                                                                            "addr": "10.0.0.1", "pid": 7})
    boot = {"v": 1, "number": 2, "addr": "10.0.0.1", "port": 29500}
    assert json.dumps(Bootstrap(2, "10.0.0.1", 29500).to_json()) == json.dumps(boot)
    assert Bootstrap.from_json(boot) == Bootstrap(2, "10.0.0.1", 29500)
    for bad in ({**boot, "port": 0}, {**boot, "port": True}, {**boot, "addr": None}, {**boot, "v": 2}):
        with pytest.raises(ValueError):
            Bootstrap.from_json(bad)
    assert RunClosed.from_json(Closed("done", "n0", 2.5).to_json()) == RunClosed("done", "n0", 2.5)


def _without(doc: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != key}


def _doc(name: str) -> dict[str, Any]:
    return json.loads(GOLD["records"][name]["json"])


BAD: list[tuple[type, Any]] = [
    (Taint, None), (Taint, {**_doc("taint_full"), "v": 2}), (Taint, _without(_doc("taint_full"), "v")),
    (Taint, {**_doc("taint_full"), "slot": -1}), (Taint, {**_doc("taint_full"), "rank": True}),
    (Taint, {**_doc("taint_full"), "effect": "none"}), (Taint, {**_doc("taint_full"), "reason": None}),
    (Taint, {**_doc("taint_full"), "time": "1"}), (Taint, _without(_doc("taint_full"), "id")),
    (Failure, {**_doc("failure_full"), "replicas": [1, -5]}), (Failure, {**_doc("failure_full"), "light": 1}),
    (Failure, _without(_doc("failure_full"), "generation")), (Failure, {**_doc("failure_full"), "replicas": 5}),
    (Fallback, {**_doc("fallback_full"), "generation": -1}), (Fallback, [1]),
    (NodeStatus, {**_doc("status_full"), "workers": [{"slot": 0}]}),
    (NodeStatus, {**_doc("status_full"), "workers": [{"slot": 0, "state": "running", "total": -1}]}),
    (NodeStatus, {**_doc("status_full"), "mirror_held": -1}), (NodeStatus, {**_doc("status_full"), "workers": None}),
    (WorkerRow, "row"), (WorkerRow, {"slot": 0, "state": "spare", "replicas": [0, "1"]}),
    (HealthRecord, {**_doc("health_full"), "readings": [1]}), (HealthRecord, {**_doc("health_full"), "unavailable": "x"}),
    (HealthRecord, {**_doc("health_full"), "polls": 1.5}),
    (RunClosed, {**_doc("closed"), "node_id": 3}), (MirrorKey, {"v": 1}),
    (SlotRef, {"node": "n", "slot": "0"}), (Move, {**_doc("move"), "leaver": {"node": "n", "slot": 0}}),
    (Move, {**_doc("move"), "joiner_addr": ["h", 0]}), (Move, {**_doc("move"), "joiner_addr": ["h", 1, 2]}),
    (SwapPlan, {**_doc("plan_node"), "light_from": {"x": "n3"}}), (SwapPlan, {**_doc("plan_node"), "light_from": {"4": 3}}),
    (SwapPlan, {**_doc("plan_node"), "moves": [5]}), (SwapPlan, {**_doc("plan_node"), "replacing": {"a": 1}}),
    (SwapPlan, {**_doc("plan_node"), "excluded_spares": [["n", "1"]]}), (SwapPlan, {**_doc("plan_node"), "lost_also": [1]}),
    (SwapPlan, {**_doc("plan_node"), "store": ["h", 70000]}), (SwapPlan, {**_doc("plan_node"), "replica_held": [-1]}),
    (SwapPlan, {**_doc("plan_single"), "attempt": -1}), (SwapPlan, {**_doc("plan_single"), "kind": "warp"}),
    (Report, {**_doc("report_full"), "stops": {"0": [0, 9]}}), (Report, {**_doc("report_full"), "stops": {"0": [0, 9, 1]}}),
    (Report, {**_doc("report_full"), "held": {"a": [1]}}), (Report, {**_doc("report_full"), "backs": {"1": True}}),
    (Report, {**_doc("report_full"), "joiner_addrs": {"1": "h"}}), (Report, {**_doc("report_full"), "extra": 5}),
    (Report, {**_doc("report_full"), "dead_steps": [True]}), (Report, {**_doc("report_full"), "ok": None}),
    (PoolInfo, {**_doc("pool_info"), "created": None}), (PoolNode, {**_doc("pool_node"), "state": "busy"}),
    (PoolNode, {**_doc("pool_node"), "nproc": 0}), (JobSpec, {**_doc("job_spec"), "args": "x"}),
    (JobSpec, {**_doc("job_spec"), "env": {"A": 1}}), (JobSpec, {**_doc("job_spec"), "nproc_per_node": 0}),
    (Claim, {**_doc("claim"), "spec": {"run_id": "j"}}), (Claim, {**_doc("claim"), "priority": "1"}),
    (HistoryEntry, {**_doc("history"), "event": None}),
]


@pytest.mark.parametrize("cls,doc", BAD, ids=lambda x: x.__name__ if isinstance(x, type) else "")
def test_a_malformed_record_is_one_record_error_of_one_line(cls, doc):
    with pytest.raises(RecordError) as err:
        cls.from_json(doc)
    assert "\n" not in str(err.value)


BAD_RENDEZVOUS: list[tuple[type, Any]] = [
    (NodeInfo, {**_doc("node_info"), "v": 2}), (NodeInfo, _without(_doc("node_info"), "addr")),
    (Generation, {**_doc("generation"), "state": "warp"}), (Generation, _without(_doc("generation"), "number")),
    (Generation, {**_doc("generation"), "members": [{"node_id": "a"}]}),
]


@pytest.mark.parametrize("cls,doc", BAD_RENDEZVOUS, ids=lambda x: x.__name__ if isinstance(x, type) else "")
def test_a_malformed_rendezvous_record_is_a_value_error(cls, doc):
    with pytest.raises((ValueError, KeyError, TypeError)):
        cls.from_json(doc)



@pytest.mark.parametrize("name,key", [("claim", "released"), ("claim_min", "released"), ("pool_node", "agent"),
                                      ("pool_node_serving", "agent")])
def test_a_pool_record_written_before_its_newer_field_reads_as_its_default(name, key):
    """``Claim.released`` and ``PoolNode.agent`` came after the golden capture (the pool's give-back): the golden
    entries gained the key, last, as the pool's hand-written ``to_json`` wrote it; a record written without it (by
    the tpassrun before) still reads, as the field's default."""
    record, doc = RECORDS[name], json.loads(GOLD["records"][name]["json"])
    del doc[key]
    assert type(record).from_json(doc) == record


# --------------------------------------------------------------------------------------------- the smaller codecs
# ``GOLD["codecs"]`` was captured at 3fa4a79 from the hand-written codecs outside records/rendezvous/channel (the
# registry's RunEntry.to_json as json.dump wrote it, netwatch's LinkFigures.to_json, the credentials file an
# embedded etcd wrote, the mirror's frame metas): never regenerate it from the code it checks.
CODECS = GOLD["codecs"]
RUN_ENTRIES: dict[str, Any] = {
    "run_entry": dict(run_id="jobA", endpoint="127.0.0.1:2379", pid=42, node_id="n0", host="h1", started=12.5,
                      event_log="/l/ev.jsonl", log_dir="/l", credentials="/c/cred.json", rdzv_conf="cacert=/ca.pem",
                      nproc=2, spares=1, script="train.py --steps 5"),
    "run_entry_min": dict(run_id="j", endpoint="e:1", pid=1, host="h", started=1.0),
}


@pytest.mark.parametrize("name", sorted(RUN_ENTRIES))
def test_a_run_entry_is_written_as_before_and_reads_back(name):
    from tpassrun.ops.registry import RunEntry
    entry = RunEntry(**RUN_ENTRIES[name])
    assert json.dumps(entry.to_json()) == CODECS["registry"][name]      # what registry.register's json.dump writes
    assert RunEntry.from_json(json.loads(CODECS["registry"][name])) == entry



@pytest.mark.parametrize("doc", [None, [], {"v": 2}, {"run_id": "j", "endpoint": "e", "pid": 1},
                                 {"v": 1, "endpoint": "e", "pid": 1}, {"v": 1, "run_id": "j", "endpoint": "e", "pid": "1"},
                                 {"v": 1, "run_id": 3, "endpoint": "e", "pid": 1}])
def test_a_malformed_run_entry_is_one_value_error_of_one_line(doc):
    from tpassrun.ops.registry import RunEntry
    with pytest.raises(ValueError) as err:
        RunEntry.from_json(doc)
    assert "\n" not in str(err.value)


def _credentials_from(tmp_path: Path, text: str) -> tuple[str | None, str | None]:
    from tpassrun.rendezvous.config import _credentials
    path = tmp_path / "credentials.json"
    path.write_text(text)
    path.chmod(0o600)
    return _credentials({"credentials_file": str(path)}, {})


def test_the_credentials_file_is_written_as_the_embedded_etcd_wrote_it_and_reads_back(tmp_path):
    from tpassrun.rendezvous.config import Credentials
    gold = CODECS["credentials"]["credentials"]
    assert json.dumps(Credentials("root", "s3cr-et_x").to_json()) == gold    # embedded.py's json.dump
    assert _credentials_from(tmp_path, gold) == ("root", "s3cr-et_x")


@pytest.mark.parametrize("text", ["", "[]", '{"user": "root"}', '{"user": "root", "password": 5}',
                                  '{"user": null, "password": "x"}', "{"])
def test_a_malformed_credentials_file_is_one_rendezvous_error_of_one_line(tmp_path, text):
    """A password that is not a string used to be read as its str() ("5", "None"): now refused."""
    from tpassrun.rendezvous import RendezvousError
    with pytest.raises(RendezvousError) as err:
        _credentials_from(tmp_path, text)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["figures", "figures_min"])
def test_a_nodes_link_figures_are_written_as_before_and_read_back(name):
    """The figures ride in a node's health record (readings[].value), stored by rendezvous.etcd_io."""
    from tpassrun.agent.netwatch import LinkFigures
    figures = {"figures": LinkFigures(rtt_ms=1.5, step_ms=60.0, addr="10.0.0.1",
                                      sent_to={"10.0.0.2": (1048576.0, 12.0), "10.0.0.3": (5.0, 0.0)}),
               "figures_min": LinkFigures()}[name]
    gold = CODECS["netwatch"][name]
    assert json.dumps(figures.to_json()) == gold["json"] and etcd_bytes(figures.to_json()) == gold["etcd"]
    assert LinkFigures.from_json(json.loads(gold["etcd"])) == figures
    unsteady = dataclasses.replace(figures, steady=False)    # the newer field: written only when false
    assert json.loads(json.dumps(unsteady.to_json()))["steady"] is False
    assert LinkFigures.from_json(unsteady.to_json()) == unsteady


def test_a_mirror_listing_row_is_written_as_before_and_reads_back():
    from tpassrun.mirror import MirrorEntry, MirrorError
    entry = MirrorEntry(3, "light", 2, (7, 8), 7)
    assert json.dumps(entry.to_json()) == CODECS["mirror_entry"]["entry"]
    assert MirrorEntry.from_json(json.loads(CODECS["mirror_entry"]["entry"])) == entry
    for bad in ({**entry.to_json(), "versions": ["7"]}, {**entry.to_json(), "owner": "3"}, {"owner": 3}, [3]):
        with pytest.raises(MirrorError) as err:     # what the client's callers catch
            MirrorEntry.from_json(bad)
        assert "\n" not in str(err.value)


def _mirror_metas() -> dict[str, Any]:
    from tpassrun.mirror import MirrorEntry
    from tpassrun.mirror import meta as M
    return {"put": M.CopyRef(3, "light", 9, 2), "get": M.Get(3, "light", None, None), "get_at": M.Get(3, "light", 8, 2),
            "list": M.Select(None, None), "list_owner": M.Select(3, "light"), "drop": M.Drop(None, None, 2),
            "drop_all": M.Drop(1, "shard", None), "kept": M.Stored(True),
            "error": M.Failed("a copy of 9 bytes is over this store's item limit 3"), "got": M.Got(8, 2),
            "not_found": M.NotFound(), "dropped": M.Dropped(10),
            "listed": M.Listing((MirrorEntry(1, "shard", 0, (1,), 10), MirrorEntry(3, "light", 2, (7, 8), 7)), 17, 1 << 30)}


def test_every_mirror_frame_meta_is_written_as_before_and_reads_back():
    """Requests as mirror/client.py wrote them (dict literals), answers as MirrorServer._answer did."""
    from tpassrun.mirror import meta as M
    metas = _mirror_metas()
    assert set(metas) == set(CODECS["mirror"])
    for name, value in metas.items():
        assert M.encode(value).decode() == CODECS["mirror"][name], name
        assert M.read(type(value), CODECS["mirror"][name].encode()) == value, name


@pytest.mark.parametrize("cls,raw,says", [
    ("CopyRef", b'{"owner":"3","kind":"light","version":9,"epoch":2}', "mirror request: owner must be an integer, not '3'"),
    ("CopyRef", b'{"owner":3,"kind":"","version":9,"epoch":2}', "mirror request: kind must be a short string, not ''"),
    ("CopyRef", b'{"owner":3,"kind":"' + b"k" * 300 + b'","version":9,"epoch":2}', "must be a short string"),
    ("CopyRef", b'{"owner":3,"kind":"light","epoch":2}', "mirror request: version is missing"),
    ("Get", b'{"owner":3,"kind":"light","version":true}', "mirror request: version must be an integer, not True"),
    ("Select", b'{"owner":null,"kind":7}', "mirror request: kind must be a string, not 7"),
    ("Drop", b'[1]', "mirror request: not a JSON object (list)"),
    ("Drop", b'{"owner":', "malformed mirror frame meta"),
    ("Got", b'{"version":"8","epoch":2}', "mirror answer: version must be an integer, not '8'"),
    ("Listing", b'{"entries":[{"owner":1}],"bytes":1,"max_bytes":2}', "mirror answer entries[0]: kind is missing"),
])
def test_a_malformed_mirror_meta_is_one_mirror_error_of_one_line(cls, raw, says):
    """The server answers a request it cannot read BAD_REQUEST with this line; a client raises it."""
    from tpassrun.mirror import MirrorError
    from tpassrun.mirror import meta as M
    with pytest.raises(MirrorError) as err:
        M.read(getattr(M, cls), raw)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_repairs_head_is_written_as_before_and_reads_back():
    """replicas._send_objects wrote a dict literal: the encoded trees of two modules (a Linear, an Embedding: opaque
    to the codec), then each tensor's dtype and shape."""
    from tpassrun.worker.replicas import RepairHead
    trees = json.loads(CODECS["replicas"]["repair_head"])["objects"]
    heads = {"repair_head": RepairHead(trees, "", (("float32", (2, 3)), ("float32", (2,)), ("float32", (4, 2)))),
             "repair_head_error": RepairHead({}, "RuntimeError: cannot encode", ())}
    for name, head in heads.items():
        gold = CODECS["replicas"][name]
        assert json.dumps(dump(head), separators=(",", ":")) == gold
        assert load(RepairHead, json.loads(gold)) == head
    for bad in ({"objects": {}, "error": "", "specs": [["float32", [-1]]]}, {"objects": {}, "specs": []},
                {"objects": [], "error": "", "specs": []}, {"objects": {}, "error": "", "specs": [["float32"]]}):
        with pytest.raises(SchemaError) as err:
            load(RepairHead, bad)
        assert "\n" not in str(err.value)


def test_a_health_reading_and_verdict_are_written_as_before_and_read_back():
    """They ride in a node's health record (its readings and verdicts), as health/_types.py's to_json wrote them."""
    from tpassrun.health import HealthVerdict, Reading, Status
    samples = {"reading": Reading("gpu0", "temperature_c", 71.5, 12.25),
               "reading_error": Reading("gpu1", "ecc", None, 3, error="sensor offline"),
               "verdict": HealthVerdict("gpu0", Status.DEGRADED, TaintEffect.MIGRATE, "temperature_c 95 >= 90",
                                        "temperature_c", 4.5),
               "verdict_healthy": HealthVerdict("rank3", Status.HEALTHY, TaintEffect.NONE, "", None, 5)}
    for name, value in samples.items():
        gold = CODECS["health"][name]
        assert json.dumps(value.to_json()) == gold
        assert type(value).from_json(json.loads(gold)) == value
    verdict = json.loads(CODECS["health"]["verdict"])
    for bad in ({**verdict, "v": 2}, {**verdict, "status": "fine"}, {**verdict, "time": "4"}, _without(verdict, "device")):
        with pytest.raises(ValueError) as err:
            HealthVerdict.from_json(bad)
        assert "\n" not in str(err.value)


def test_a_mirror_target_is_written_as_before_and_reads_back():
    """What the agent hands its workers (mirror_info, a re-formed world's mirror source): the key in hex."""
    from tpassrun.mirror import MirrorError, MirrorTarget
    samples = {"target": MirrorTarget("n2", "10.0.0.2", 29600, bytes(range(32)), run_id="jobA", epoch=3, encrypt=True),
               "target_min": MirrorTarget("n1", "h", 1, b"\x00" * 32)}
    for name, target in samples.items():
        gold = CODECS["mirror_target"][name]
        assert json.dumps(target.to_json()) == gold
        assert MirrorTarget.from_json(json.loads(gold)) == target
    doc = json.loads(CODECS["mirror_target"]["target"])
    assert MirrorTarget.from_json({k: doc[k] for k in ("node", "addr", "port", "key")}) == \
        MirrorTarget("n2", "10.0.0.2", 29600, bytes(range(32)))          # run_id, epoch, encrypt: their defaults
    for bad in ({**doc, "key": "xyz"}, {**doc, "port": "29600"}, {**doc, "encrypt": "yes"}, _without(doc, "key"), None):
        with pytest.raises(MirrorError) as err:
            MirrorTarget.from_json(bad)
        assert "\n" not in str(err.value)
