"""The policy engine: readings + time in, one verdict per device out. Pure: no clock, no I/O.

State is kept per (device, rule): the counter history a delta/rate rule needs, when a breach
started (a value rule must hold for ``window`` seconds), whether the rule is raised, and since when
it has looked good again (hysteresis). A metric whose last reading was an error makes its device
``UNKNOWN`` unless a raised rule already says something worse: an unreadable check is never healthy.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ._policy import Policy, Rule
from ._types import HealthVerdict, Reading, Status, TaintEffect, fmt, worse


@dataclass
class _RuleState:
    last_value: float | None = None          # counters: previous raw value (the baseline)
    last_time: float | None = None
    increments: deque[tuple[float, float]] = field(default_factory=deque)   # (time, non-negative increase) inside the window
    breach_since: float | None = None
    clear_since: float | None = None
    raised: bool = False
    raised_reason: str = ""
    raised_at: float = 0.0
    seen: bool = False                       # a good reading has been evaluated at least once


@dataclass(frozen=True)
class _Evaluation:
    quantity: float
    description: str                         # "temperature_c=93" / "ecc_uncorrected_volatile +3 in 60s"


class PolicyEngine:
    """Applies a :class:`Policy` to readings. Call :meth:`observe` with every batch, in time order."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._rules_by_metric: dict[str, list[tuple[int, Rule]]] = defaultdict(list)
        for index, rule in enumerate(policy.rules):
            self._rules_by_metric[rule.metric].append((index, rule))
        self._states: dict[tuple[str, int], _RuleState] = {}
        self._errors: dict[tuple[str, str], str] = {}     # (device, metric) -> why it could not be read
        self._devices: dict[str, None] = {}                # insertion-ordered set
        self._metrics_seen: dict[str, set[str]] = defaultdict(set)

    @property
    def devices(self) -> list[str]:
        return list(self._devices)

    def observe(self, readings: Sequence[Reading], now: float) -> list[HealthVerdict]:
        """Feed one batch (any devices, any metrics); return the current verdict of every device seen so far."""
        grouped: dict[tuple[str, str], list[Reading]] = defaultdict(list)
        for reading in readings:
            self._devices.setdefault(reading.device, None)
            grouped[(reading.device, reading.metric)].append(reading)
        for (device, metric), batch in grouped.items():
            self._observe_metric(device, metric, sorted(batch, key=lambda r: r.time), now)
        return [self._verdict(device, now) for device in self._devices]

    def verdicts(self, now: float) -> list[HealthVerdict]:
        """Current verdicts without new readings (nothing advances: hysteresis needs evidence)."""
        return [self._verdict(device, now) for device in self._devices]

    def forget(self, device: str) -> None:
        """Drop all state of a device (e.g. the operator reset the GPU and untainted it)."""
        self._devices.pop(device, None)
        self._metrics_seen.pop(device, None)
        self._states = {k: v for k, v in self._states.items() if k[0] != device}
        self._errors = {k: v for k, v in self._errors.items() if k[0] != device}

    # --- one metric of one device ---

    def _observe_metric(self, device: str, metric: str, batch: list[Reading], now: float) -> None:
        good = [r for r in batch if r.error is None and r.value is not None]
        if good:
            self._errors.pop((device, metric), None)
            self._metrics_seen[device].add(metric)
        else:
            bad = batch[-1]
            self._errors[(device, metric)] = bad.error or "no value"
        for index, rule in self._rules_by_metric.get(metric, ()):
            state = self._states.setdefault((device, index), _RuleState())
            if not good:
                # Cannot confirm recovery without a reading: restart the hysteresis clock.
                state.clear_since = None
                continue
            evaluations = [_advance(rule, state, float(r.value), r.time) for r in good]  # type: ignore[arg-type]
            _judge(rule, state, evaluations, now)

    # --- the device verdict: the harshest raised rule, else UNKNOWN if anything is unreadable ---

    def _verdict(self, device: str, now: float) -> HealthVerdict:
        raised: list[HealthVerdict] = []
        checked = 0
        for index, rule in enumerate(self.policy.rules):
            state = self._states.get((device, index))
            if state is None:
                continue
            checked += state.seen
            if state.raised:
                raised.append(HealthVerdict(device, rule.status, rule.effect, state.raised_reason, rule.metric, now))
        if raised:
            harshest = raised[0]
            for verdict in raised[1:]:
                if worse(verdict, harshest):
                    harshest = verdict
            others = [v.reason for v in raised if v is not harshest]
            reason = harshest.reason + (f" (also: {'; '.join(others)})" if others else "")
            return HealthVerdict(device, harshest.status, harshest.effect, reason, harshest.metric, now)
        errors = sorted((metric, why) for (dev, metric), why in self._errors.items() if dev == device)
        if errors:
            reason = "cannot read " + "; ".join(f"{metric}: {why}" for metric, why in errors)
            return HealthVerdict(device, Status.UNKNOWN, TaintEffect.NONE, reason, errors[0][0], now)
        if checked:
            return HealthVerdict(device, Status.HEALTHY, TaintEffect.NONE, f"{checked} checks pass", None, now)
        seen = len(self._metrics_seen.get(device, ()))
        return HealthVerdict(device, Status.HEALTHY, TaintEffect.NONE,
                             f"no rule covers its {seen} metric(s)", None, now)


