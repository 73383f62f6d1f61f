"""Policy engine on scripted readings: every rule kind, hysteresis, counter resets, errors, config files."""

from __future__ import annotations

import json
import math

import pytest

from tpassrun.health import HealthVerdict, Policy, PolicyEngine, Reading, Rule, Status, TaintEffect


def feed(engine: PolicyEngine, script, device: str = "gpu0", metric: str = "m") -> list[HealthVerdict]:
    """script: [(now, value-or-error-string), ...] -> the device's verdict after each step."""
    out = []
    for now, value in script:
        if isinstance(value, str):
            reading = Reading(device, metric, None, now, error=value)
        else:
            reading = Reading(device, metric, value, now)
        verdicts = {v.device: v for v in engine.observe([reading], now)}
        out.append(verdicts[device])
    return out


def statuses(verdicts):
    return [v.status for v in verdicts]


H, U, D, F = Status.HEALTHY, Status.UNKNOWN, Status.DEGRADED, Status.FAILING


def test_value_threshold_raises_and_clears_at_once_without_hysteresis():
    engine = PolicyEngine(Policy((Rule("m", ">=", 90, effect=TaintEffect.MIGRATE),)))
    got = feed(engine, [(0, 80), (1, 90), (2, 95), (3, 89)])
    assert statuses(got) == [H, D, D, H]
    assert got[1].effect is TaintEffect.MIGRATE and got[1].metric == "m"
    assert "m=90 >= 90" in got[1].reason
    assert got[0].reason == "1 checks pass"


@pytest.mark.parametrize("op,threshold,value,breaches", [
    (">=", 5, 5, True), (">", 5, 5, False), ("<=", 5, 5, True), ("<", 5, 4, True),
    ("==", 48, 48, True), ("==", 48, 47, False), ("!=", 0, 3, True), ("!=", 0, 0, False),
])
def test_every_operator(op, threshold, value, breaches):
    engine = PolicyEngine(Policy((Rule("m", op, threshold),)))
    (verdict,) = feed(engine, [(0, value)])
    assert verdict.status is (D if breaches else H)


def test_value_window_requires_the_breach_to_hold():
    engine = PolicyEngine(Policy((Rule("temp", ">=", 90, window=30, clear_threshold=85, clear_after=60),)))
    got = feed(engine, [(0, 91), (10, 92), (29, 95), (30, 93)], metric="temp")
    assert statuses(got) == [H, H, H, D]
    assert "for 30s" in got[-1].reason and "temp=93" in got[-1].reason


