"""Provenance of the records that steer a swap (tpassrun/records/provenance.py): pure tests of the MAC, the run key's
sources and what every reader does with a record that lacks a good MAC (issue 11)."""

from __future__ import annotations

import json
import logging
import os

import pytest

from tpassrun.plan.swap import transfer_key
from tpassrun.records import Keys, Phase, Report, SlotRef, SwapKind, SwapPlan, Taint, TaintEffect, load, provenance
from tpassrun.records.provenance import MAC_FIELD, RUN_KEY_ENV, RunKey, RunKeyError, run_key_from, seal
from tpassrun.rendezvous import RendezvousError, read_private_file, refuse_inline_secrets

pytestmark = pytest.mark.timeout(30)

PREFIX = "/tpassrun/v1/run-prov/"
KEYS = Keys(PREFIX)


def _plan(**changes) -> SwapPlan:
    base = dict(id="s-1", kind=SwapKind.PLANNED, generation=3, leaver=SlotRef("n1", 1, 1),
                joiner=SlotRef("n1", 2, 1), donor=None, phase=Phase.SEND, reason="taint", nodes=("n1",),
                boundary=5, joiner_addr=("10.0.0.1", 4000), secret="ab" * 32, history=(("pause", 1.5),))
    return SwapPlan(**{**base, **changes})


@pytest.fixture
def run_key():
    key = RunKey.generate()
    unregister = provenance.register(PREFIX, key)
    yield key
    unregister()


def _stored(doc: dict) -> dict:
    return json.loads(json.dumps(doc))       # what a reader gets back from etcd


def test_a_sealed_plan_reads_back_and_its_transfer_key_needs_the_run_key(run_key):
    key = KEYS.swap("s-1")
    doc = _stored(seal(key, _plan().to_json()))
    assert doc[MAC_FIELD].startswith("v1:")
    plan = load(SwapPlan.from_json, key, doc, 7)
    assert plan == _plan()
    # the transfer key derives from the run key: the secret read from etcd alone does not give it
    assert transfer_key(plan) is not None and transfer_key(plan) != transfer_key(_plan())
    assert plan.transfer_seed is not None and plan.transfer_seed not in json.dumps(doc)
    assert "transfer_seed" not in plan.to_json()
    # every agent with the same key derives the same transfer key
    other = load(SwapPlan.from_json, key, _stored(seal(key, _plan().to_json(), RunKey(run_key.root))), 8)
    assert transfer_key(other) == transfer_key(plan)


@pytest.mark.parametrize("forgery", ["no-mac", "altered", "other-key", "moved", "bad-version", "not-a-string"])
def test_a_plan_without_a_good_mac_is_refused_and_logged_once(run_key, forgery, caplog):
    key = KEYS.swap("s-forged-" + forgery)      # load logs once per key and revision
    doc = _plan(id="s-forged").to_json()
    if forgery == "no-mac":
        pass
    elif forgery == "altered":
        doc = seal(key, doc)
        doc["joiner_addr"] = ["6.6.6.6", 4000]
    elif forgery == "other-key":
        doc = seal(key, doc, RunKey.generate())
    elif forgery == "moved":                   # a genuine plan copied under another swap's key
        doc = seal(KEYS.swap("s-1"), doc)
    elif forgery == "bad-version":
        doc = {**doc, MAC_FIELD: "v0:" + seal(key, doc)[MAC_FIELD][3:]}
    else:
        doc = {**doc, MAC_FIELD: 12}
    with caplog.at_level(logging.WARNING, logger="tpassrun.records"):
        for _ in range(3):     # the coordinator re-reads on every change: one line, not one per read
            assert load(SwapPlan.from_json, key, _stored(doc), 41) is None
    lines = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert len(lines) == 1 and "refusing" in lines[0], lines


