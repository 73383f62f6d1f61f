"""Health policy: which readings taint a device, how hard, and when the taint clears.

A :class:`Rule` watches one metric. Three kinds::

    value   the reading itself         temperature_c >= 90 held for `window` s      (window = how long)
    delta   increase of a counter      ecc_uncorrected_volatile grew by > 0 within `window` s
    rate    increase per second        pcie_replay_count > 1/s averaged over `window` s

Counters that go *down* (driver reload, GPU reset, ``nvmlDeviceClearEccErrorCounts``) start a new
baseline: the drop is never a negative increase, and the value after the drop is not counted as
new errors either (we cannot tell how many of them happened before the reset).

Hysteresis: a raised rule clears only after its metric has stayed on the good side of
``clear_threshold`` (default: ``threshold``) for ``clear_after`` seconds without a break::

    raise:  --------------[breach held >= window]----> RAISED
    clear:  RAISED --[clear condition held >= clear_after]--> clear   (any relapse restarts the clock)

``clear_after = inf`` makes a rule sticky: only an operator (``tpassctl untaint``) clears it.
Policies are loaded from JSON or TOML; a bad file is a ``ValueError`` with one line saying what is wrong.
"""

from __future__ import annotations

import json
import math
import operator
import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Literal

from . import _types as m
from ._types import Status, TaintEffect, fmt

Op = Literal[">=", ">", "<=", "<", "==", "!="]
Kind = Literal["value", "delta", "rate"]

OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq, "!=": operator.ne,
}
KINDS = ("value", "delta", "rate")


