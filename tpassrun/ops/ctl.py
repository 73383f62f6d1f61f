"""``tpassctl``: look at a running job and taint/untaint/drain its ranks through etcd.

Without ``--rdzv-endpoint``/``--rdzv-id``, the run comes from this machine's run registry
(:mod:`tpassrun.ops.registry`): the only one running, or the one with that id; ``tpassctl status`` alone lists
them when there are several. ``--node`` takes a node id or its hostname.

    tpassctl status  --rdzv-endpoint E --rdzv-id ID [--json]
    tpassctl events  [--rdzv-id ID] [--follow] [--json]
    tpassctl taint   --rdzv-endpoint E --rdzv-id ID (--rank R | --node N [--local-rank L]) --reason TEXT
                     [--effect migrate|exclude]
    tpassctl untaint --rdzv-endpoint E --rdzv-id ID (--rank R | --node N [--local-rank L] | --id ID)
    tpassctl drain   --rdzv-endpoint E --rdzv-id ID --node N --reason TEXT
    tpassctl pool    create|join|status|delete NAME --rdzv-endpoint E   (a spare pool: docs/pool.md)

Everything is read in one etcd range request over the run's prefix. Errors are one line on stderr and
exit code 1 (unreachable etcd, unknown run id, unknown node or rank).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tpassrun.ops.cleantext import clean
from tpassrun.ops.ctl_render import render_status, run_list_lines
from tpassrun.ops.ctl_wait import EtcdWait
from tpassrun.ops.ctl_width import columns, wrap
from tpassrun.ops.events import read_events
from tpassrun.ops.names import short_host, split_id
from tpassrun.ops.registry import CtlError
from tpassrun.ops.tally import RunTally, tally_of
from tpassrun.records import (
    HANDLED_RESTART,
    HealthRecord,
    Keys,
    NodeStatus,
    Phase,
    RunClosed,
    RunKeyError,
    SwapPlan,
    Taint,
    TaintEffect,
    TaintSource,
    carries_mac,
    generation_record,
    key_for,
    leader_of,
    load,
    node_info,
    run_key_from,
)
from tpassrun.records import register as register_run_key
from tpassrun.rendezvous import (
    EtcdConfig,
    EtcdStore,
    Generation,
    NodeInfo,
    RendezvousError,
    RendezvousSettings,
    read_private_file,
    refuse_inline_secrets,
)
from tpassrun.settings import envnames as E

# "fail" (kill the worker now, recover it unplanned) is a health-policy effect only: the node's own health
# daemon does the kill. From tpassctl, kill the worker yourself (the recovery is the same).
EFFECTS = (TaintEffect.MIGRATE.value, TaintEffect.EXCLUDE.value)
EFFECT_HELP = ("migrate: move the rank to a warm spare at the next step boundary and keep the slot out until "
               "untainted (default); exclude: leave the rank where it is, never hand the slot out as a spare")


def _parse_conf(text: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise CtlError(f"--rdzv-conf item {item!r} is not key=value")
        conf[key.strip()] = value.strip()
    return conf


@dataclass
class RunSnapshot:
    """Everything under one run's prefix, split by kind."""

    run_id: str
    generation: Generation | None = None
    leader: str | None = None
    closed: RunClosed | None = None
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    status: dict[str, NodeStatus] = field(default_factory=dict)
    health: dict[str, HealthRecord] = field(default_factory=dict)
    taints: dict[str, Taint] = field(default_factory=dict)
    swaps: dict[str, SwapPlan] = field(default_factory=dict)
    empty: bool = True
    # the sealed records shown (generation, leader, closed, nodes, swaps): "verified" (checked with the run key,
    # those without its MAC left out), "unverified" (they carry MACs, and tpassctl was given no key to check them)
    # or "unsealed" (no key, no MACs: a run without a run key)
    provenance: str = "unsealed"

    def workers(self) -> list[dict[str, Any]]:
        """Every worker row from ``status/<node>`` with its node id (for display)."""
        rows = []
        for node_id, status in sorted(self.status.items()):
            for w in status.workers:
                rows.append({"node_id": node_id, **w.to_json()})
        return rows

    def slot_of(self, node_id: str, local_rank: int | None) -> int | None:
        """The worker slot that runs ``local_rank`` on a node (the agents' status; at start slot == local rank)."""
        if local_rank is None:
            return None
        status = self.status.get(node_id)
        for w in status.workers if status else ():
            if w.local_rank == local_rank and not w.spare and w.rank is not None:
                return w.slot
        return local_rank

    def resolve_rank(self, rank: int) -> tuple[str, int | None, int | None]:
        """(node_id, local_rank, slot) of a global rank: the agents' status first (true after swaps), else the
        ranges of the generation."""
        for node_id, status in sorted(self.status.items()):
            for w in status.workers:
                if w.rank == rank and not w.spare:
                    return node_id, w.local_rank, w.slot
        gen = self.generation
        if gen is not None:
            for m in gen.members:
                if m.rank_offset <= rank < m.rank_offset + m.nproc:
                    return m.node_id, rank - m.rank_offset, rank - m.rank_offset
        world = gen.world_size if gen else 0
        raise CtlError(f"no rank {rank} in run {self.run_id!r} (world size {world})")

    def check_node(self, node_id: str, local_rank: int | None) -> None:
        gen = self.generation
        member = gen.member(node_id) if gen else None
        known = member is not None or node_id in self.status or (gen is not None and node_id in gen.spare_nodes)
        if not known:
            raise CtlError(f"no node {node_id!r} in run {self.run_id!r} (members: {_member_list(gen)})")
        if local_rank is None:
            return
        status = self.status.get(node_id)
        local_ranks = {w.local_rank for w in status.workers} if status else set()
        if member is not None:
            local_ranks |= set(range(member.nproc))
        if local_rank not in local_ranks:
            raise CtlError(f"node {node_id!r} has no local rank {local_rank}")

    def active_ranks(self, node_id: str) -> list[tuple[int, int | None]]:
        """(rank, local_rank) of the non-spare workers of a node."""
        status = self.status.get(node_id)
        rows = [w for w in status.workers if not w.spare and w.rank is not None] if status else []
        if rows:
            return sorted((w.rank, w.local_rank) for w in rows if w.rank is not None)
        member = self.generation.member(node_id) if self.generation else None
        if member is None:
            return []
        return [(member.rank_offset + i, i) for i in range(member.nproc)]

    def to_json(self) -> dict[str, Any]:
        return {
            "v": 1,
            "run_id": self.run_id,
            "provenance": self.provenance,
            "generation": self.generation.to_json() if self.generation else None,
            "leader": self.leader,
            "closed": self.closed.to_json() if self.closed else None,
            "nodes": {k: v.to_json() for k, v in self.nodes.items()},
            "status": {k: v.to_json() for k, v in self.status.items()},
            "health": {k: v.to_json() for k, v in self.health.items()},
            "taints": {k: v.to_json() for k, v in self.taints.items()},
            # the plan's secret (the transfer key's seed) is never shown
            "swaps": {k: {f: x for f, x in v.to_json().items() if f != "secret"} for k, v in self.swaps.items()},
        }