def test_reports_are_sealed_too_and_unsealed_types_are_not_checked(run_key):
    key = KEYS.report("s-1", 2, "n1")
    report = Report(node="n1", phase=Phase.TRANSFER, joiner_addr=("10.0.0.1", 4000))
    assert load(Report.from_json, key, _stored(seal(key, report.to_json())), 1) == report
    assert load(Report.from_json, key, _stored(report.to_json()), 2) is None     # a forged report: refused
    # a taint is an input (the operator's tpassctl writes them too): read without a MAC
    taint = Taint(id="t1", node_id="n1", local_rank=1, slot=1, rank=1, reason="r", effect=TaintEffect.MIGRATE,
                  source="tpassctl", time=1.0)
    assert load(Taint.from_json, KEYS.taint("t1"), _stored(taint.to_json()), 3) == taint


def test_without_a_run_key_records_are_neither_sealed_nor_checked():
    key = "/tpassrun/v1/other-run/swaps/s-1"
    assert MAC_FIELD not in seal(key, _plan().to_json())
    plan = load(SwapPlan.from_json, key, _stored(_plan().to_json()), 1)
    assert plan == _plan() and plan.transfer_seed is None
    assert transfer_key(plan) == transfer_key(_plan())


def test_a_run_key_applies_to_its_own_run_only(run_key):
    other = "/tpassrun/v1/run-prov-2/swaps/s-1"
    assert provenance.key_for(other) is None and provenance.key_for(KEYS.swap("s-1")) is run_key
    assert load(SwapPlan.from_json, other, _stored(_plan().to_json()), 1) is not None


def test_the_run_key_comes_from_a_private_file_or_the_environment_never_the_command_line(tmp_path):
    assert run_key_from({}, {}, read_private_file) is None
    from_env = run_key_from({}, {RUN_KEY_ENV: "0123456789abcdef0123"}, read_private_file)
    assert from_env == RunKey.from_text("0123456789abcdef0123")
    path = tmp_path / "run.key"
    path.write_text("0123456789abcdef0123\n")
    os.chmod(path, 0o644)
    with pytest.raises(RendezvousError, match="chmod 600"):
        run_key_from({"run_key_file": str(path)}, {}, read_private_file)
    os.chmod(path, 0o600)
    # the file wins over the environment; its trailing newline is not part of the key
    assert run_key_from({"run_key_file": str(path)}, {RUN_KEY_ENV: "x" * 20}, read_private_file) == from_env
    with pytest.raises(RunKeyError, match="too short"):
        run_key_from({}, {RUN_KEY_ENV: "short"}, read_private_file)
    with pytest.raises(RendezvousError, match="run_key_file"):
        refuse_inline_secrets({"run_key": "0123456789abcdef0123"})
    assert "root" not in repr(from_env) and from_env.fingerprint != RunKey.generate().fingerprint


def test_derived_keys_differ_by_purpose():
    key = RunKey.generate()
    assert len({key.derive("records"), key.derive("mirror"), key.derive("transfer/s-1/ab"), key.root}) == 4


def test_an_older_version_of_a_plan_written_back_is_a_replay():
    """A replayed plan carries a genuine MAC: the leader tells it by its history, which only ever grows."""
    from tpassrun.swapper.coordinator import is_replayed

    newest: dict = {}
    pause = _plan(phase=Phase.PAUSE, history=(("pause", 1.0),))
    send = pause.advance(Phase.TRANSFER, 2.0).advance(Phase.SEND, 3.0)
    done = send.advance(Phase.REFORM, 4.0).advance(Phase.DONE, 5.0)
    assert not is_replayed(newest, pause) and not is_replayed(newest, send) and not is_replayed(newest, send)
    assert not is_replayed(newest, done)
    assert is_replayed(newest, send) and is_replayed(newest, pause)      # a finished swap back into SEND
    assert not is_replayed(newest, _plan(id="s-2", phase=Phase.PAUSE))   # another plan is its own


# --- the rendezvous's own records (rendezvous/guard.py, records.rendezvous_guard) ---------------------------
def _gen_doc() -> dict:
    from tpassrun.rendezvous import Generation, GenState, Member

    return Generation(number=2, state=GenState.ACTIVE, members=(Member("n1", 0, "10.0.0.1", 2, 0),),
                      world_size=2).to_json()


