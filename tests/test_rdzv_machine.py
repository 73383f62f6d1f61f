"""Pure rendezvous decisions: views filled by hand, time passed in, no network."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tpassrun.rendezvous import EtcdConfig, Generation, GenState, NodeInfo, RendezvousError, RendezvousSettings
from tpassrun.rendezvous.machine import (
    Action,
    NodeEntry,
    RdzvView,
    closed_generation,
    decide,
    events_between,
    order_candidates,
    restart_generation,
)
from tpassrun.rendezvous.state import EventKind, Member

S = RendezvousSettings(run_id="r", min_nodes=2, max_nodes=3, last_call_timeout=10)


def nodes(*ids: str, spare: tuple[str, ...] = (), nproc: int = 2) -> dict[str, NodeEntry]:
    """Registrations in the given order (join_order = position)."""
    return {i: NodeEntry(NodeInfo(i, f"host-{i}", nproc, spare_node=i in spare, pid=1), order)
            for order, i in enumerate(ids, start=1)}


def active(*ids: str, number: int = 0, spares: tuple[str, ...] = (), **kw) -> Generation:
    members = tuple(Member(i, r, f"host-{i}", 2, 2 * r) for r, i in enumerate(ids))
    return Generation(number=number, state=GenState.ACTIVE, members=members, spare_nodes=spares,
                      world_size=2 * len(ids), **kw)


# --- forming the first generation -------------------------------------------------------------------------

def test_no_nodes_waits():
    d = decide(RdzvView(None, {}), 0.0, S)
    assert d.action is Action.WAIT
    assert "0/2" in d.reason


def test_below_min_waits_and_resets_last_call():
    d = decide(RdzvView(None, nodes("a"), quorum_since=5.0), 6.0, S)
    assert d.action is Action.WAIT and d.quorum_since is None


def test_min_reached_starts_last_call():
    d = decide(RdzvView(None, nodes("a", "b")), 100.0, S)
    assert d.action is Action.LAST_CALL
    assert d.quorum_since == 100.0 and d.wake_at == 110.0
    assert "last call" in d.reason


def test_last_call_running_waits_until_deadline():
    d = decide(RdzvView(None, nodes("a", "b"), quorum_since=100.0), 105.0, S)
    assert d.action is Action.WAIT and d.wake_at == 110.0 and d.quorum_since == 100.0


def test_last_call_over_forms_with_what_is_there():
    d = decide(RdzvView(None, nodes("a", "b"), quorum_since=100.0), 110.0, S)
    assert d.action is Action.FORM
    g = d.generation
    assert g.state is GenState.ACTIVE and g.number == 0
    assert [m.node_id for m in g.members] == ["a", "b"]
    assert [m.group_rank for m in g.members] == [0, 1]
    assert [m.rank_offset for m in g.members] == [0, 2]
    assert g.world_size == 4 and g.spare_nodes == ()


def test_max_reached_forms_at_once_without_last_call():
    d = decide(RdzvView(None, nodes("a", "b", "c")), 0.0, S)
    assert d.action is Action.FORM
    assert [m.node_id for m in d.generation.members] == ["a", "b", "c"]


def test_nodes_beyond_max_become_spare_nodes_in_join_order():
    d = decide(RdzvView(None, nodes("a", "b", "c", "d", "e")), 0.0, S)
    assert d.generation.member_ids == ("a", "b", "c")
    assert d.generation.spare_nodes == ("d", "e")


def test_spare_node_agents_never_count_as_candidates():
    d = decide(RdzvView(None, nodes("s", "a", spare=("s",))), 0.0, S)
    assert d.action is Action.WAIT  # only one candidate
    d = decide(RdzvView(None, nodes("s", "a", "b", "c", spare=("s",))), 0.0, S)
    assert d.generation.member_ids == ("a", "b", "c")
    assert d.generation.spare_nodes == ("s",)


def test_zero_last_call_forms_at_min():
    s = replace(S, last_call_timeout=0)
    d = decide(RdzvView(None, nodes("a", "b")), 0.0, s)
    assert d.action is Action.FORM


def test_mixed_nproc_rank_offsets():
    ns = nodes("a", "b")
    ns["b"] = NodeEntry(NodeInfo("b", "host-b", 4, pid=2**31), 2)  # started after "a" (torchrun ranks the first round by address, pid)
    d = decide(RdzvView(None, ns, quorum_since=0.0), 100.0, S)
    assert [(m.rank_offset, m.nproc) for m in d.generation.members] == [(0, 2), (2, 4)]
    assert d.generation.world_size == 6


def test_decide_is_pure():
    view = RdzvView(None, nodes("a", "b"), quorum_since=1.0)
    assert decide(view, 3.0, S) == decide(view, 3.0, S)


# --- re-forming (restart) ---------------------------------------------------------------------------------

def test_reforming_keeps_survivor_ranks_then_newcomers():
    old = active("c", "a", "b", number=3)
    forming = restart_generation(old, "worker failed")
    assert forming.number == 4 and forming.state is GenState.FORMING
    # "a" died; "d" is new; join order in etcd says a, b, c, d but survivors keep their relative order
    d = decide(RdzvView(forming, nodes("b", "c", "d")), 0.0, S)
    assert d.action is Action.FORM
    assert d.generation.number == 4
    assert d.generation.member_ids == ("c", "b", "d")
    assert [m.group_rank for m in d.generation.members] == [0, 1, 2]


def test_reforming_needs_no_last_call():
    forming = restart_generation(active("a", "b"), "restart")
    d = decide(RdzvView(forming, nodes("a", "b")), 0.0, S)
    assert d.action is Action.FORM and "no last call" in d.reason


def test_reforming_below_min_waits():
    forming = restart_generation(active("a", "b"), "restart")
    d = decide(RdzvView(forming, nodes("b")), 0.0, S)
    assert d.action is Action.WAIT


def test_reforming_after_node_loss_promotes_spare_node_agents_into_the_lost_places():
    forming = restart_generation(active("a", "b", spares=("s", "t")), "node lost: b")
    d = decide(RdzvView(forming, nodes("a", "s", "t", spare=("s", "t"))), 0.0, S)
    assert d.action is Action.FORM and d.generation.number == 1
    assert d.generation.member_ids == ("a", "s")          # s joined first: it takes b's place (ranks 2, 3)
    assert [m.rank_offset for m in d.generation.members] == [0, 2]
    assert d.generation.spare_nodes == ("t",) and d.generation.world_size == 4
    # the lost node was group rank 0: the spare node takes group rank 0 (and ranks 0, 1); a keeps ranks 2, 3
    d = decide(RdzvView(forming, nodes("b", "s", spare=("s",))), 0.0, S)
    assert d.generation.member_ids == ("s", "b") and [m.rank_offset for m in d.generation.members] == [0, 2]
    # no member lost: nobody is promoted
    d = decide(RdzvView(forming, nodes("a", "b", "s", spare=("s",))), 0.0, S)
    assert d.generation.member_ids == ("a", "b") and d.generation.spare_nodes == ("s",)


def test_order_candidates_drops_dead_and_spare_agents():
    prev = active("x", "y", "z").members
    got = order_candidates(prev, nodes("z", "s", "new", "x", spare=("s",)).values())
    assert [e.node_id for e in got] == ["x", "z", "new"]


# --- active generation annotations ------------------------------------------------------------------------

def test_active_up_to_date_is_idle():
    g = active("a", "b")
    assert decide(RdzvView(g, nodes("a", "b")), 0.0, S).action is Action.IDLE


def test_lost_member_is_marked_lost_not_removed():
    g = active("a", "b")
    d = decide(RdzvView(g, nodes("a")), 0.0, S)
    assert d.action is Action.UPDATE
    assert d.generation.lost == ("b",) and d.generation.member_ids == ("a", "b")
    assert d.generation.number == g.number
    # deciding again on the annotated record does nothing more
    assert decide(RdzvView(d.generation, nodes("a")), 0.0, S).action is Action.IDLE


def test_lost_spare_node_is_removed_and_marked_lost():
    g = active("a", "b", "c", spares=("s",))
    d = decide(RdzvView(g, nodes("a", "b", "c")), 0.0, S)
    assert d.generation.spare_nodes == () and d.generation.lost == ("s",)


def test_newcomer_with_room_waits():
    g = active("a", "b")
    d = decide(RdzvView(g, nodes("a", "b", "c")), 0.0, S)
    assert d.action is Action.UPDATE and d.generation.waiting == ("c",)
    assert "waiting" in d.reason


def test_newcomer_when_full_becomes_spare_node():
    g = active("a", "b", "c")
    d = decide(RdzvView(g, nodes("a", "b", "c", "d")), 0.0, S)
    assert d.generation.spare_nodes == ("d",) and d.generation.waiting == ()


def test_waiting_counts_against_room():
    g = active("a", "b", waiting=("c",))
    d = decide(RdzvView(g, nodes("a", "b", "c", "d")), 0.0, S)
    assert d.generation.waiting == ("c",) and d.generation.spare_nodes == ("d",)


def test_spare_node_agent_joins_active_as_spare_even_with_room():
    g = active("a", "b")
    d = decide(RdzvView(g, nodes("a", "b", "s", spare=("s",))), 0.0, S)
    assert d.generation.spare_nodes == ("s",) and d.generation.waiting == ()


def test_waiting_node_that_left_is_dropped():
    g = active("a", "b", waiting=("c",))
    d = decide(RdzvView(g, nodes("a", "b")), 0.0, S)
    assert d.generation.waiting == () and d.generation.lost == ()


def test_lost_node_coming_back_stays_lost_while_ranks_are_placed_on_it():
    g = active("a", "b", lost=("b",))
    assert decide(RdzvView(g, nodes("a", "b")), 0.0, S).action is Action.IDLE
    # one of its two ranks moved elsewhere by a swap, the other still placed on it: lost until the next generation
    half = replace(g, assignments={"2": {"node": "a", "slot": 2}})
    assert half.placed("b") == (3,) and decide(RdzvView(half, nodes("a", "b")), 0.0, S).action is Action.IDLE


def test_a_lost_member_back_with_all_its_ranks_moved_elsewhere_serves_as_a_spare_node():
    """A recovery spread b's ranks over other nodes' spare slots (no node took b's place): when b's link heals it
    is a spare node of this generation (it waited idle in the rendezvous until the next restart before)."""
    g = active("a", "b", "c", lost=("b",), assignments={"2": {"node": "a", "slot": 2}, "3": {"node": "c", "slot": 2}})
    assert g.placed("b") == () and g.placed("a") == (0, 1, 2)
    d = decide(RdzvView(g, nodes("a", "b", "c")), 0.0, S)
    assert d.action is Action.UPDATE and "back as a spare node" in d.reason
    assert d.generation.lost == () and d.generation.spare_nodes == ("b",) and d.generation.includes("b")
    assert [k for k, _n, _r in events_between(g, d.generation)] == [EventKind.SPARE_NODE_JOINED]
    # not back yet: nothing changes
    assert decide(RdzvView(g, nodes("a", "c")), 0.0, S).action is Action.IDLE


def test_member_lost_and_spare_joined_in_one_update():
    g = active("a", "b", "c")
    d = decide(RdzvView(g, nodes("a", "c", "d")), 0.0, S)
    assert d.generation.lost == ("b",) and d.generation.spare_nodes == ("d",)


def test_closed_run_is_idle():
    g = closed_generation(active("a", "b"), "done")
    assert decide(RdzvView(g, nodes("a", "b", "c")), 0.0, S).action is Action.IDLE
    assert decide(RdzvView(None, nodes("a", "b"), closed=True), 0.0, S).action is Action.IDLE


def test_closed_generation_without_any_record():
    g = closed_generation(None, "bye")
    assert g.state is GenState.CLOSED and g.number == 0 and g.reason == "bye"


# --- events derived from record changes -------------------------------------------------------------------

def kinds(old, new):
    return [(k.value, n) for k, n, _ in events_between(old, new)]


def test_events_first_generation_and_no_change():
    g = active("a", "b")
    assert kinds(None, g) == [("generation_changed", None)]
    assert kinds(g, g) == []
    assert kinds(g, g.with_revision(99)) == []  # the revision is not part of the value


def test_events_annotations():
    g = active("a", "b", "c")
    assert kinds(g, replace(g, lost=("b",))) == [("node_lost", "b")]
    assert kinds(g, replace(g, waiting=("d",))) == [("node_waiting", "d")]
    assert kinds(g, replace(g, spare_nodes=("d",))) == [("spare_node_joined", "d")]


def test_events_restart_swap_close():
    g = active("a", "b")
    assert kinds(g, restart_generation(g, "x")) == [("generation_changed", None)]
    swapped = replace(active("a", "s", number=1), swap_id="sw1")
    assert kinds(g, swapped) == [("generation_changed", None)]
    assert kinds(g, replace(g, assignments={"0": ["a", 0]})) == [("generation_changed", None)]
    closed = closed_generation(g, "done")
    assert kinds(g, closed) == [("closed", None)]
    assert kinds(closed, closed_generation(g, "again")) == []


# --- JSON and configuration -------------------------------------------------------------------------------

def test_generation_json_round_trip():
    g = active("a", "b", number=7, spares=("s",), swap_id="sw", assignments={"3": ["b", 1]},
               bootstrap=("10.0.0.1", 29500), waiting=("w",), lost=("x",))
    doc = g.to_json()
    assert doc["v"] == 1
    assert Generation.from_json(doc) == g


def test_generation_json_rejects_other_versions():
    doc = active("a").to_json()
    doc["v"] = 2
    with pytest.raises(ValueError, match="schema version"):
        Generation.from_json(doc)


def test_node_json_round_trip():
    n = NodeInfo("n", "h", 4, spares=1, spare_node=True, pid=42)
    assert NodeInfo.from_json(n.to_json()) == n


def test_etcd_config_from_endpoint():
    c = EtcdConfig.from_endpoint("https://a:1,b", {"cacert": "/ca", "user": "u", "password": "p",
                                                    "read_timeout": "5", "etcd_prefix": "/x"})
    assert c.endpoints == (("a", 1), ("b", 2379))
    assert c.protocol == "https" and c.tls and c.cacert == "/ca"
    assert c.user == "u" and c.read_timeout == 5 and c.prefix == "/x"
    assert EtcdConfig.from_endpoint("[::1]:3000", {}).endpoints == (("::1", 3000),)
    assert EtcdConfig.from_endpoint("h", {"username": "u", "password": "p"}).user == "u"
    members = EtcdConfig.from_endpoint("http://a:1/, [::1] ,b:3", {})
    assert members.endpoints == (("a", 1), ("::1", 2379), ("b", 3)) and members.display == "a:1,[::1]:2379,b:3"


@pytest.mark.parametrize("endpoint,conf", [("", {}), ("h:notaport", {}), ("h:70000", {}),
                                            ("h", {"user": "u"}), ("h", {"read_timeout": "-1"}),
                                            ("ftp://h", {}), ("http://h", {"protocol": "https"}),
                                            (":::", {}), ("[::1", {}), ("a:1,[::1", {}), ("h:0", {})])
def test_etcd_config_errors_are_rendezvous_errors(endpoint, conf):
    with pytest.raises(RendezvousError):
        EtcdConfig.from_endpoint(endpoint, conf)


def test_settings_from_conf():
    s = RendezvousSettings.from_conf("r", 1, 4, {"join_timeout": "7", "last_call_timeout": "0",
                                                  "close_timeout": "3", "lease_ttl": "2"})
    assert (s.join_timeout, s.last_call_timeout, s.close_timeout, s.lease_ttl) == (7, 0, 3, 2)
    assert RendezvousSettings.from_conf("r", 1, 1, {"timeout": "900"}).join_timeout == 900
    assert RendezvousSettings.from_conf("r", 1, 1, {"timeout": "900", "join_timeout": "5"}).join_timeout == 5
    ka = RendezvousSettings.from_conf("r", 1, 1, {"keep_alive_interval": "2", "keep_alive_max_attempt": "4"})
    assert ka.lease_ttl == 8
    assert RendezvousSettings.from_conf("r", 1, 1, {"heartbeat_timeout": "6"}).lease_ttl == 6
    assert RendezvousSettings.from_conf("r", 1, 1, {"etcd_prefix": "/p"}).run_prefix == "/p/r/"
    assert RendezvousSettings.from_conf("r", 1, 1, {}).lease_ttl == 10


@pytest.mark.parametrize("kw", [dict(min_nodes=0), dict(min_nodes=3, max_nodes=2), dict(run_id="a/b"),
                                dict(lease_ttl=0.5)])
def test_settings_validation(kw):
    base = dict(run_id="r", min_nodes=1, max_nodes=2)
    with pytest.raises(RendezvousError):
        RendezvousSettings(**{**base, **kw})


def test_first_round_ranks_by_address_then_pid_like_torchrun_later_rounds_keep_ranks():
    ns = {"late": NodeEntry(NodeInfo("late", "h", 1, pid=200), 1), "early": NodeEntry(NodeInfo("early", "h", 1, pid=100), 2)}
    d = decide(RdzvView(None, ns, quorum_since=0.0), 100.0, S)
    assert [m.node_id for m in d.generation.members] == ["early", "late"]


def test_formed_is_the_last_restarts_number_kept_by_annotations_and_read_back():
    """Generation.formed: since when plans, deaths and mirror copies count (tpassrun/swapper/agentport.py AgentPort.epoch), the
    same on every agent, a spare node that joined later too (its own spawn generation is the one it joined in)."""
    d = decide(RdzvView(None, nodes("a", "b", "c")), 0.0, S)
    assert d.generation.formed == 0
    g = replace(d.generation, number=5, formed=3)             # two swaps committed since the restart of 3
    annotated = decide(RdzvView(g, nodes("a", "b", "c", "d")), 0.0, S).generation      # d: a new spare node
    assert annotated.spare_nodes == ("d",) and annotated.formed == 3
    assert Generation.from_json(annotated.to_json()) == annotated
    old = annotated.to_json()
    del old["formed"]                                          # a record written without it: its own number
    assert Generation.from_json(old).formed == 5
    again = decide(RdzvView(restart_generation(g, "x"), nodes("a", "b")), 0.0, S).generation
    assert again.number == 6 and again.formed == 6


def test_the_package_exports_resolve_lazily_and_the_endpoint_grammar_needs_no_grpc():
    """The launcher checks ``--rdzv-endpoint`` with ``config.split_endpoint`` before anything connects: that must
    not import aetcd and gRPC (most of a malformed endpoint's second)."""
    import subprocess
    import sys

    import tpassrun.rendezvous as rdzv

    assert set(rdzv.__all__) == set(rdzv._EXPORTS)
    assert all(getattr(rdzv, name) is not None for name in rdzv.__all__)
    probe = ("import sys; from tpassrun.rendezvous.config import split_endpoint; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('aetcd', 'grpc')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