@dataclass(frozen=True)
class Rule:
    """One threshold on one metric. See the module docstring for ``kind``/``window``/hysteresis."""

    metric: str
    op: Op
    threshold: float
    kind: Kind = "value"
    window: float = 0.0
    effect: TaintEffect = TaintEffect.MIGRATE
    status: Status = Status.DEGRADED
    clear_after: float = 0.0
    clear_threshold: float | None = None
    name: str = field(default="")

    def __post_init__(self) -> None:
        for key in ("threshold", "window", "clear_after"):
            object.__setattr__(self, key, float(getattr(self, key)))
        if self.clear_threshold is not None:
            object.__setattr__(self, "clear_threshold", float(self.clear_threshold))
        problems = _rule_problems(self)
        if problems:
            raise ValueError(f"rule {self.label}: {problems[0]}")

    @property
    def label(self) -> str:
        """The rule's name, or a readable form of it (used in reasons and to override rules by name)."""
        return self.name or f"{self.metric} {self.kind} {self.op} {fmt(self.threshold)}"

    def breaches(self, quantity: float) -> bool:
        return OPS[self.op](quantity, self.threshold)

    def clears(self, quantity: float) -> bool:
        limit = self.threshold if self.clear_threshold is None else self.clear_threshold
        return not OPS[self.op](quantity, limit)

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["effect"], out["status"] = self.effect.value, self.status.value
        if math.isinf(self.clear_after):
            out["clear_after"] = None          # JSON has no infinity; null means "sticky"
        return out

    @classmethod
    def from_json(cls, data: object) -> "Rule":
        if not isinstance(data, dict):
            raise ValueError(f"a rule must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
        missing = [k for k in ("metric", "op", "threshold") if k not in data]
        if missing:
            raise ValueError(f"missing field {missing[0]!r}")
        args: dict[str, Any] = dict(data)
        try:
            if "effect" in args:
                args["effect"] = TaintEffect(args["effect"])
            if "status" in args:
                args["status"] = Status(args["status"])
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        if "clear_after" in args and args["clear_after"] in (None, "never"):
            args["clear_after"] = math.inf     # null (JSON) or "never" (TOML has no null): sticky
        for key in ("threshold", "window", "clear_after", "clear_threshold"):
            if args.get(key) is not None:
                if isinstance(args[key], bool) or not isinstance(args[key], (int, float)):
                    raise ValueError(f"{key} must be a number, got {args[key]!r}")
                args[key] = float(args[key])
        return cls(**args)

    @classmethod
    def parse(cls, text: str) -> "Rule":
        """Compact form for a command-line flag.

        ``"temperature_c >= 92 window=30 effect=migrate clear_after=60 clear_threshold=85"``;
        ``kind``, ``status`` and ``name`` are accepted the same way.
        """
        words = text.split()
        if len(words) < 3:
            raise ValueError(f"rule {text!r}: expected '<metric> <op> <threshold> [key=value ...]'")
        data: dict[str, Any] = {"metric": words[0], "op": words[1]}
        try:
            data["threshold"] = float(words[2])
            for word in words[3:]:
                key, sep, raw = word.partition("=")
                if not sep:
                    raise ValueError(f"expected key=value, got {word!r}")
                number_keys = ("window", "clear_after", "clear_threshold")
                data[key] = float(raw) if key in number_keys and raw != "never" else raw
            return cls.from_json(data)
        except ValueError as exc:
            raise ValueError(f"rule {text!r}: {exc}") from None


def _rule_problems(rule: Rule) -> list[str]:
    problems = []
    if not isinstance(rule.metric, str) or not rule.metric:
        problems.append("metric must be a non-empty string")
    if rule.op not in OPS:
        problems.append(f"unknown op {rule.op!r} (use one of {' '.join(OPS)})")
    if rule.kind not in KINDS:
        problems.append(f"unknown kind {rule.kind!r} (use value, delta or rate)")
    if math.isnan(rule.threshold):
        problems.append("threshold is NaN")
    if rule.window < 0 or math.isnan(rule.window) or math.isinf(rule.window):
        problems.append(f"window must be finite and >= 0, got {rule.window}")
    if rule.clear_after < 0 or math.isnan(rule.clear_after):
        problems.append(f"clear_after must be >= 0, got {rule.clear_after}")
    if not isinstance(rule.effect, TaintEffect) or not isinstance(rule.status, Status):
        problems.append("effect/status must be TaintEffect/Status")
    elif rule.status in (Status.HEALTHY, Status.UNKNOWN):
        problems.append(f"status must be degraded or failing, got {rule.status.value}")
    return problems


# XID codes the default policy acts on (NVIDIA XID catalogue), and why each effect:
#   48 double-bit ECC error            -> FAIL: the data the rank holds is already corrupt
#   63 ECC page retirement / row remap  -> MIGRATE: memory is fine until the next reset applies the remap
#   64 retirement / remap *failure*     -> MIGRATE: still running, but the next error cannot be fenced off
#   79 GPU fell off the bus             -> FAIL: nothing on that GPU will make progress
#   94 contained ECC error              -> FAIL: the process that touched the page has been killed
#   95 uncontained ECC error            -> FAIL: every process on the GPU is affected; reset required
XID_EFFECTS: dict[int, TaintEffect] = {
    48: TaintEffect.FAIL, 63: TaintEffect.MIGRATE, 64: TaintEffect.MIGRATE,
    79: TaintEffect.FAIL, 94: TaintEffect.FAIL, 95: TaintEffect.FAIL,
}

# NVML_GPU_RECOVERY_ACTION_* values (nvidia-ml-py names) and the effect the default policy maps them to.
# The DRAIN_* actions ask for the work to be moved away before the reset: a planned migration. The
# others say the GPU needs a reset/reboot before it can be trusted: treat the rank as failed now.
RECOVERY_ACTION_EFFECTS: dict[int, tuple[str, TaintEffect]] = {
    1: ("GPU_RESET", TaintEffect.FAIL),
    2: ("NODE_REBOOT", TaintEffect.FAIL),
    3: ("DRAIN_P2P", TaintEffect.MIGRATE),
    4: ("DRAIN_AND_RESET", TaintEffect.MIGRATE),
    5: ("RECOVER_IMEX_DOMAIN", TaintEffect.MIGRATE),
    6: ("BUS_RESET", TaintEffect.FAIL),
    7: ("SYSTEM_REBOOT", TaintEffect.FAIL),
}

STICKY = math.inf


def _status_for(effect: TaintEffect) -> Status:
    return Status.FAILING if effect is TaintEffect.FAIL else Status.DEGRADED


def _default_rules() -> tuple[Rule, ...]:
    fail, migrate, exclude = TaintEffect.FAIL, TaintEffect.MIGRATE, TaintEffect.EXCLUDE
    rules = [
        Rule(m.GPU_LOST, ">=", 1, effect=fail, status=Status.FAILING, clear_after=STICKY, name="gpu lost"),
        # Uncorrected ECC in the current boot: the rank may compute on bad data; move it. Sticky
        # because the counter only goes back to 0 on a reset, which is when the operator untaints.
        Rule(m.ECC_UNCORRECTED_VOLATILE, ">", 0, kind="delta", effect=migrate, clear_after=STICKY,
             name="uncorrected ECC"),
        # Corrected ECC is normal in small numbers; a storm of them predicts an uncorrected one.
        Rule(m.ECC_CORRECTED_VOLATILE, ">=", 1000, kind="delta", window=3600, effect=exclude,
             clear_after=3600, name="corrected ECC storm"),
        Rule(m.RETIRED_PAGES_PENDING, ">=", 1, effect=migrate, clear_after=60, name="page retirement pending"),
        Rule(m.ROW_REMAP_PENDING, ">=", 1, effect=migrate, clear_after=60, name="row remap pending"),
        # The remapper has no spare rows left: fine today, not a GPU to hand a rank to.
        Rule(m.ROW_REMAP_FAILURE, ">=", 1, effect=exclude, clear_after=STICKY, name="row remap failure"),
        Rule(m.TEMPERATURE, ">=", 90, window=30, effect=migrate, clear_after=60, clear_threshold=85,
             name="temperature"),
        # Hardware slowdowns make a straggler of the whole job; sustained ones are worth a migration.
        Rule(m.THROTTLE_HW_THERMAL, ">=", 1, window=60, effect=migrate, clear_after=120, name="hw thermal slowdown"),
        Rule(m.THROTTLE_HW_POWER_BRAKE, ">=", 1, window=60, effect=migrate, clear_after=120,
             name="hw power brake"),
        Rule(m.PCIE_REPLAY, ">=", 100, kind="delta", window=60, effect=exclude, clear_after=600,
             name="PCIe replay storm"),
        Rule(m.NVLINK_LINKS_DOWN, ">=", 1, effect=migrate, clear_after=300, name="nvlink link down"),
        Rule(m.NVLINK_RECOVERY, ">=", 1, kind="delta", window=300, effect=migrate, clear_after=600,
             name="nvlink recovery errors"),
        Rule(m.NVLINK_REPLAY, ">=", 100, kind="delta", window=60, effect=exclude, clear_after=600,
             name="nvlink replay storm"),
    ]
    for code, effect in XID_EFFECTS.items():
        rules.append(Rule(m.XID, "==", code, effect=effect, status=_status_for(effect),
                          clear_after=STICKY if effect is fail else 600, name=f"XID {code}"))
    for value, (action, effect) in RECOVERY_ACTION_EFFECTS.items():
        rules.append(Rule(m.RECOVERY_ACTION, "==", value, effect=effect, status=_status_for(effect),
                          clear_after=60, name=f"recovery action {action}"))
    return tuple(rules)


@dataclass(frozen=True)
class LinkPolicy:
    """When a node's link counts as degraded (``tpassrun/agent/netwatch``) and what is done about it.

    Suspect: its round trip to etcd is ``rtt_factor`` x its peers' median and ``rtt_extra_ms`` more, or
    ``retrans_pct`` % of what its peers send it is sent again (and ``rtt_factor`` x that share for the other
    nodes), while the job's
    step time is ``slowdown_factor`` x its healthy baseline and ``slowdown_ms`` more. Suspect for ``hold_s``
    without a break: degraded, and with ``effect`` migrate and a ready spare on another node, its ranks move (a planned
    swap per rank); otherwise it is reported only. Healthy again after ``clear_s`` clear. Sampled every
    ``interval_s`` (figures the kernel keeps: nothing is sent to measure them)."""

    rtt_factor: float = 2.0
    rtt_extra_ms: float = 10.0
    retrans_pct: float = 1.0
    slowdown_factor: float = 1.15
    slowdown_ms: float = 10.0
    hold_s: float = 10.0
    clear_s: float = 30.0
    interval_s: float = 2.0
    effect: TaintEffect = TaintEffect.MIGRATE

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "effect":
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
                raise ValueError(f"link.{f.name} must be a number >= 0, got {v!r}")
        if self.rtt_factor < 1 or self.slowdown_factor < 1 or self.interval_s <= 0:
            raise ValueError("link.rtt_factor and link.slowdown_factor must be >= 1, link.interval_s > 0")
        if self.effect not in (TaintEffect.MIGRATE, TaintEffect.NONE):
            raise ValueError(f"link.effect must be migrate or none, got {self.effect.value}")

    def to_json(self) -> dict[str, Any]:
        return {f.name: (getattr(self, f.name).value if f.name == "effect" else getattr(self, f.name))
                for f in fields(self)}

    @classmethod
    def from_json(cls, data: Any) -> "LinkPolicy":
        if not isinstance(data, dict):
            raise ValueError("'link' must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown link field {unknown[0]!r} (known: {', '.join(sorted(known))})")
        args: dict[str, Any] = dict(data)
        if "effect" in args:
            try:
                args["effect"] = TaintEffect(args["effect"])
            except ValueError as exc:
                raise ValueError(f"link.effect: {exc}") from None
        return cls(**args)


@dataclass(frozen=True)
class Policy:
    """An ordered set of rules (several rules may watch the same metric), and the link thresholds."""

    rules: tuple[Rule, ...]
    link: LinkPolicy = field(default_factory=LinkPolicy)

    @classmethod
    def default(cls) -> "Policy":
        """GPU defaults (see ``_default_rules`` for each threshold and why)."""
        return cls(_default_rules())

    def merged(self, overrides: "Policy | tuple[Rule, ...]") -> "Policy":
        """These rules with ``overrides`` applied: a rule with the same label replaces ours, others are added."""
        extra = overrides.rules if isinstance(overrides, Policy) else tuple(overrides)
        by_label = {r.label: r for r in extra}
        kept = tuple(by_label.pop(r.label, r) for r in self.rules)
        return Policy(kept + tuple(r for r in extra if r.label in by_label), self.link)

    def to_json(self) -> dict[str, Any]:
        return {"v": 1, "rules": [r.to_json() for r in self.rules], "link": self.link.to_json()}

    @classmethod
    def from_json(cls, data: Any) -> "Policy":
        """``{"v": 1, "extends_default": false, "rules": [...]}`` -> Policy (ValueError on any problem)."""
        if not isinstance(data, dict):
            raise ValueError("policy must be an object with 'v' and 'rules'")
        if data.get("v") != 1:
            raise ValueError(f"policy version must be 1, got {data.get('v')!r}")
        unknown = sorted(set(data) - {"v", "rules", "extends_default", "link"})
        if unknown:
            raise ValueError(f"unknown policy field {unknown[0]!r}")
        raw_rules = data.get("rules", [])
        if not isinstance(raw_rules, list):
            raise ValueError("'rules' must be a list")
        rules = []
        for i, raw in enumerate(raw_rules):
            try:
                rules.append(Rule.from_json(raw))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"rule {i}: {exc}") from None
        extends = data.get("extends_default", False)
        if not isinstance(extends, bool):
            raise ValueError("'extends_default' must be true or false")
        link = LinkPolicy.from_json(data["link"]) if "link" in data else LinkPolicy()
        return replace(cls.default().merged(tuple(rules)) if extends else cls(tuple(rules)), link=link)

    @classmethod
    def load(cls, path: str) -> "Policy":
        """Read a policy file: ``.toml`` via tomllib, anything else as JSON."""
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise ValueError(f"{path}: cannot read policy: {exc.strerror or exc}") from None
        try:
            if os.path.splitext(path)[1].lower() == ".toml":
                data = tomllib.loads(raw.decode())
            else:
                data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(f"{path}: not valid {'TOML' if path.endswith('.toml') else 'JSON'}: {first_line}") from None
        try:
            return cls.from_json(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def with_rule(self, rule: Rule) -> "Policy":
        return self.merged((rule,))

    def without(self, label: str) -> "Policy":
        return Policy(tuple(r for r in self.rules if r.label != label), self.link)

    def replace_rule(self, label: str, **changes: Any) -> "Policy":
        return Policy(tuple(replace(r, **changes) if r.label == label else r for r in self.rules), self.link)