def _member_list(gen: Generation | None) -> str:
    return ", ".join(gen.member_ids) if gen and gen.members else "none"


async def read_snapshot(store: EtcdStore, prefix: str, run_id: str) -> RunSnapshot:
    """Every record of one run, typed; a malformed value is skipped (and logged once), never fatal."""
    snap = RunSnapshot(run_id, provenance="verified" if key_for(prefix) is not None else "unsealed")
    items, _ = await store.read_prefix_json(prefix)
    keys = Keys(prefix)
    for key, doc, rev, _create in items:
        snap.empty = False
        if snap.provenance == "unsealed" and carries_mac(doc):
            snap.provenance = "unverified"
        rest = keys.relative(key)
        kind, _, name = rest.partition("/")
        if rest == "generation":
            gen = load(generation_record, key, doc, rev)
            snap.generation = gen.with_revision(rev) if gen is not None else None
        elif rest == "leader":
            snap.leader = load(leader_of, key, doc, rev)
        elif rest == "closed":
            snap.closed = load(RunClosed.from_json, key, doc, rev)
        elif kind in _FAMILIES and name and "/" not in name:
            record = load(_FAMILIES[kind], key, doc, rev)
            if record is not None:
                getattr(snap, kind)[name] = record
    return snap


_FAMILIES: dict[str, Any] = {"nodes": node_info, "status": NodeStatus.from_json, "health": HealthRecord.from_json,
                             "taints": Taint.from_json, "swaps": SwapPlan.from_json}


