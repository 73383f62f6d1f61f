"""``--shard-mirror-interval auto``: the pure choice of K, and the ranks agreeing on one K through a real store."""

from __future__ import annotations

import pytest

from tpassrun.settings import shard_interval as SI


def test_parse_takes_auto_an_integer_or_refuses():
    assert SI.parse("auto") is None and SI.parse(None) is None and SI.parse("AUTO") is None
    assert SI.parse("0") == 0 and SI.parse(4) == 4
    for bad in ("-1", "often"):
        with pytest.raises(ValueError):
            SI.parse(bad)


def test_choose_keeps_the_amortized_cost_within_the_budget_and_bounded():
    assert SI.choose([0.0002], [0.060])[0] == 1                 # 0.33% of a step: every step
    k, why = SI.choose([0.0025, 0.0026, 0.0024], [0.060, 0.061])
    assert k == 5 and 0.0025 / k / 0.060 <= SI.BUDGET and "every 5 step(s)" in why
    assert SI.choose([0.5], [0.010])[0] == SI.MAX_INTERVAL     # bounded: at most 15 steps recomputed
    assert SI.choose([], [0.05]) == (1, "nothing measured")


def _policy(store, cost: float, step: float) -> SI.IntervalPolicy:
    p = SI.IntervalPolicy("auto", store)
    t = 0.0
    for s in range(1, SI.DECIDE_STEP):
        p.step_started(s, t)
        assert p.due(s)                                        # measuring: every step refreshes
        p.refresh_cost(cost)
        t += step
    p.step_started(SI.DECIDE_STEP, t)
    return p


def test_the_ranks_agree_on_the_first_proposal_and_a_joiner_reads_it_in_the_re_formed_world():
    from torch.distributed import PrefixStore, TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    world = PrefixStore("w0", server)
    a, b = _policy(world, 0.003, 0.050), _policy(world, 0.001, 0.050)   # a proposes 6, b 2
    a.due(SI.DECIDE_STEP), b.due(SI.DECIDE_STEP)
    assert a.interval == b.interval == 6 and a.decided and b.decided
    assert [s for s in range(SI.DECIDE_STEP, 30) if b.due(s)] == [12, 18, 24]
    reformed = PrefixStore("w1", server)                       # a re-formed world: its own prefix
    a._store = reformed
    a.after_reform()                                           # a survivor writes K there
    joiner = SI.IntervalPolicy("auto", reformed)
    joiner.joined()
    joiner.step_started(25, 0.0)
    assert not joiner.due(25) and joiner.interval == 6 and joiner.due(30)


def test_a_joiner_before_the_decision_decides_with_the_survivors_at_their_step():
    from torch.distributed import PrefixStore, TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    survivor = SI.IntervalPolicy("auto", PrefixStore("w0", server))
    for s in range(1, 5):
        survivor.step_started(s, s * 0.05)
        survivor.due(s)
    survivor._store = PrefixStore("w1", server)               # re-formed at step 5, before deciding (step 8)
    survivor.after_reform()
    joiner = SI.IntervalPolicy("auto", PrefixStore("w1", server))
    joiner.joined()
    joiner.step_started(5, 0.0)
    assert joiner.due(5) and not joiner.decided and joiner.decide_at == survivor.decide_at == SI.DECIDE_STEP
    for p in (joiner, survivor):
        for s in range(5, SI.DECIDE_STEP):
            p.step_started(s, s * 0.05)
            p.refresh_cost(0.002)
    joiner.due(SI.DECIDE_STEP), survivor.due(SI.DECIDE_STEP)
    assert joiner.decided and survivor.decided and joiner.interval == survivor.interval


def test_a_script_resumed_from_its_checkpoint_measures_its_first_steps_then_decides():
    p = SI.IntervalPolicy("auto")                              # no process group: decides alone
    for s in range(500, 500 + SI.DECIDE_STEP - 1):
        p.step_started(s, s * 0.05)
        assert p.due(s)
        p.refresh_cost(0.002)
    p.step_started(500 + SI.DECIDE_STEP - 1, (500 + SI.DECIDE_STEP - 1) * 0.05)
    p.due(500 + SI.DECIDE_STEP - 1)
    assert p.decided and p.interval == 4                       # 2 ms of a 50 ms step: every 4 steps


def test_a_fixed_interval_is_kept_and_never_asks_the_store():
    p = SI.IntervalPolicy("3", store=object())                 # a store it would fail to use
    assert [s for s in range(1, 10) if p.due(s)] == [3, 6, 9] and p.decided
    assert not SI.IntervalPolicy(0).enabled
