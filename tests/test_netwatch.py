"""The link watch's pure parts (tpassrun/agent/netwatch): which node's link is degraded, and flaps told ridden out.

No network, no clock: figures in, verdicts out."""

from __future__ import annotations

import json

import pytest

from tpassrun.health import LinkPolicy, Policy
from tpassrun.agent.netwatch import DEGRADED, HEALTHY, SUSPECT, FlapBook, LinkFigures, LinkWatch, flap_line
from tpassrun.agent.netwatch._plan import inbound_loss_pct
from tpassrun.agent.netwatch._probe import parse_sent, sent_delta

MB = 1024 * 1024
FINE = LinkFigures(rtt_ms=1.0, step_ms=60.0)


def run(watch: LinkWatch, figures: list[tuple[LinkFigures, dict[str, LinkFigures]]], start: float = 0.0,
        every: float = 2.0) -> list:
    return [watch.observe(mine, peers, start + i * every) for i, (mine, peers) in enumerate(figures)]


def learned(watch: LinkWatch) -> float:
    """Feed a healthy baseline; returns the next instant."""
    run(watch, [(FINE, {"b": FINE, "c": FINE})] * watch.baseline_n)
    return watch.baseline_n * 2.0


def pair(a_to_b: float, b_to_a: float, *, step_ms: float = 60.0, rtt_b: float = 1.0) -> tuple[LinkFigures, dict]:
    """B's figures and its peers' (A, and the spare node C that sends nobody anything): ``a_to_b`` is the share
    of what A sent B that A sent again, ``b_to_a`` the other way."""
    a = LinkFigures(rtt_ms=1.0, step_ms=step_ms, addr="10.0.0.1", sent_to={"10.0.0.2": (MB, a_to_b * MB)})
    b = LinkFigures(rtt_ms=rtt_b, step_ms=step_ms, addr="10.0.0.2", sent_to={"10.0.0.1": (MB, b_to_a * MB)})
    return b, {"a": a, "c": LinkFigures(rtt_ms=1.0, addr="10.0.0.3")}


@pytest.mark.parametrize("bad", [pair(0, 0, step_ms=98.0, rtt_b=101.0),     # 50 ms each way on B's link
                                 pair(0.05, 0.001, step_ms=250.0),           # 5% of what B receives lost
                                 pair(0, 0, step_ms=120.0, rtt_b=60.0)])     # B's sending rate-limited
def test_a_slow_link_that_slows_the_job_is_degraded_after_the_hold_and_says_by_how_much(bad):
    w = LinkWatch(hold_s=10.0)
    t = learned(w)
    mine, peers = bad
    seen = [w.observe(mine, peers, t + i * 2.0) for i in range(7)]
    assert [v.state for v in seen[:5]] == [SUSPECT] * 5
    assert seen[5].state == DEGRADED and seen[5].changed and not seen[6].changed
    assert f"+{mine.step_ms - 60:.0f} ms per step" in seen[5].reason and seen[5].extra_ms == mine.step_ms - 60


def test_loss_is_charged_to_the_node_it_happens_on_the_way_to():
    b, peers = pair(0.05, 0.0, step_ms=250.0)
    assert "5.0% of what its peers send it is sent again" in (LinkWatch().stands_out(b, peers) or "")
    # A's view of the same: what B sends A arrives, so A does not stand out (though A resent 5% of what it sent)
    a = peers["a"]
    assert LinkWatch().stands_out(a, {"b": b, "c": peers["c"]}) is None
    assert inbound_loss_pct("10.0.0.2", [a]) == 5.0 and inbound_loss_pct("10.0.0.2", []) is None
    small = LinkFigures(addr="10.0.0.1", sent_to={"10.0.0.2": (1000.0, 500.0)})
    assert inbound_loss_pct("10.0.0.2", [small]) is None      # too little sent to say


def test_cpu_noise_slows_steps_but_no_link_stands_out_so_nothing_is_degraded():
    w = LinkWatch(hold_s=0.0)
    t = learned(w)
    # everyone's etcd round trip and step time doubled by a loaded host: no node stands out
    loaded = LinkFigures(rtt_ms=9.0, step_ms=180.0)
    peers = {"b": LinkFigures(rtt_ms=8.0, step_ms=170.0), "c": LinkFigures(rtt_ms=12.0)}
    assert {v.state for v in run(w, [(loaded, peers)] * 50, t)} == {HEALTHY}


def test_a_link_that_stands_out_without_slowing_the_job_is_not_acted_on():
    w = LinkWatch(hold_s=0.0)
    t = learned(w)
    noisy, peers = pair(0.03, 0.0, step_ms=61.0, rtt_b=80.0)
    assert {v.state for v in run(w, [(noisy, peers)] * 20, t)} == {HEALTHY}


def test_a_break_in_the_suspicion_restarts_the_hold():
    w = LinkWatch(hold_s=6.0)
    t = learned(w)
    bad, peers = LinkFigures(rtt_ms=100.0, step_ms=100.0), {"b": FINE}
    seen = run(w, [(bad, peers), (bad, peers), (FINE, peers), (FINE, peers), (bad, peers), (bad, peers),
                   (bad, peers), (bad, peers)], t)
    # two clear samples in a row ended it: the hold starts again at the fifth (t + 8) and ends 6 s later
    assert [v.state for v in seen] == [SUSPECT, SUSPECT, SUSPECT, HEALTHY] + [SUSPECT] * 3 + [DEGRADED]