def _out(text: str, *, file: Any = None, flush: bool = False) -> None:
    """``print`` for tpassctl's lines: node ids, taint and swap reasons are anyone's text (etcd, the command line),
    shown with their control characters escaped; wrapped to the terminal's width (:mod:`tpassrun.ops.ctl_width`)."""
    stream = file if file is not None else sys.stdout
    for line in wrap(clean(text), columns(stream)):
        print(line, file=stream, flush=flush)


def _taint(tid: str, node_id: str, local_rank: int | None, slot: int | None, rank: int | None, reason: str,
           effect: str) -> Taint:
    return Taint(id=tid, node_id=node_id, local_rank=local_rank, slot=slot, rank=rank, reason=reason,
                 effect=TaintEffect(effect), source=TaintSource.TPASSCTL.value, time=time.time())


def _new_taint_id() -> str:
    return "t" + uuid.uuid4().hex[:12]


async def _run(args: argparse.Namespace) -> int:
    conf = _parse_conf(args.rdzv_conf)
    refuse_inline_secrets(conf)
    entry = getattr(args, "registry_entry", None)
    if entry is not None and entry.credentials and "credentials_file" not in conf:
        conf["credentials_file"] = entry.credentials     # a standalone run's etcd: its 0600 credentials file
    conf.setdefault("read_timeout", "5")  # a CLI should not sit for torchrun's 60 s default
    etcd = EtcdConfig.from_endpoint(args.rdzv_endpoint, conf)
    etcd = EtcdConfig(**{**etcd.__dict__, "reconnect_timeout": etcd.read_timeout})
    prefix = RendezvousSettings.from_conf(args.rdzv_id, 1, 1, conf).run_prefix
    keys = Keys(prefix)
    try:   # the job's run key, when given as to its agents: swap plans without its MAC are then not shown as the job's
        run_key = run_key_from(conf, os.environ, read_private_file)
    except RunKeyError as exc:
        raise CtlError(str(exc)) from None
    unregister = register_run_key(prefix, run_key) if run_key is not None else (lambda: None)
    try:
        async with EtcdWait(etcd.display) as waiting:
            return await _on_store(args, etcd, prefix, keys, waiting.reached)
    finally:
        unregister()


async def _on_store(args: argparse.Namespace, etcd: EtcdConfig, prefix: str, keys: Keys,
                    reached: Callable[[], None]) -> int:
    async with EtcdStore(etcd) as store:
        snap = await read_snapshot(store, prefix, args.rdzv_id)
        reached()
        if snap.empty:
            raise CtlError(f"no run {args.rdzv_id!r} at etcd {etcd.display} (nothing under {prefix})")
        if args.command == "status":
            if args.watch:
                from tpassrun.ops import tui_live

                async def fetch() -> dict[str, Any]:
                    return (await read_snapshot(store, prefix, args.rdzv_id)).to_json()

                # A --standalone run's etcd ends with it: its launcher's event log (from the run registry,
                # looked up now, while the launcher still lists it) then says how it ended.
                event_log = _event_log_of(args)
                return await tui_live.watch(fetch, interval=args.interval, lost_after=args.lost_after,
                                            on_lost=lambda: tui_live.outcome_from_event_log(event_log))
            costs = _costs_of(args)
            if args.json:
                print(json.dumps({**snap.to_json(), "costs": costs.to_json() if costs else None}, indent=2,
                                 sort_keys=True))
            else:
                render_status(snap, costs)
            return 0
        if getattr(args, "node", None):
            args.node = _resolve_node(snap, args.node)
        if args.command == "taint":
            if args.rank is not None:
                node_id, local_rank, slot = snap.resolve_rank(args.rank)
                rank: int | None = args.rank
            else:
                snap.check_node(args.node, args.local_rank)
                node_id, local_rank, rank = args.node, args.local_rank, None
                slot = snap.slot_of(node_id, local_rank)
                if local_rank is not None:
                    rank = next((r for r, lr in snap.active_ranks(node_id) if lr == local_rank), None)
            tid = _new_taint_id()
            await store.put_json(keys.taint(tid),
                                 _taint(tid, node_id, local_rank, slot, rank, args.reason, args.effect).to_json())
            _out(f"tainted {_describe(node_id, local_rank, rank)} as {tid} ({args.effect}): {args.reason}",
                 flush=True)
            if args.no_wait or args.effect == TaintEffect.EXCLUDE.value:
                return 0
            return await _wait_for_taint(store, prefix, tid, args.wait_timeout)
        if args.command == "drain":
            snap.check_node(args.node, None)
            ranks = snap.active_ranks(args.node)
            if not ranks:
                raise CtlError(f"node {args.node!r} has no active ranks to drain")
            for rank, local_rank in ranks:
                tid = _new_taint_id()
                taint = _taint(tid, args.node, local_rank, snap.slot_of(args.node, local_rank), rank, args.reason,
                               TaintEffect.MIGRATE.value)
                await store.put_json(keys.taint(tid), taint.to_json())
                _out(f"tainted {_describe(args.node, local_rank, rank)} as {tid} (migrate): {args.reason}")
            return 0
        if args.command == "untaint":
            matches = [tid for tid, t in sorted(snap.taints.items()) if _matches(t, tid, args)]
            if not matches:
                raise CtlError("no matching taints")
            for tid in matches:
                await store.delete(keys.taint(tid))
                _out(f"removed taint {tid}")
            return 0
    raise CtlError(f"unknown command {args.command!r}")  # pragma: no cover (argparse rejects it)