def test_flapping_value_never_raises_a_sustained_rule():
    engine = PolicyEngine(Policy((Rule("temp", ">=", 90, window=30),)))
    script = [(t, 95 if (t // 10) % 2 == 0 else 80) for t in range(0, 200, 10)]
    assert set(statuses(feed(engine, script, metric="temp"))) == {H}


def test_hysteresis_flapping_around_threshold_stays_raised_until_clear_for_clear_after():
    rule = Rule("temp", ">=", 90, clear_threshold=85, clear_after=60)
    engine = PolicyEngine(Policy((rule,)))
    script = [(0, 91),                      # raise
              (10, 87), (20, 91), (30, 86),  # flapping under 90 but above 85: still raised
              (40, 84), (60, 90), (70, 84),  # below 85, then relapse: the clock restarts
              (100, 80), (129, 80), (130, 80)]
    assert statuses(feed(engine, script, metric="temp")) == [D, D, D, D, D, D, D, D, D, H]


def test_delta_rule_counts_increase_and_survives_counter_reset():
    engine = PolicyEngine(Policy((Rule("ecc", ">", 0, kind="delta", clear_after=0),)))
    got = feed(engine, [(0, 7), (1, 7), (2, 9), (3, 9), (4, 0), (5, 0), (6, 1)], metric="ecc")
    # 7 is a baseline (not an increase); 9 is +2; the drop to 0 is a reset (new baseline, no
    # negative delta, no alarm); 0 -> 1 is a genuine new error.
    assert statuses(got) == [H, H, D, H, H, H, D]
    assert "ecc +2 (now 9)" in got[2].reason


def test_delta_over_window_sums_increments_inside_the_window_only():
    engine = PolicyEngine(Policy((Rule("replay", ">=", 10, kind="delta", window=60, clear_after=0),)))
    got = feed(engine, [(0, 100), (20, 104), (40, 108), (59, 111), (80, 112), (130, 112)], metric="replay")
    # +4 +4 +3 = 11 within 60 s at t=59; at t=80 the +4 from t=20 has left the window (4+3+1 = 8).
    assert statuses(got) == [H, H, H, D, H, H]
    assert "+11 in 60s" in got[3].reason


def test_rate_rule_per_second_over_window_and_reset():
    engine = PolicyEngine(Policy((Rule("pcie", ">", 1, kind="rate", window=10, clear_after=5),)))
    script = [(0, 0), (5, 5), (10, 15),   # 15 in 10 s = 1.5/s -> raise
              (12, 3),                    # reset: new baseline, not a negative rate (window still 1.5/s)
              (20, 4), (24, 5), (25, 5)]  # 0.1-0.2/s from t=20: clears after 5 s of that
    got = feed(engine, script, metric="pcie")
    assert statuses(got) == [H, H, D, D, D, D, H]
    assert "1.5/s" in got[2].reason


def test_rate_rule_without_window_uses_time_since_last_reading():
    engine = PolicyEngine(Policy((Rule("c", ">=", 2, kind="rate"),)))
    assert statuses(feed(engine, [(0, 0), (2, 2), (4, 10)], metric="c")) == [H, H, D]


def test_error_reading_is_unknown_never_healthy():
    engine = PolicyEngine(Policy((Rule("temp", ">=", 90),)))
    got = feed(engine, [(0, "NVML: Not Supported")], metric="temp")
    assert got[0].status is U and got[0].effect is TaintEffect.NONE
    assert "temp: NVML: Not Supported" in got[0].reason


def test_error_then_good_reading_returns_to_healthy():
    engine = PolicyEngine(Policy((Rule("temp", ">=", 90),)))
    assert statuses(feed(engine, [(0, "boom"), (1, 50)], metric="temp")) == [U, H]


def test_error_while_raised_keeps_the_taint_and_restarts_the_clear_clock():
    engine = PolicyEngine(Policy((Rule("temp", ">=", 90, clear_after=10),)))
    got = feed(engine, [(0, 95), (1, 50), (5, "timeout"), (9, 50), (12, 50), (19, 50)], metric="temp")
    # Without the error the taint would clear at t=11; the error means recovery restarts at t=9.
    assert statuses(got) == [D, D, D, D, D, H]


def test_unknown_metric_without_rule_still_makes_device_unknown():
    engine = PolicyEngine(Policy(()))
    (verdict,) = engine.observe([Reading("slot1", "custom", None, 0, error="probe crashed")], 0)
    assert verdict.status is U and "probe crashed" in verdict.reason


def test_device_without_rules_is_healthy_with_an_explicit_reason():
    engine = PolicyEngine(Policy((Rule("temp", ">=", 90),)))
    (verdict,) = engine.observe([Reading("gpu3", "power_w", 300, 0)], 0)
    assert verdict.status is H and "no rule covers" in verdict.reason


def test_missing_readings_do_not_advance_hysteresis():
    engine = PolicyEngine(Policy((Rule("temp", ">=", 90, clear_after=10),)))
    feed(engine, [(0, 95), (1, 50)], metric="temp")
    other = Reading("gpu1", "temp", 50, 100)
    verdicts = {v.device: v for v in engine.observe([other], 100)}
    assert verdicts["gpu0"].status is D        # no new gpu0 reading: no evidence it recovered


def test_harshest_rule_wins_and_others_are_mentioned():
    policy = Policy((Rule("temp", ">=", 90, effect=TaintEffect.MIGRATE),
                     Rule("lost", ">=", 1, effect=TaintEffect.FAIL, status=Status.FAILING)))
    engine = PolicyEngine(policy)
    (verdict,) = engine.observe([Reading("gpu0", "temp", 95, 0), Reading("gpu0", "lost", 1, 0)], 0)
    assert (verdict.status, verdict.effect, verdict.metric) == (F, TaintEffect.FAIL, "lost")
    assert "also: temp" in verdict.reason


def test_several_readings_of_one_metric_in_a_batch_any_breach_counts():
    engine = PolicyEngine(Policy((Rule("xid", "==", 79, effect=TaintEffect.FAIL, status=F),)))
    readings = [Reading("gpu0", "xid", 79, 0.0), Reading("gpu0", "xid", 13, 0.1)]
    (verdict,) = engine.observe(readings, 1)
    assert verdict.status is F


def test_sticky_rule_never_clears_by_itself():
    engine = PolicyEngine(Policy((Rule("lost", ">=", 1, clear_after=math.inf, effect=TaintEffect.FAIL,
                                       status=F),)))
    got = feed(engine, [(0, 1), (1, 0), (10_000, 0)], metric="lost")
    assert statuses(got) == [F, F, F]
    engine.forget("gpu0")
    assert engine.devices == []


def test_verdict_json_round_trip():
    verdict = HealthVerdict("gpu0", D, TaintEffect.MIGRATE, "hot", "temp", 12.5)
    data = json.loads(json.dumps(verdict.to_json()))
    assert data["v"] == 1 and HealthVerdict.from_json(data) == verdict


# --- the default policy ---

def _default_verdict(metric: str, script) -> list[HealthVerdict]:
    return feed(PolicyEngine(Policy.default()), script, metric=metric)


def test_default_policy_sanity():
    policy = Policy.default()
    labels = [r.label for r in policy.rules]
    assert len(labels) == len(set(labels)), "labels must be unique so configs can override them"
    for rule in policy.rules:
        assert rule.status in (D, F)
        assert (rule.effect is TaintEffect.FAIL) == (rule.status is F)


@pytest.mark.parametrize("metric,script,status,effect", [
    ("gpu_lost", [(0, 0), (1, 1)], F, TaintEffect.FAIL),
    ("ecc_uncorrected_volatile", [(0, 2), (1, 3)], D, TaintEffect.MIGRATE),
    ("ecc_uncorrected_volatile", [(0, 2), (1, 2)], H, TaintEffect.NONE),
    ("row_remap_failure", [(0, 1)], D, TaintEffect.EXCLUDE),
    ("row_remap_pending", [(0, 1)], D, TaintEffect.MIGRATE),
    ("recovery_action", [(0, 0)], H, TaintEffect.NONE),
    ("recovery_action", [(0, 1)], F, TaintEffect.FAIL),          # GPU_RESET
    ("recovery_action", [(0, 4)], D, TaintEffect.MIGRATE),       # DRAIN_AND_RESET
    ("xid", [(0, 0)], H, TaintEffect.NONE),
    ("xid", [(0, 13)], H, TaintEffect.NONE),                     # app error: not a GPU problem
    ("xid", [(0, 48)], F, TaintEffect.FAIL),
    ("xid", [(0, 63)], D, TaintEffect.MIGRATE),
    ("xid", [(0, 79)], F, TaintEffect.FAIL),
    ("temperature_c", [(0, 95), (29, 95)], H, TaintEffect.NONE),
    ("temperature_c", [(0, 95), (30, 95)], D, TaintEffect.MIGRATE),
])
def test_default_policy_maps_signals_to_effects(metric, script, status, effect):
    verdict = _default_verdict(metric, script)[-1]
    assert (verdict.status, verdict.effect) == (status, effect), verdict.reason


def test_default_temperature_hysteresis():
    got = _default_verdict("temperature_c", [(0, 95), (30, 95), (40, 88), (200, 88), (210, 84), (269, 84), (270, 84)])
    assert statuses(got) == [H, D, D, D, D, D, H]


# --- config files ---

def test_load_json_and_toml(tmp_path):
    rules = [{"metric": "temp", "op": ">=", "threshold": 80, "window": 5, "effect": "exclude",
              "clear_after": None, "name": "warm"}]
    jpath = tmp_path / "policy.json"
    jpath.write_text(json.dumps({"v": 1, "rules": rules}))
    policy = Policy.load(str(jpath))
    assert policy.rules == (Rule("temp", ">=", 80, window=5, effect=TaintEffect.EXCLUDE,
                                 clear_after=math.inf, name="warm"),)
    tpath = tmp_path / "policy.toml"
    tpath.write_text('v = 1\nextends_default = true\n[[rules]]\nmetric = "temperature_c"\nop = ">="\n'
                     'threshold = 80\nwindow = 10\nclear_after = "never"\nname = "temperature"\n')
    merged = Policy.load(str(tpath))
    (temp,) = [r for r in merged.rules if r.label == "temperature"]
    assert temp.threshold == 80 and temp.clear_after == math.inf
    assert len(merged.rules) == len(Policy.default().rules)    # replaced by label, not added


def test_policy_json_round_trip():
    policy = Policy.default()
    assert Policy.from_json(json.loads(json.dumps(policy.to_json()))) == policy


@pytest.mark.parametrize("content,message", [
    ("{", "not valid JSON"),
    ('{"v": 2, "rules": []}', "version must be 1"),
    ('{"v": 1, "rules": [{"metric": "t", "op": "=>", "threshold": 1}]}', "rule 0: rule t value => 1: unknown op '=>'"),
    ('{"v": 1, "rules": [{"metric": "t", "op": ">", "threshold": "hot"}]}', "threshold must be a number"),
    ('{"v": 1, "rules": [{"metric": "t", "op": ">", "threshold": 1, "windw": 3}]}', "unknown field 'windw'"),
    ('{"v": 1, "rules": [{"metric": "t", "op": ">", "threshold": 1, "effect": "explode"}]}', "'explode'"),
    ('{"v": 1, "rules": [{"metric": "t", "op": ">", "threshold": 1, "status": "healthy"}]}', "degraded or failing"),
    ('{"v": 1, "rules": [{"op": ">", "threshold": 1}]}', "missing field 'metric'"),
    ('{"v": 1, "rules": [{"metric": "t", "op": ">", "threshold": 1, "window": -1}]}', "window must be"),
    ('{"v": 1, "rulez": []}', "unknown policy field 'rulez'"),
])
def test_bad_config_is_one_line_value_error(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        Policy.load(str(path))
    text = str(info.value)
    assert message in text and "\n" not in text and str(path) in text


def test_missing_config_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read policy"):
        Policy.load(str(tmp_path / "nope.json"))


def test_bad_toml(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("v = = 1\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        Policy.load(str(path))


def test_rule_flag_syntax():
    rule = Rule.parse("temperature_c >= 92 window=30 effect=exclude clear_after=never clear_threshold=85")
    assert rule == Rule("temperature_c", ">=", 92, window=30, effect=TaintEffect.EXCLUDE,
                        clear_after=math.inf, clear_threshold=85)
    with pytest.raises(ValueError, match="expected"):
        Rule.parse("temperature_c >=")
    with pytest.raises(ValueError, match="key=value"):
        Rule.parse("t > 1 window")
    merged = Policy.default().with_rule(Rule.parse("xid == 13 effect=exclude"))
    assert merged.rules[-1].threshold == 13