def test_one_clear_sample_inside_a_suspicion_does_not_restart_the_hold():
    w = LinkWatch(hold_s=6.0)
    t = learned(w)
    bad, peers = LinkFigures(rtt_ms=100.0, step_ms=100.0), {"b": FINE}
    seen = run(w, [(bad, peers), (bad, peers), (FINE, peers), (bad, peers)], t)
    assert [v.state for v in seen] == [SUSPECT, SUSPECT, SUSPECT, DEGRADED]


def test_degraded_clears_after_clear_s_but_not_while_its_ranks_are_gone_and_the_link_still_stands_out():
    w = LinkWatch(hold_s=0.0, clear_s=10.0)
    t = learned(w)
    peers = {"b": FINE}
    assert w.observe(LinkFigures(rtt_ms=100.0, step_ms=100.0), peers, t).state == DEGRADED
    # its ranks migrated: no step time here any more, the link is as bad as before: stays degraded
    gone = LinkFigures(rtt_ms=100.0, step_ms=None)
    assert {v.state for v in run(w, [(gone, peers)] * 20, t + 2)} == {DEGRADED}
    back = LinkFigures(rtt_ms=1.0, step_ms=None)
    seen = run(w, [(back, peers)] * 7, t + 100)
    assert [v.state for v in seen] == [DEGRADED] * 5 + [HEALTHY, HEALTHY] and seen[5].changed


def test_the_baseline_learns_only_from_healthy_steps_and_nothing_is_judged_before_it_or_without_peers():
    w = LinkWatch(hold_s=0.0)
    assert w.observe(FINE, {"b": FINE}, 0).state == "unknown"
    t = learned(w)
    assert w.observe(FINE, {}, t).state == "unknown"
    for i in range(30):
        w.observe(LinkFigures(rtt_ms=100.0, step_ms=500.0), {"b": FINE}, t + i)
    assert w.baseline_ms() == 60.0


def test_policy_link_thresholds_load_from_the_health_config_with_defaults(tmp_path):
    assert Policy.default().link == LinkPolicy()
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"v": 1, "extends_default": True, "link": {"hold_s": 4, "effect": "none"}}))
    p = Policy.load(str(path))
    assert p.link.hold_s == 4 and p.link.effect.value == "none" and p.link.rtt_factor == 2.0
    assert Policy.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert LinkWatch.from_policy(p.link).hold_s == 4
    for bad, said in (({"hold": 1}, "unknown link field 'hold'"), ({"rtt_factor": 0.5}, ">= 1"),
                      ({"effect": "fail"}, "migrate or none"), ({"clear_s": -1}, ">= 0")):
        with pytest.raises(ValueError, match=said):
            Policy.from_json({"v": 1, "rules": [], "link": bad})


SS = """0      0      10.77.1.12:41234     10.77.1.11:29500
\t cubic wscale:7,7 rto:204 rtt:0.5/0.2 bytes_sent:1000 bytes_retrans:50 bytes_acked:950 segs_out:10
0      0      10.77.1.12:41236     10.77.1.11:29501
\t cubic rtt:0.4/0.2 bytes_sent:3000 bytes_acked:3000
0      0      [::ffff:10.77.1.12]:5000     [::ffff:10.77.1.13]:6000
\t cubic rtt:0.4/0.2 bytes_sent:7 bytes_acked:7
"""


def test_what_was_sent_and_sent_again_is_summed_per_remote_address_and_taken_as_a_difference():
    now = parse_sent(SS)
    assert now == {"10.77.1.11": (4000, 50), "10.77.1.13": (7, 0)}
    assert sent_delta({"10.77.1.11": (1000, 10)}, now) == {"10.77.1.11": (3000, 40), "10.77.1.13": (7, 0)}
    # a connection closed meanwhile: the sum went down, that address starts over
    assert sent_delta({"10.77.1.11": (9000, 10)}, now) == {"10.77.1.13": (7, 0)}
    assert LinkFigures.from_json(LinkFigures(1.0, 2.0, "a", {"b": (1.0, 0.0)}).to_json()) == \
        LinkFigures(1.0, 2.0, "a", {"b": (1.0, 0.0)})
    assert LinkFigures.from_json({"rtt_ms": "x", "sent_to": {"b": [1]}}) is None    # not a peer's figures
    assert LinkFigures.from_json({"rtt_ms": -1.0}) is None and LinkFigures.from_json([1.0]) is None


def test_a_flap_seen_by_the_interface_is_said_once_with_its_length_even_if_etcd_saw_it_too():
    book = FlapBook()
    assert book.interface(True, 0.0) is None
    assert book.interface(False, 10.0) is None and book.down
    book.etcd_lost(12.0)
    flap = book.interface(True, 14.2)
    assert flap is not None and flap.seconds == 4.2 and flap.ridden_out and flap.seen_by == "interface"
    assert book.etcd_restored(15.0, 3.0) is None          # the same outage: said already
    assert flap_line("n1", flap) == "link to node n1 lost for 4.2 s, ridden out"
    book.etcd_lost(20.0)                                  # the same outage's etcd side, noticed late
    assert book.etcd_restored(21.0, 1.0) is None


def test_a_flap_only_etcd_saw_is_timed_by_it_and_a_fence_meanwhile_means_not_ridden_out():
    book = FlapBook()
    book.etcd_lost(100.0)
    flap = book.etcd_restored(103.0, 2.5)
    assert flap is not None and flap.seconds == 3.0 and flap.seen_by == "etcd" and flap.ridden_out
    assert "its etcd connection" in flap_line("n2", flap)
    book.interface(False, 200.0)
    book.broken()
    flap = book.interface(True, 215.0)
    assert flap is not None and not flap.ridden_out and "fenced" in flap_line("n2", flap)
    assert book.interface(True, 216.0, flapped=True) is not None    # down and up between two samples: a flap of 0 s
