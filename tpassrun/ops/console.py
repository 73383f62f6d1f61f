"""One console line per event, and the exit summary: what an operator sees from the launcher.

Everything the agent and the swapper decide is already an event (:mod:`tpassrun.ops.events`); this module turns
the stream into human lines in torchrun's logger format (``I1123 10:37:45.123000 <pid> <where>] <message>``)
with ``[node ...]`` / ``[rank N]`` prefixes, without touching the code that emits them. :func:`describe` is a
pure function of (tracker state, event); the run's tally (what failures cost: :mod:`tpassrun.ops.tally`) is a
reducer of its own, fed the same events.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Any, Callable, Mapping, TextIO

from tpassrun.ops.cleantext import clean
from tpassrun.ops.names import NodeNames, split_id
from tpassrun.ops.tally import HOW_TO_KNOW, RunTally

WAITING_EVERY_S = 10.0


def _pool_need(ev: Mapping[str, Any], name: Callable[[Any], str]) -> str:
    """What a pool event is for: ``rank N ...`` (a dead rank's need, said as is) or ``node H lost``."""
    lost = str(ev.get("lost_node"))
    return lost if lost.startswith("rank ") else f"node {name(lost)} lost"


def _secs(x: Any) -> str:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return "?"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def _bytes(n: Any) -> str:
    try:
        v = float(n)
    except (TypeError, ValueError):
        return "? bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "bytes" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} GiB"


def _error_type(ev: dict[str, Any]) -> str:
    """The exception's class name of an event carrying ``error_type`` (``torch.distributed.DistError`` ->
    ``DistError``), else the head of its ``error`` text (``RuntimeError: ...`` -> ``RuntimeError``)."""
    qual = str(ev.get("error_type") or "")
    return qual.rsplit(".", 1)[-1] if qual else str(ev.get("error") or "an exception").split(":", 1)[0]


def _rank(ev: dict[str, Any]) -> str:
    r = ev.get("rank")
    return f"[rank {r}] " if r is not None else ""


@dataclasses.dataclass
class _Swap:
    kind: str = "planned"
    rank: Any = None
    phase: str = ""
    phase_at: float = 0.0
    led_here: bool = False
    nbytes: int = 0
    boundary: int | None = None
    reason: str = ""
    phase_reasoned: bool = False    # the leader's reason for the current phase was printed


class Describer:
    """Turns events into lines; keeps just enough state for durations and changes (health, phases)."""

    def __init__(self) -> None:
        self.swaps: dict[str, _Swap] = {}
        self.health: dict[Any, str | None] = {}     # device -> its last verdict's status
        self.tally = RunTally()      # fed every event first (tpassrun/ops/tally.py): the lines only read it
        self._lost: set[str] = set()       # nodes declared lost (one may come back as a spare node)
        self.name = NodeNames()      # a node's name unique in the run (tpassrun/ops/names.py)

    def _swap(self, sid: Any) -> _Swap:
        return self.swaps.setdefault(str(sid), _Swap())

    def describe(self, ev: dict[str, Any]) -> str | None:  # one branch per event kind, on purpose
        self.tally.feed(ev)
        self.name.see(ev)
        name, now, t = ev.get("event"), float(ev.get("mono") or 0.0), self.tally
        sid = ev.get("swap_id")
        if name == "agent_started":
            return (f"run {ev.get('run_id')} at etcd {ev.get('endpoint')}: {ev.get('nproc')} rank(s) and "
                    f"{ev.get('spares')} spare(s) per node; event log {ev.get('event_log') or '-'} "
                    "(look: tpassctl status; follow: tpassctl events -f)")
        if name == "metrics_serving":
            return f"Prometheus metrics at http://{ev.get('addr')}:{ev.get('port')}/metrics"
        if name == "generation_joined":
            members = [self.name(m) for m in ev.get("members") or []]
            shown = ", ".join(members[:8]) + (f" (+{len(members) - 8} more)" if len(members) > 8 else "")
            return (f"generation {ev.get('generation')} formed: world size {ev.get('world_size')}, "
                    f"{len(members)} node(s): {shown}")
        if name == "waiting_for_nodes":
            missing, nodes = ev.get("missing"), [self.name(n) for n in ev.get("nodes") or []]
            return (f"waiting for nodes ({_secs(ev.get('seconds'))}): {ev.get('joined')} of {ev.get('needed')} "
                    f"joined" + (f" ({', '.join(nodes[:8])})" if nodes else "")
                    + (f"; missing: {', '.join(map(str, missing))}" if missing else ""))
        if name == "workers_started":
            slots = ev.get("slots") or []
            ranks = [s for s in slots if s.get("rank") is not None]
            spares = [s for s in slots if s.get("rank") is None]
            return (f"generation {ev.get('generation')}: started {len(ranks)} worker(s)"
                    + (f" and {len(spares)} spare(s) (slots {', '.join(str(s.get('slot')) for s in spares)})"
                       if spares else ""))
        if name == "spare_ready":
            return f"spare ready: slot {ev.get('slot')} (pid {ev.get('pid')}), warm in tpassrun.init()"
        if name in ("spare_lost", "spare_returned"):
            what = "spare lost" if name == "spare_lost" else "spare back in the pool"
            return f"{what}: slot {ev.get('slot')}" + (f" ({ev['reason']})" if ev.get("reason") else "")
        if name == "taint_received" or name == "health_taint":
            who = f"rank {ev.get('rank')}" if ev.get("rank") is not None else f"slot {ev.get('slot')}"
            where = f" on {self.name(ev.get('target_node'))}" if ev.get("target_node") else ""
            return (f"taint received: {who}{where} ({ev.get('effect') or 'migrate'}, from "
                    f"{ev.get('source') or 'health'}): {ev.get('reason')}")
        if name in ("scheduler_event", "scheduler_error", "scheduler_released"):
            return str(ev.get("message"))
        if name == "handed_back":
            return f"handed back to the scheduler, leaving the job ({ev.get('reason')})"
        if name == "handback_refused":
            return f"not leaving the job: rank(s) {ev.get('ranks')} still run here ({ev.get('reason')})"
        if name == "node_handed_back":
            return (f"node {self.name(ev.get('lost_node'))} left the job, handed back to the scheduler "
                    f"({ev.get('reason')})")
        if name == "health_untaint":
            return f"taint lifted: device {ev.get('device')}: {ev.get('reason')}"
        if name == "health_verdict":
            dev, status = ev.get("device"), ev.get("status")
            before = self.health.get(dev)
            self.health[dev] = status
            if before == status or (before is None and status in ("healthy", "ok")):
                return None
            return f"health: device {dev}: {before or 'unknown'} -> {status}" + (
                f" ({ev['reason']})" if ev.get("reason") else "")
        if name == "health_kill":
            return f"{_rank(ev)}health: killed pid {ev.get('pid')}: {ev.get('reason')}"
        if name == "health_message":
            return str(ev.get("message"))
        if name in ("link_ridden_out", "link_flap_broke", "link_degraded", "link_healthy", "link_ambiguous",
                    "address_loopback"):
            return str(ev.get("line"))     # tpassrun/agent/netwatch wrote the line (flap_line, the link verdict)
        if name == "worker_exit":
            if ev.get("code") == 0 or ev.get("state") not in ("running",):
                return None
            return f"{_rank(ev)}worker pid {ev.get('pid')} (slot {ev.get('slot')}) exited with code {ev.get('code')}"
        if name == "user_error":
            return (f"{_rank(ev)}{ev.get('why')} at step {ev.get('step')}: a user error, not handed to a spare; "
                    "following torchrun's failure path")
        if name == "exception_cause":
            error = str(ev.get("error") or "")
            if ev.get("cause") == "casualty":   # a peer's failure seen from here (gloo's text): its type says enough
                return (f"{_rank(ev)}step {ev.get('step')} raised {_error_type(ev)}: {ev.get('why')} "
                        f"(judged in {ev.get('seconds')} s); it waits for the recovery")
            return (f"{_rank(ev)}step {ev.get('step')} raised {error[:150]}{'...' if len(error) > 150 else ''}: "
                    f"{ev.get('why')} "
                    f"(judged in {ev.get('seconds')} s); following torchrun's path")
        if name == "step_interrupted":
            by = f" by {ev['by']}" if ev.get("by") else f": its collective failed ({_error_type(ev)})"
            return f"{_rank(ev)}step {ev.get('step')} interrupted{by}; waiting for recovery"
        if name == "worker_died":
            return f"{_rank(ev)}died at step {ev.get('step')}: {ev.get('why') or 'exit code ' + str(ev.get('code'))}"
        if name == "failure_dropped":
            return f"{_rank(ev)}its death is not reported: {ev.get('reason')}"
        if name == "shard_mirror":
            if not ev.get("bytes_per_refresh"):     # HSDP: its replicas hold its shards (tpassrun/worker/sharded.py)
                return (f"{_rank(ev)}sharded state kept in local copies only, not mirrored (under HSDP its "
                        f"declared replicas hold it): {_bytes(ev.get('local_held'))}")
            where = f"node {self.name(ev['buddy'])}'s memory" if ev.get("buddy") else "this agent's memory (no other node)"
            every = (f"every {ev['interval']} step(s)" if ev.get("interval")
                     else "every step while it measures the cost (--shard-mirror-interval auto)")
            return (f"{_rank(ev)}sharded state mirrored to {where}: {_bytes(ev.get('bytes_per_refresh'))} {every}; "
                    f"its local copies hold {_bytes(ev.get('local_held'))}")
        if name == "recovery_decided":
            return f"recovery decided ({ev.get('action')}): {ev.get('reason')}"
        if name == "swap_decided":
            return f"swap {sid} decided: {ev.get('reason')}"
        if name == "swap_waiting":
            return f"taint {ev.get('taint')} queued ({ev.get('action')}): {ev.get('reason')}"
        if name == "taint_coalesced":
            return f"taint {ev.get('taint')} needs no swap: {ev.get('reason')}"
        if name == "swap_phase":
            s = self._swap(sid)
            s.led_here = True
            return self._phase_line(sid, s, str(ev.get("phase")), now, ev.get("reason"))
        if name is not None and name.startswith("swap_") and name[5:] in (
                "pause", "boundary", "transfer", "send", "reform", "done", "aborted"):
            s = self._swap(sid)
            s.kind, s.rank = ev.get("kind") or s.kind, ev.get("rank")
            if ev.get("boundary") is not None:
                s.boundary = int(ev["boundary"])
            if name == "swap_pause" and not s.phase:
                s.phase, s.phase_at = "pause", now
                if s.kind == "node":
                    return (f"[ranks {ev.get('ranks')}] node recovery {sid}: pausing the workers (node "
                            f"{self.name(ev.get('lost_node'))} lost)")
                label = "recovery" if s.kind == "unplanned" else "swap"
                return f"[rank {s.rank}] {label} {sid}: pausing the workers"
            if s.led_here or s.phase == name[5:]:
                return None
            return self._phase_line(sid, s, name[5:], now, None)
        if name == "swap_transfer_end":
            s = self._swap(sid)
            s.nbytes = int(ev.get("nbytes") or 0)
            return f"swap {sid}: {_bytes(ev.get('nbytes'))} received in {_secs(ev.get('seconds'))} ({ev.get('checksum')})"
        if name == "swap_transfer_failed":
            return f"swap {sid}: transfer attempt {ev.get('attempt')} failed: {ev.get('error')}"
        if name == "swap_resumed":
            s = self._swap(sid)
            pause = float(ev.get("seconds") or 0.0)
            last = t.last_swap()
            redone = last.redone if last is not None and last.swap_id == str(sid) else 0
            label = "recovered" if s.kind == "unplanned" else "swapped"
            moved = f", {_bytes(s.nbytes)} moved" if s.nbytes else ""
            return (f"[rank {ev.get('rank')}] {label} and resumed (swap {sid}): paused {_secs(pause)}{moved}, "
                    f"0 steps lost, {redone} redone")
        if name == "swap_aborted_here":
            s = self._swap(sid)
            held = next((h for i, h in reversed(t.aborted) if i == str(sid)), None)
            return f"swap {sid} aborted after {_secs(held) if held is not None else '?'}: {s.reason or ev.get('reason')}"
        if name == "node_lost":
            self._lost.add(str(ev.get("lost_node")))
            return f"node {self.name(ev.get('lost_node'))} lost"
        if name == "spare_node_joined":
            joined = str(ev.get("joined"))
            if joined in self._lost:
                return (f"node {self.name(joined)}, lost earlier, is back as a spare node (its ranks stay where they "
                        "moved; its slots serve the next failure)")
            return f"spare node {self.name(joined)} joined (its slots serve the next failure)"
        if name == "agent_gone":
            return f"node {self.name(ev.get('lost_node'))}: {ev.get('reason')}"
        if name in ("pool_claimed", "pool_waiting", "pool_gave_up"):   # own spares first, the pool, a restart last
            waited = (f" for {_secs(ev['waited'])} of --pool-wait {_secs(ev.get('wait_limit'))}"
                      if ev.get("waited") is not None and ev.get("wait_limit") is not None else "")
            what = {"pool_claimed": f"claimed pool node {self.name(ev.get('pool_node'))} from pool {ev.get('pool')}",
                    "pool_waiting": f"waiting for pool {ev.get('pool')}{waited}",
                    "pool_gave_up": f"pool {ev.get('pool')} gave nothing: torchrun's restart"}[name]
            return f"{_pool_need(ev, self.name)}, no own spare ready: {what} ({ev.get('reason')})"
        if name == "pool_given_back":
            return f"given back to the spare pool ({t.given_back}): no rank runs here, leaving the job"
        if name == "pool_node_left":
            return (f"pool node {self.name(ev.get('pool_node'))} left the job as given back to pool {ev.get('pool')} "
                    f"(its spare node {self.name(ev.get('lost_node'))} held no rank)")
        if name == "pool_released":
            return f"pool node {self.name(ev.get('pool_node'))} given back to pool {ev.get('pool')}: {ev.get('reason')}"
        if name == "pool_preempting":
            return (f"{_pool_need(ev, self.name)}, no own spare ready: pre-empting pool node "
                    f"{self.name(ev.get('pool_node'))} from job {ev.get('victim')} (priority "
                    f"{ev.get('victim_priority')} < {ev.get('priority')})")
        if name == "pool_taken_back":
            return str(ev.get("reason"))
        if name == "pool_members_failed":
            return f"pool {ev.get('pool')}: pool members given up: {ev.get('reason')}"
        if name == "pool_members_claimed":
            return (f"pool {ev.get('pool')}: {len(ev.get('pool_nodes') or [])} of {ev.get('wanted')} pool node(s) "
                    f"claimed as members (priority {ev.get('priority')}): {ev.get('reason')}")
        if name == "node_lost_decided":
            if ev.get("action") != "plan":
                return None   # the fallback line says it
            return f"node {self.name(ev.get('lost_node'))}: live recovery decided: {ev.get('reason')}"
        if name == "recovery_superseded":
            return f"swap {sid} given up: {ev.get('reason')}"
        if name == "swap_node_dropped":
            return f"swap {sid}: {ev.get('reason')}"
        if name == "ranks_recovered":
            pause = float(ev.get("seconds") or 0.0)
            return (f"ranks {ev.get('ranks')} recovered live on {', '.join(self.name(n) for n in ev.get('to') or [])} "
                    f"at step {ev.get('boundary')} (swap {sid}): paused {_secs(pause)}, 0 steps lost")
        if name == "collectives_broken":
            return (f"node {self.name(ev.get('lost_node'))} lost: ranks {ev.get('ranks')} broken out of their "
                    f"collectives (swap {sid})")
        if name == "rank_caught_up":
            return (f"[rank {ev.get('rank')}] mixed commit: caught up to step {ev.get('step')} from rank "
                    f"{ev.get('donor')} (swap {sid}, {_bytes(int(ev.get('nbytes') or 0))})")
        if name == "node_recovered":
            pause = float(ev.get("seconds") or 0.0)
            also = "".join(f", {self.name(n)}" for n in ev.get("also") or [])
            return (f"node {self.name(ev.get('lost_node'))}{also} lost: ranks {ev.get('ranks')} recovered live on "
                    f"{', '.join(self.name(n) for n in ev.get('to') or [])} at step {ev.get('boundary')} (swap {sid}): "
                    f"paused {_secs(pause)}, 0 steps lost")
        if name == "replicas_checked":
            return _replicas_line(ev)
        if name == "store_moved":
            return f"the workers' store moved to {ev.get('addr')}:{ev.get('port')}: {ev.get('reason')}"
        if name == "mirror_push_failed":
            return f"mirror: cannot copy light state to buddy {self.name(ev.get('buddy'))}: {ev.get('error')}"
        if name == "fallback":
            return f"fallback to torchrun's whole-group restart: {ev.get('reason')}"
        if name == "hang_detected":
            if ev.get("what") == "stopped":
                return (f"{_rank(ev)}hang: slot {ev.get('slot')} ({ev.get('role')}, {ev.get('phase')}) stopped for "
                        f"{_secs(ev.get('seconds'))} (pid {ev.get('pid')}, state {ev.get('proc_state')}); killing it")
            return (f"{_rank(ev)}hang: no step for {_secs(ev.get('seconds'))} at step {ev.get('step')} "
                    f"(pid {ev.get('pid')}, state {ev.get('proc_state')}); killing it")
        if name == "timer_expired":
            if not ev.get("sent"):
                return (f"file timer {ev.get('scope')!r} of pid {ev.get('pid')} expired; not a worker of this node, "
                        "no signal sent")
            return (f"{_rank(ev)}file timer {ev.get('scope')!r} expired: sent {ev.get('signal')} to pid "
                    f"{ev.get('pid')}")
        if name == "hang_held":
            silent = ", ".join(self.name(n) for n in ev.get("silent") or [])
            return (f"ranks {ev.get('ranks')}: no step for {_secs(ev.get('seconds'))}, and node(s) {silent} do not "
                    f"answer: not killing ranks blocked on them; their lease ({ev.get('lease_s')} s) decides")
        if name == "generation_ended":
            return f"generation {ev.get('generation')} ended ({ev.get('outcome')}): {ev.get('reason')}"
        if name == "unmanaged_death":
            return f"[rank {ev.get('rank')}] died (exit code {ev.get('code')}): {ev.get('reason')}"
        if name == "training_resumed":
            took = f" (it took {_secs(t.restarts[-1].down_s)} from the failure)" if t.restarts else ""
            return (f"training resumed at step {ev.get('step')} after the whole-group restart{took}: "
                    f"{int(ev.get('redone') or 0)} step(s) run again (reached step {ev.get('reached')} before; "
                    f"~{_secs(ev.get('redone_s'))})")
        if name == "restart":
            return f"whole-group restart ({ev.get('remaining')} left): {ev.get('reason')}"
        if name == "etcd_connection_lost":
            return f"etcd unreachable ({ev.get('reason')}); reconnecting, the workers keep running"
        if name == "etcd_connection_overdue":
            return (f"etcd still unreachable after {_secs(ev.get('seconds'))}: rendezvous requests fail until it "
                    f"is back (still reconnecting)")
        if name == "etcd_connection_restored":
            return f"etcd reachable again after {_secs(ev.get('seconds'))}"
        if name == "lease_regranted":
            return f"etcd lease re-granted and this node re-registered ({ev.get('reason')})"
        if name in ("membership_change", "lease_lost", "fenced", "slot_quarantined",
                    "migrate_back_requested", "signal", "etcd_hosted"):
            detail = ", ".join(f"{k}={v}" for k, v in ev.items() if k not in ("event", "time", "mono", "node"))
            return f"{name.replace('_', ' ')}: {detail}"
        if name == "plans_unauthenticated":
            return f"warning: {ev.get('reason')}"
        return None

    def _phase_line(self, sid: Any, s: _Swap, phase: str, now: float, reason: Any) -> str | None:
        label = {"unplanned": "recovery", "node": "node recovery"}.get(s.kind or "", "swap")
        who = "ranks of a lost node" if s.kind == "node" else f"rank {s.rank}"
        if phase == s.phase:
            # the leader's decision and this node's part of it: said once, but the leader's reason (why this
            # resume step, a mixed commit) is never lost when this node's part was written first
            if not reason or s.phase_reasoned or phase in ("aborted", "done"):
                return None
            s.phase_reasoned = True
            return f"[{who}] {label} {sid}: {phase}: {reason}"
        took = f" ({s.phase} took {_secs(now - s.phase_at)})" if s.phase and s.phase_at else ""
        s.phase, s.phase_at, s.phase_reasoned = phase, now, bool(reason)
        if phase == "aborted":
            s.reason = str(reason or "")
        if phase == "done":
            return None   # swap_resumed says it, with the pause
        return f"[{who}] {label} {sid}: {phase}{took}" + (f": {reason}" if reason else "")


def _replicas_line(ev: dict[str, Any]) -> str:
    """The replica check after a swap or recovery (tpassrun/worker/replicas.py): passed, repaired, or a restart."""
    step = ev.get("step")
    if ev.get("ok"):
        if ev.get("recheck"):
            return f"replicas agree again at step {step} after the repair ({ev.get('ranks')} rank(s) compared)"
        if not ev.get("groups"):
            return f"replica check at step {step}: no rank has a replica to compare with (each holds its own state)"
        return (f"replicas agree at step {step}: {ev.get('ranks')} rank(s) in {ev.get('groups')} replica group(s) hold "
                f"identical state ({_bytes(ev.get('nbytes'))} digested per rank in {_secs(ev.get('seconds'))})")
    what = "still differ after the repair" if ev.get("recheck") else "MISMATCH"
    then = "no replica to trust: whole-group restart" if ev.get("action") == "restart" else "repairing from a replica"
    return f"replica check at step {step}: {what}: {ev.get('detail')} ({then})"


def cost_line(t: RunTally, code: Any) -> str:
    """What failures cost, in one line (the summary's third; ``tpassctl status`` says it while the run runs,
    ``code`` None). A cost tpassrun cannot see is said to be unknown, never 0 (tpassrun/ops/tally.py)."""
    steps_lost, goodput = t.restart_redone, t.goodput
    head = (f"time lost to failures {'' if t.known else 'at least '}{_secs(t.lost)}, steps lost "
            f"{'unknown' if steps_lost is None else steps_lost}, steps redone {t.steps_redone}")
    if code is None:
        return head + (", goodput unknown" if goodput is None else f", goodput so far {goodput:.1f}%")
    if code not in (0, "0"):
        return head + ", goodput not counted: the run failed (its progress since the script's last checkpoint is lost)"
    if t.given_back:
        return head + f", given back to the spare pool ({t.given_back}): no rank ran here at the end"
    return head + (", goodput unknown" if goodput is None else f", goodput {goodput:.1f}%")


def summary_lines(t: RunTally, code: Any) -> list[str]:
    """The exit summary: what ran, what it cost, and (when a cost is unknown) how to make it known."""
    planned = [s.pause_s for s in t.swaps if s.kind not in ("unplanned", "node")]
    unplanned = [s.pause_s for s in t.swaps if s.kind in ("unplanned", "node")]

    def pauses(xs: list[float]) -> str:
        return "" if not xs else f" (pause {', '.join(_secs(x) for x in xs[:6])}{', ...' if len(xs) > 6 else ''})"

    lines = [f"summary: exit code {code}, wall time {_secs(t.wall)}",
             f"summary: {len(planned)} swap(s){pauses(planned)}, {len(unplanned)} recover(ies){pauses(unplanned)}, "
             f"{len(t.restarts)} whole-group restart(s), {t.hang_kills} hang kill(s)"
             + (f", {len(t.aborted)} aborted swap(s)" if t.aborted else ""),
             f"summary: {cost_line(t, code)}"]
    if not t.known:
        lines.append(f"summary: unknown: {HOW_TO_KNOW}")
    return lines


#: events the console (and ``tpassctl events``) shows as warnings; every other line is informational
WARNING_EVENTS = frozenset({"fallback", "user_error", "hang_detected", "timer_expired", "worker_died",
                            "unmanaged_death", "swap_aborted_here", "swap_transfer_failed", "fenced", "etcd_connection_lost",
                            "etcd_connection_overdue", "link_degraded", "link_flap_broke", "link_ambiguous",
                            "address_loopback"})


def level_of(ev: dict[str, Any]) -> str:
    """The glog level letter of an event's console line: ``W`` for the warnings (and a replica check that found a
    mismatch), else ``I``."""
    return "W" if ev.get("event") in WARNING_EVENTS or (ev.get("event") == "replicas_checked"
                                                        and not ev.get("ok")) else "I"


def log_prefix(pid: int, now: float | None = None, level: str = "I", where: str = "tpassrun/agent") -> str:
    """torchrun's (glog-style) logger prefix: ``I1123 10:37:45.123456 4242 <where>] ``."""
    now = time.time() if now is None else now
    lt = time.localtime(now)
    return f"{level}{lt.tm_mon:02d}{lt.tm_mday:02d} {time.strftime('%H:%M:%S', lt)}.{int(now % 1 * 1e6):06d} {pid} {where}] "


class GlogFormatter(logging.Formatter):
    """Python log records in the console's one format (torchrun's glog-style prefix): ``W1123 10:37:45.123456
    4242 tpassrun/mirror] message``, so the launcher's own warnings read like its event lines; the message is
    :func:`~tpassrun.ops.cleantext.clean` like them (a node id or a reason from etcd must not drive the terminal), a
    traceback keeps its lines."""

    def format(self, record: logging.LogRecord) -> str:
        # the message's own format may span lines (torchrun's OMP_NUM_THREADS banner); what is put into it (a
        # node id, a reason, an error from elsewhere) is cleaned as one line, so it can neither forge a line nor
        # drive the terminal
        args = record.args
        if isinstance(args, dict):
            args = {k: _clean_arg(v) for k, v in args.items()}
        elif args:
            args = tuple(_clean_arg(a) for a in args)
        text = clean(str(record.msg) % args if args else str(record.msg), block=True)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text = f"{text}\n{clean(record.exc_text, block=True)}"
        level = record.levelname[:1] if record.levelname[:1] in "DIWEC" else "I"
        return log_prefix(record.process or os.getpid(), record.created, "E" if level == "C" else level,
                          where=record.name.replace(".", "/")) + text


def _clean_arg(value: Any) -> Any:
    return clean(value) if isinstance(value, (str, BaseException)) else value


def format_line(ev: dict[str, Any], line: str, pid: int, *, wall: float | None = None,
                name: Callable[[Any], str] | None = None) -> str:
    """One console line for ``ev`` (no newline): the logger prefix (its level: :func:`level_of`), the node, the text,
    every control character of it shown escaped (a taint reason or a node id is anyone's text: it must not drive
    the terminal)."""
    prefix = log_prefix(pid, float(ev.get("time") or (time.time() if wall is None else wall)), level_of(ev))
    node = (name or (lambda n: split_id(str(n or "?"))[0]))(ev.get("node"))
    return clean(f"{prefix}[node {node}] {line}")


class ConsoleReporter:
    """An :class:`~tpassrun.ops.events.EventLog` listener printing one line per event (stderr, like torchrun)."""

    def __init__(self, *, stream: TextIO | None = None, pid: int | None = None,
                 enabled: bool = True, wall: Callable[[], float] = time.time) -> None:
        self.stream = stream
        self.pid = os.getpid() if pid is None else pid
        self.enabled = enabled
        self.describer = Describer()
        self._wall = wall

    @property
    def tally(self) -> RunTally:
        return self.describer.tally

    def __call__(self, ev: dict[str, Any]) -> None:
        line = self.describer.describe(ev)
        if ev.get("event") == "agent_exit":
            for s in summary_lines(self.tally, ev.get("code")):
                self._emit(ev, s, node=True)
            return
        if line is not None:
            self._emit(ev, line, node=True)

    def _emit(self, ev: dict[str, Any], line: str, *, node: bool) -> None:
        if not self.enabled:
            return
        text = format_line(ev, line, self.pid, wall=self._wall(), name=self.describer.name) + "\n"
        stream = self.stream or sys.stderr
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):
            self.enabled = False   # a closed or full stderr: nothing else to tell it with