def _advance(rule: Rule, state: _RuleState, value: float, time: float) -> _Evaluation:
    """Add one good reading to the rule's history and return the quantity the rule compares."""
    if rule.kind == "value":
        state.seen = True
        return _Evaluation(value, f"{rule.metric}={fmt(value)}")
    previous, previous_time = state.last_value, state.last_time
    state.last_value, state.last_time = value, time
    state.seen = True
    if previous is None or value < previous:
        # First sample, or the counter went down (reset): this reading is a new baseline.
        increase = 0.0
        note = " (new baseline)" if previous is not None else ""
    else:
        increase, note = value - previous, ""
    if rule.window > 0:
        state.increments.append((time, increase))
        _prune(state.increments, time - rule.window)
        total = sum(inc for _, inc in state.increments)
        span = f" in {fmt(rule.window)}s"
    else:
        total, span = increase, ""
    if rule.kind == "delta":
        return _Evaluation(total, f"{rule.metric} +{fmt(total)}{span} (now {fmt(value)}){note}")
    if rule.window > 0:
        per_second = total / rule.window
    else:
        elapsed = time - previous_time if previous_time is not None else 0.0
        per_second = total / elapsed if elapsed > 0 else 0.0
    return _Evaluation(per_second, f"{rule.metric} rising {fmt(per_second)}/s{span or ' since last reading'}{note}")


def _prune(increments: deque[tuple[float, float]], older_than: float) -> None:
    while increments and increments[0][0] <= older_than:
        increments.popleft()


def _judge(rule: Rule, state: _RuleState, evaluations: Iterable[_Evaluation], now: float) -> None:
    """Raise or clear the rule, with sustain (value rules) and hysteresis (all rules)."""
    evaluations = list(evaluations)
    breaching = [e for e in evaluations if rule.breaches(e.quantity)]
    all_clear = all(rule.clears(e.quantity) for e in evaluations)
    if not state.raised:
        if not breaching:
            state.breach_since = None
            return
        if state.breach_since is None:
            state.breach_since = now
        held = now - state.breach_since
        # For value rules `window` is how long the breach must hold; delta/rate already used it.
        needed = rule.window if rule.kind == "value" else 0.0
        if held < needed:
            return
        worst = breaching[-1]
        held_text = f" for {fmt(round(held, 1))}s" if needed else ""
        state.raised, state.raised_at, state.clear_since = True, now, None
        state.raised_reason = f"{rule.label}: {worst.description} {rule.op} {fmt(rule.threshold)}{held_text}"
        return
    if not all_clear:
        state.clear_since = None
        return
    if state.clear_since is None:
        state.clear_since = now
    if now - state.clear_since >= rule.clear_after:
        state.raised, state.breach_since, state.clear_since, state.raised_reason = False, None, None, ""