async def _wait_for_taint(store: EtcdStore, prefix: str, tid: str, timeout: float, poll: float = 0.2) -> int:
    """Like ``kubectl drain``: follow the taint until its swap resumed training (0), it is queued for lack of a
    spare (0, said so), or the swap was given up / the run ended (1); print each phase as it happens."""
    deadline = time.monotonic() + timeout
    said: set[str] = set()
    started = time.monotonic()

    def say(key: str, text: str) -> None:
        if key not in said:
            said.add(key)
            _out(f"  {time.monotonic() - started:6.2f} s  {text}", flush=True)

    keys = Keys(prefix)
    while time.monotonic() < deadline:
        doc, rev = await store.get_json(keys.taint(tid))
        taint = load(Taint.from_json, keys.taint(tid), doc, rev) if doc is not None else None
        doc, rev = await store.get_json(keys.closed)
        closed = load(RunClosed.from_json, keys.closed, doc, rev) if doc is not None else None
        plan_id = taint.handled_by if taint is not None else None
        if taint is not None and plan_id == HANDLED_RESTART:
            say("restart", f"no live swap possible: {taint.state}; the job restarts with the slot quarantined")
            return 0
        if plan_id:
            doc, rev = await store.get_json(keys.swap(plan_id))
            plan = load(SwapPlan.from_json, keys.swap(plan_id), doc, rev) if doc is not None else None
            history = plan.history if plan is not None else ()
            for i, (phase_name, at) in enumerate(history):
                took = f" ({history[i - 1][0]} took {at - history[i - 1][1]:.3f} s)" if i else ""
                say(f"{plan_id}/{i}", f"swap {plan_id}: {phase_name}{took}")
            if plan is not None and plan.phase is Phase.DONE:
                _out(f"resumed: rank {plan.leaver.rank} now runs on {plan.joiner.node}/{plan.joiner.slot}")
                return 0
            if plan is not None and plan.phase is Phase.ABORTED:
                _out(f"tpassctl: error: swap {plan_id} aborted: {plan.reason}", file=sys.stderr)
                return 1
        elif taint is None:
            _out("the taint was removed before anything happened")
            return 0
        elif taint.state:
            if taint.state.startswith("reject"):
                _out(f"tpassctl: error: the job refused taint {tid}: {taint.state}", file=sys.stderr)
                return 1
            say("state", f"queued: {taint.state}")
            if "no spare" in taint.state or taint.state.startswith("wait"):
                _out(f"taint {tid} is queued for lack of a spare; it will be handled when one is free "
                      "(tpassctl events -f to follow)")
                return 0
        if closed is not None:
            _out(f"tpassctl: error: the run ended: {closed.reason}", file=sys.stderr)
            return 1
        await asyncio.sleep(poll)
    _out(f"tpassctl: error: nothing happened to taint {tid} within {timeout:g} s (it stays in place)",
          file=sys.stderr)
    return 1


