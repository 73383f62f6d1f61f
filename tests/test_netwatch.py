"""The link watch's pure parts (tpassrun/netwatch): which node's link is degraded, and flaps told ridden out.

No network, no clock: figures in, verdicts out."""

from __future__ import annotations

import json

import pytest

from tpassrun.health import LinkPolicy, Policy
from tpassrun.netwatch import DEGRADED, HEALTHY, SUSPECT, FlapBook, LinkFigures, LinkWatch, flap_line
from tpassrun.netwatch._probe import retrans_pct

FINE = LinkFigures(rtt_ms=1.0, retrans_pct=0.0, step_ms=60.0)


def run(watch: LinkWatch, figures: list[tuple[LinkFigures, dict[str, LinkFigures]]], start: float = 0.0,
        every: float = 2.0) -> list:
    return [watch.observe(mine, peers, start + i * every) for i, (mine, peers) in enumerate(figures)]


def learned(watch: LinkWatch) -> float:
    """Feed a healthy baseline; returns the next instant."""
    run(watch, [(FINE, {"b": FINE, "c": FINE})] * watch.baseline_n)
    return watch.baseline_n * 2.0


@pytest.mark.parametrize("bad", [LinkFigures(rtt_ms=101.0, retrans_pct=0.0, step_ms=98.0),     # 50 ms each way
                                 LinkFigures(rtt_ms=1.2, retrans_pct=5.1, step_ms=250.0),      # 5% loss
                                 LinkFigures(rtt_ms=60.0, retrans_pct=0.2, step_ms=120.0)])    # a rate limit
def test_a_slow_link_that_slows_the_job_is_degraded_after_the_hold_and_says_by_how_much(bad):
    w = LinkWatch(hold_s=10.0)
    t = learned(w)
    peers = {"b": FINE, "c": FINE}
    seen = [w.observe(bad, peers, t + i * 2.0) for i in range(7)]
    assert [v.state for v in seen[:5]] == [SUSPECT] * 5
    assert seen[5].state == DEGRADED and seen[5].changed and not seen[6].changed
    assert f"+{bad.step_ms - 60:.0f} ms per step" in seen[5].reason and seen[5].extra_ms == bad.step_ms - 60


def test_cpu_noise_slows_steps_but_no_link_stands_out_so_nothing_is_degraded():
    w = LinkWatch(hold_s=0.0)
    t = learned(w)
    # everyone's etcd round trip and step time doubled by a loaded host: no node stands out
    loaded = LinkFigures(rtt_ms=9.0, retrans_pct=0.0, step_ms=180.0)
    peers = {"b": LinkFigures(rtt_ms=8.0, retrans_pct=0.0, step_ms=170.0),
             "c": LinkFigures(rtt_ms=12.0, retrans_pct=0.0)}
    assert {v.state for v in run(w, [(loaded, peers)] * 50, t)} == {HEALTHY}


def test_a_link_that_stands_out_without_slowing_the_job_is_not_acted_on():
    w = LinkWatch(hold_s=0.0)
    t = learned(w)
    noisy = LinkFigures(rtt_ms=80.0, retrans_pct=3.0, step_ms=61.0)
    assert {v.state for v in run(w, [(noisy, {"b": FINE})] * 20, t)} == {HEALTHY}


def test_a_break_in_the_suspicion_restarts_the_hold():
    w = LinkWatch(hold_s=6.0)
    t = learned(w)
    bad, peers = LinkFigures(rtt_ms=100.0, step_ms=100.0), {"b": FINE}
    seen = run(w, [(bad, peers), (bad, peers), (FINE, peers), (bad, peers), (bad, peers), (bad, peers)], t)
    assert [v.state for v in seen] == [SUSPECT, SUSPECT, HEALTHY, SUSPECT, SUSPECT, SUSPECT]
    assert w.observe(bad, peers, t + 12.0).state == DEGRADED


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
    assert p.link.hold_s == 4 and p.link.effect.value == "none" and p.link.rtt_factor == 3.0
    assert Policy.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert LinkWatch.from_policy(p.link).hold_s == 4
    for bad, said in (({"hold": 1}, "unknown link field 'hold'"), ({"rtt_factor": 0.5}, ">= 1"),
                      ({"effect": "fail"}, "migrate or none"), ({"clear_s": -1}, ">= 0")):
        with pytest.raises(ValueError, match=said):
            Policy.from_json({"v": 1, "rules": [], "link": bad})


def test_retransmitted_share_needs_enough_segments():
    assert retrans_pct((1000, 10), (2000, 60)) == 5.0
    assert retrans_pct((1000, 10), (1020, 11)) is None
    assert retrans_pct(None, (1, 1)) is None


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
