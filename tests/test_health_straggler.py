"""StragglerDetector on scripted step times."""

from __future__ import annotations

import pytest

from tpassrun.health import Status, StragglerDetector, TaintEffect


def run(detector, rounds, start=0):
    """rounds: list of {rank: seconds}; returns the verdicts (by device) after each round."""
    return [{v.device: v for v in detector.observe(times, float(start + i))} for i, times in enumerate(rounds)]


def steady(n_ranks=4, slow=None, slow_time=2.0, base=1.0, count=1):
    return [{r: (slow_time if r == slow else base) for r in range(n_ranks)} for _ in range(count)]


def test_warming_up_is_unknown_not_healthy():
    detector = StragglerDetector(factor=1.5, window=10, min_steps=5, patience=2)
    first = run(detector, steady())[0]
    assert first["rank0"].status is Status.UNKNOWN and "1/5" in first["rank0"].reason


def test_persistent_straggler_is_tainted_with_figures_after_patience():
    detector = StragglerDetector(factor=1.5, window=10, min_steps=5, patience=3)
    history = run(detector, steady(slow=2, slow_time=2.0, count=10))
    # min_steps reached on round 5 (index 4); slow on rounds 5, 6, 7 -> tainted at index 6.
    assert [h["rank2"].effect for h in history[4:8]] == [TaintEffect.NONE] * 2 + [TaintEffect.MIGRATE] * 2
    verdict = history[6]["rank2"]
    assert verdict.status is Status.DEGRADED and verdict.metric == "step_time"
    assert "median step 2s" in verdict.reason and "2x the median of 3 other rank(s) (1s)" in verdict.reason
    assert all(history[-1][f"rank{r}"].status is Status.HEALTHY for r in (0, 1, 3))


def test_one_slow_step_is_not_a_straggler():
    detector = StragglerDetector(factor=1.5, window=10, min_steps=5, patience=3)
    rounds = steady(count=8) + [{0: 9.0, 1: 1.0, 2: 1.0, 3: 1.0}] + steady(count=10)
    assert all(h["rank0"].effect is TaintEffect.NONE for h in run(detector, rounds))


def test_hysteresis_clears_only_after_patience_rounds_below_clear_factor():
    detector = StragglerDetector(factor=1.5, window=4, min_steps=4, patience=2, clear_factor=1.2)
    history = run(detector, steady(slow=0, slow_time=2.0, count=6))
    assert history[-1]["rank0"].effect is TaintEffect.MIGRATE
    # 1.3x is inside the band (1.2 .. 1.5): neither slow nor recovered -> stays tainted.
    history = run(detector, steady(slow=0, slow_time=1.3, count=6), start=6)
    assert all(h["rank0"].effect is TaintEffect.MIGRATE for h in history)
    history = run(detector, steady(count=6), start=12)
    # Window medians: 1.3 (band), 1.15 (fast 1), 1.0 (fast 2 = patience) -> clears on the third round.
    assert [h["rank0"].effect for h in history[:4]] == [TaintEffect.MIGRATE] * 2 + [TaintEffect.NONE] * 2


def test_flapping_rank_does_not_accumulate_patience():
    detector = StragglerDetector(factor=1.5, window=1, min_steps=1, patience=3)
    rounds = [{0: (3.0 if i % 2 else 1.0), 1: 1.0, 2: 1.0} for i in range(20)]
    assert all(h["rank0"].effect is TaintEffect.NONE for h in run(detector, rounds))


def test_two_ranks_compare_against_the_other():
    detector = StragglerDetector(factor=1.5, window=3, min_steps=3, patience=1)
    history = run(detector, [{0: 1.0, 1: 3.0}] * 3)
    assert history[-1]["rank1"].effect is TaintEffect.MIGRATE
    assert history[-1]["rank0"].effect is TaintEffect.NONE      # 0.33x is not slow


def test_single_rank_has_no_peers():
    detector = StragglerDetector(factor=1.5, window=2, min_steps=1, patience=1)
    (verdict,) = detector.observe({0: 1.0}, 0.0)
    assert verdict.status is Status.UNKNOWN and "no peer" in verdict.reason


def test_forget_resets_a_swapped_rank():
    detector = StragglerDetector(factor=1.5, window=3, min_steps=3, patience=1)
    run(detector, steady(n_ranks=3, slow=1, count=3))
    detector.forget(1)
    verdicts = {v.device: v for v in detector.observe({0: 1.0, 1: 1.0, 2: 1.0}, 10.0)}
    assert verdicts["rank1"].status is Status.UNKNOWN          # fresh history after the swap


def test_fail_effect_is_failing():
    detector = StragglerDetector(factor=2, window=1, min_steps=1, patience=1, effect=TaintEffect.FAIL)
    verdicts = {v.device: v for v in detector.observe({0: 1.0, 1: 1.0, 2: 5.0}, 0.0)}
    assert (verdicts["rank2"].status, verdicts["rank2"].effect) == (Status.FAILING, TaintEffect.FAIL)


@pytest.mark.parametrize("kwargs", [
    {"factor": 1.0}, {"factor": 2, "window": 0}, {"factor": 2, "window": 5, "min_steps": 6},
    {"factor": 2, "clear_factor": 3}, {"factor": 2, "patience": 0},
])
def test_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        StragglerDetector(**kwargs)