def _describe(node_id: str, local_rank: int | None, rank: int | None) -> str:
    parts = [f"node {node_id}"]
    if local_rank is not None:
        parts.append(f"local rank {local_rank}")
    if rank is not None:
        parts.append(f"rank {rank}")
    return " ".join(parts)


def _matches(taint: Taint, tid: str, args: argparse.Namespace) -> bool:
    want_id: str | None = args.id          # --id
    want_rank: int | None = args.rank      # --rank
    if want_id is not None:
        return tid == want_id
    if want_rank is not None:
        return taint.rank == want_rank
    if taint.node_id != args.node:
        return False
    # a health taint names a slot, not a local rank (at start, slot i runs local rank i)
    return args.local_rank is None or taint.local_rank == args.local_rank or (
        taint.local_rank is None and taint.slot == args.local_rank)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--rdzv-endpoint", "--rdzv_endpoint",
                        help="etcd host[:port][,...] (default: the run's, from this machine's run registry)")
    common.add_argument("--rdzv-id", "--rdzv_id", help="the job's run id (default: the only run on this machine)")
    common.add_argument("--rdzv-conf", "--rdzv_conf", default="", help="k=v,... (cacert, user, read_timeout, ...)")
    common.add_argument("--no-color", action="store_true", help="no colour or style (as NO_COLOR=1 does)")
    parser = argparse.ArgumentParser(prog="tpassctl", description="Inspect and steer a running tpassrun job.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pool", help="a spare pool shared by many jobs: tpassctl pool create|join|status|delete NAME")

    status = sub.add_parser("status", parents=[common], help="generation, nodes, workers, taints, swaps, health")
    shape = status.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="print one JSON document")
    shape.add_argument("--watch", action="store_true",
                       help="live view until the run ends (exit 0 succeeded, 1 failed, 3 lost) or q; keys n/p page, / filter,"
                            " e expand; one summary line per change when not on a terminal")
    status.add_argument("--interval", type=float, default=0.5, help="seconds between refreshes with --watch")
    status.add_argument("--lost-after", type=float, default=10.0,
                        help="--watch: give up (exit 3) when etcd has not answered for this many seconds")

    taint = sub.add_parser("taint", parents=[common], help="mark a rank as bad (the job moves it to a spare)")
    target = taint.add_mutually_exclusive_group(required=True)
    target.add_argument("--rank", type=int)
    target.add_argument("--node")
    taint.add_argument("--local-rank", "--local_rank", type=int)
    taint.add_argument("--reason", required=True)
    taint.add_argument("--effect", choices=EFFECTS, default=TaintEffect.MIGRATE.value, help=EFFECT_HELP)
    taint.add_argument("--no-wait", action="store_true",
                       help="return once the taint is recorded (default: wait until the swap resumed or the taint"
                            " is queued for lack of a spare, printing each phase)")
    taint.add_argument("--wait-timeout", type=float, default=600.0, help="seconds to wait (default 600)")

    untaint = sub.add_parser("untaint", parents=[common], help="remove taints")
    target = untaint.add_mutually_exclusive_group(required=True)
    target.add_argument("--rank", type=int)
    target.add_argument("--node")
    target.add_argument("--id")
    untaint.add_argument("--local-rank", "--local_rank", type=int)

    events = sub.add_parser("events", parents=[common], help="print a run's event log, one line per event")
    events.add_argument("--follow", "-f", action="store_true", help="keep printing new events until the run ends")
    events.add_argument("--json", action="store_true", help="the raw JSON lines")

    drain = sub.add_parser("drain", parents=[common], help="taint every active rank of a node")
    drain.add_argument("--node", required=True)
    drain.add_argument("--reason", required=True)
    return parser