RDZV_RECORDS = {
    "generation": (KEYS.prefix + "generation", _gen_doc),
    "bootstrap": (KEYS.prefix + "bootstrap/2", lambda: {"v": 1, "number": 2, "addr": "10.0.0.1", "port": 29500}),
    "nodes": (KEYS.node("n1"), lambda: {"v": 1, "node_id": "n1", "addr": "10.0.0.1", "nproc": 2}),
    "leader": (KEYS.prefix + "leader", lambda: {"v": 1, "node_id": "n1", "addr": "10.0.0.1", "pid": 7}),
    "closed": (KEYS.closed, lambda: {"v": 1, "reason": "succeeded", "node_id": "n1", "time": 1.5}),
}


@pytest.mark.parametrize("record", sorted(RDZV_RECORDS))
def test_the_rendezvous_guard_seals_each_record_to_its_key_and_refuses_others(record):
    from tpassrun.records import rendezvous_guard

    key, make = RDZV_RECORDS[record]
    run_key = RunKey.generate()
    guard = rendezvous_guard(run_key)
    doc = _stored(guard.seal(key, make()))
    assert doc[MAC_FIELD].startswith("v1:") and guard.problem(key, doc) is None and guard.foreign(key, doc) is None
    # a stranger (no MAC): refused, but not "another key": it says nothing about the job's agents
    assert "no MAC" in guard.problem(key, make()) and guard.foreign(key, make()) is None
    # moved under another key of the run, or altered: refused
    assert guard.problem(KEYS.prefix + "elsewhere", doc) is not None
    assert guard.problem(key, {**doc, "addr": "6.6.6.6"}) is not None
    # sealed by an agent given another run key: refused, and said to be another key's
    other = _stored(rendezvous_guard(RunKey.generate()).seal(key, make()))
    assert guard.problem(key, other) is not None and "another run key" in guard.foreign(key, other)
    assert guard.foreign(key, {**make(), MAC_FIELD: "v1:xyz"}) is None        # not even a MAC's shape


def test_without_a_key_the_rendezvous_guard_seals_and_refuses_nothing_but_notices_a_seal():
    from tpassrun.records import rendezvous_guard
    from tpassrun.rendezvous import RecordGuard

    key, make = RDZV_RECORDS["generation"]
    for guard in (RecordGuard(), rendezvous_guard(None)):
        assert guard.seal(key, make()) == make() and guard.problem(key, make()) is None
        assert guard.foreign(key, make()) is None
    sealed = seal(key, make(), RunKey.generate())
    assert RecordGuard().foreign(key, sealed) is None                 # the rendezvous's default: as before
    assert "given none" in rendezvous_guard(None).foreign(key, sealed)
    assert rendezvous_guard(None).problem(key, sealed) is None        # accepted: an agent without a key checks nothing


@pytest.mark.parametrize("record", ["generation", "nodes", "leader", "closed"])
def test_readers_outside_the_rendezvous_refuse_its_records_without_a_good_mac(run_key, record, caplog):
    """tpassctl, the coordinator, the swap's joiner-address check and the mirror plane read these through load."""
    from tpassrun.records import RunClosed, generation_record, leader_of, node_info

    decode = {"generation": generation_record, "nodes": node_info, "leader": leader_of,
              "closed": RunClosed.from_json}[record]
    key, make = RDZV_RECORDS[record]
    assert load(decode, key, _stored(seal(key, make())), 1) is not None
    with caplog.at_level(logging.WARNING, logger="tpassrun.records"):
        assert load(decode, key, _stored(make()), 2) is None
        assert load(decode, key, _stored(seal(key, make(), RunKey.generate())), 3) is None
    assert caplog.text.count("refusing etcd record") == 2
    assert load(decode, "/tpassrun/v1/keyless-run/" + KEYS.relative(key), _stored(make()), 4) is not None


def test_a_refused_record_is_said_once_per_key_and_revision(caplog):
    from tpassrun.rendezvous.guard import RefusalLog, named

    said = RefusalLog()
    with caplog.at_level(logging.WARNING, logger="tpassrun.rendezvous.guard"):
        for revision in (5, 5, 5, 6, 6):
            said.say("k", revision, f"refusing k at {revision}")
    assert caplog.text.count("refusing k at 5") == 1 and caplog.text.count("refusing k at 6") == 1
    assert named("n1", "registration") == "node n1's registration"
    assert named("bad\nid", "leader record") == named(None, "leader record") == "the leader record"