def _pick_run(args: argparse.Namespace) -> int | None:
    """Fill in ``--rdzv-endpoint``/``--rdzv-id`` from the run registry; an exit code when there is nothing to
    pick (several runs listed for ``status``), else None."""
    from tpassrun.ops.registry import list_runs

    # looked up even when both are given: a standalone run's etcd takes its per-run credentials, which only the
    # registry entry points at (the demo's `tpassctl taint --rdzv-endpoint E --rdzv-id I` was refused: "user name
    # is empty"); a run not listed here is reached with what the command line says
    try:
        runs = list_runs()
    except Exception:  # an unusable registry: a run named on the command line is reached without it
        if not (args.rdzv_endpoint and args.rdzv_id):
            raise
        runs = []
    if args.rdzv_id:
        runs = [r for r in runs if r.run_id == args.rdzv_id]
    if args.rdzv_endpoint:
        runs = [r for r in runs if r.endpoint == args.rdzv_endpoint]
    if len(runs) == 1:
        run = runs[0]
        args.rdzv_endpoint, args.rdzv_id = args.rdzv_endpoint or run.endpoint, args.rdzv_id or run.run_id
        args.rdzv_conf = args.rdzv_conf or run.rdzv_conf
        args.registry_entry = run
        return None
    if args.command == "events" and not runs:
        raise CtlError("no such run on this machine (tpassctl events reads the event log of a local run)")
    if args.rdzv_endpoint and args.rdzv_id:
        return None
    if not runs:
        raise CtlError("no tpassrun runs on this machine; give --rdzv-endpoint and --rdzv-id")
    if args.command == "status" and not args.watch and not args.json:
        _out(f"{len(runs)} runs on this machine (pick one with --rdzv-id):")
        for r in runs:
            for line in run_list_lines(r, time.time()):
                _out(line)
        return 0
    raise CtlError(f"{len(runs)} runs on this machine: pick one with --rdzv-id ({', '.join(r.run_id for r in runs)})")


def _event_log_of(args: argparse.Namespace) -> str | None:
    entry = getattr(args, "registry_entry", None)
    if entry is None:
        try:
            from tpassrun.ops.registry import list_runs

            entry = next((r for r in list_runs() if r.run_id == args.rdzv_id and r.endpoint == args.rdzv_endpoint),
                         None)
        except Exception:  # noqa: BLE001 - no registry (not private, unreadable): the watch goes on without it
            entry = None
    return entry.event_log if entry is not None else None


def _costs_of(args: argparse.Namespace) -> RunTally | None:
    """What failures cost the run so far, from its launcher's event log through the summary's own reducer
    (tpassrun/ops/tally.py), so status and the summary say the same; None for a run not on this machine."""
    path = _event_log_of(args)
    if not path:
        return None
    try:
        return tally_of(read_events(path))
    except OSError:
        return None


def _resolve_node(snap: RunSnapshot, node: str) -> str:
    """A node id, or a name of exactly one node of the run (ids are ``host-pid-rand``; a host, its short name,
    or ``host-pid``: the names the console and status show, tpassrun/ops/names.py)."""
    gen = snap.generation
    known = set(snap.status) | set(snap.nodes) | (set(gen.member_ids) if gen else set())
    if node in known:
        return node
    hits = sorted(n for n in known if node in (split_id(n)[0], short_host(split_id(n)[0]), "-".join(n.rsplit("-", 2)[:2])))
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        raise CtlError(f"host {node!r} runs several nodes of run {snap.run_id!r}: {', '.join(hits)}")
    return node   # check_node says it is unknown


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["pool"]:    # a spare pool is not a run: its own verbs (tpassrun.pool.ctl)
        from tpassrun.pool import pool_main

        return pool_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "no_color", False):
        os.environ[E.NO_COLOR] = "1"     # what every rich Console of this process reads (no-color.org)
    if getattr(args, "local_rank", None) is not None and getattr(args, "node", None) is None:
        parser.error("--local-rank needs --node")
    try:
        picked = _pick_run(args)
        if picked is not None:
            return picked
        if args.command == "events":
            from tpassrun.ops.ctl_events import print_events

            return print_events(args.registry_entry, follow=args.follow, raw=args.json)
        return asyncio.run(_run(args))
    except (CtlError, RendezvousError) as exc:
        _out(f"tpassctl: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
