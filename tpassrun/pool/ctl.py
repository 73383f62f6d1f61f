"""``tpassctl pool create|join|status|delete NAME``: a spare pool's life from the command line.

    tpassctl pool create NAME --rdzv-endpoint E            (the pool key: $TPASSRUN_POOL_KEY or
    tpassctl pool join   NAME --rdzv-endpoint E --nproc-per-node N [--local-addr A] [--metrics-port P]
    tpassctl pool status NAME --rdzv-endpoint E [--json | --prometheus]
    tpassctl pool delete NAME --rdzv-endpoint E             --rdzv-conf pool_key_file=PATH)

Errors are one line on stderr and exit code 1. ``status`` reads everything in one range request; its gauges
(:func:`gauges`, pure) are what ``join --metrics-port`` serves to Prometheus.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import re
import signal
import socket
import sys
import time
import uuid
from typing import Any, Sequence

from tpassrun.pool.etcd import Pool, PoolError
from tpassrun.pool.plan import PoolView
from tpassrun.records import MEMBER, POOL_KEY_CONF, HistoryEntry, PoolKeys, PoolNode, RunKey, RunKeyError, pool_prefix
from tpassrun.rendezvous import DEFAULT_PREFIX, EtcdConfig, EtcdStore, RendezvousError, read_private_file, refuse_inline_secrets
from tpassrun.settings import envnames as E

LEASE_TTL = 10
_HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def check_local_addr(text: str) -> str:
    """``--local-addr``: a host name or an IP address (pure; ValueError, one line, otherwise)."""
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(text))
    labels = text[:-1].split(".") if text.endswith(".") else text.split(".")
    if len(text) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"--local-addr {text!r}: not a host name or an IP address")
    return text


def pool_key_from(conf: dict[str, str], environ: dict[str, str] | os._Environ[str]) -> RunKey | None:
    path = conf.get(POOL_KEY_CONF)
    if path:
        return RunKey.from_text(read_private_file(path, "pool key file"), f"the pool key file {path}")
    if environ.get(E.TPASSRUN_POOL_KEY):
        return RunKey.from_text(environ[E.TPASSRUN_POOL_KEY], f"${E.TPASSRUN_POOL_KEY}")
    return None


def parse_conf(text: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    for item in (text or "").split(","):
        if item.strip():
            k, sep, v = item.partition("=")
            if not sep:
                raise PoolError(f"--rdzv-conf item {item!r} is not key=value")
            conf[k.strip()] = v.strip()
    return conf


def open_pool(store: EtcdStore, name: str, key: RunKey, conf: dict[str, str]) -> Pool:
    return Pool(store, PoolKeys(pool_prefix(conf.get("etcd_prefix") or DEFAULT_PREFIX, name)), key, name)


# ---------------------------------------------------------------------------------------------- status (pure)
def status_doc(name: str, view: PoolView, history: Sequence[HistoryEntry], now: float) -> dict[str, Any]:
    nodes = []
    for n in sorted(view.nodes.values(), key=lambda n: n.node_id):
        c = view.claims.get(n.node_id)
        nodes.append({"node": n.node_id, "host": n.host, "slots": n.nproc, "state": n.state, "job": n.job,
                      "since": n.since, "claimed_by": c.job if c else None, "priority": c.priority if c else None,
                      "claimed_since": c.since if c else None, "kind": c.kind if c else None,
                      "preempted_by": view.preempts[n.node_id].job if n.node_id in view.preempts else None})
    return {"pool": name, "exists": view.exists, "nodes": nodes, "gauges": gauges(view, history),
            "history": [h.to_json() for h in sorted(history, key=lambda h: h.time)[-50:]], "time": now}


def gauges(view: PoolView, history: Sequence[HistoryEntry]) -> dict[str, float]:
    """Prometheus gauges of a pool (pure): idle nodes, nodes, claims now (and of them, the nodes lent to
    lower-priority jobs as members), claims and pre-emptions ever, the last claim's wait."""
    idle = sum(1 for n in view.nodes.values() if n.state == "idle" and n.node_id not in view.claims)
    last = max(view.claims.values(), key=lambda c: c.since, default=None)
    return {"tpassrun_pool_nodes": float(len(view.nodes)), "tpassrun_pool_idle_nodes": float(idle),
            "tpassrun_pool_claims": float(len(view.claims)),
            "tpassrun_pool_member_nodes": float(sum(1 for c in view.claims.values() if c.kind == MEMBER)),
            "tpassrun_pool_claims_total": float(sum(1 for h in history if h.event == "claimed")),
            "tpassrun_pool_preemptions_total": float(sum(1 for h in history if h.event == "preempted")),
            "tpassrun_pool_claim_wait_seconds": float(last.waited) if last is not None else 0.0}


def prometheus_text(name: str, values: dict[str, float]) -> str:
    return "".join(f"# TYPE {k} gauge\n{k}{{pool=\"{name}\"}} {v:g}\n" for k, v in values.items())


def status_lines(doc: dict[str, Any]) -> list[str]:
    g = doc["gauges"]
    out = [f"pool {doc['pool']}: {int(g['tpassrun_pool_nodes'])} node(s), {int(g['tpassrun_pool_idle_nodes'])} idle, "
           f"{int(g['tpassrun_pool_claims'])} claimed ({int(g['tpassrun_pool_claims_total'])} claims so far)"]
    for n in doc["nodes"]:
        if n["claimed_by"] and n.get("kind") == "member":
            what = (f"running lower-priority job {n['claimed_by']} as a member (priority {n['priority']}) for "
                    f"{doc['time'] - n['claimed_since']:.0f} s")
            if n.get("preempted_by"):
                what += f", being pre-empted by {n['preempted_by']}"
        elif n["claimed_by"]:
            what = (f"claimed by {n['claimed_by']} (priority {n['priority']}) for "
                    f"{doc['time'] - n['claimed_since']:.0f} s")
        elif n["state"] == "serving":
            what = f"serving {n['job']} (its claimer gone: the job holds it)"
        else:
            what = f"idle for {doc['time'] - n['since']:.0f} s"
        out.append(f"  {n['node']}  {n['host']}  {n['slots']} slots  {what}")
    for h in doc["history"][-10:]:
        out.append(f"  {time.strftime('%H:%M:%S', time.localtime(h['time']))}  {h['node_id']}  {h['event']}"
                   f"{'  ' + h['job'] if h.get('job') else ''}{'  ' + h['detail'] if h.get('detail') else ''}")
    return out


# ---------------------------------------------------------------------------------------------- the verbs
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpassctl pool", description="A spare pool shared by many jobs.")
    p.add_argument("verb", choices=("create", "join", "status", "delete"))
    p.add_argument("name")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True, help="etcd host[:port][,...]")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="",
                   help="k=v,... (pool_key_file=PATH, etcd_prefix, cacert, user, password_file, read_timeout)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, help="join: worker slots")
    p.add_argument("--node-id", default=None, help="join: this node's id (default host-pid-random)")
    p.add_argument("--metrics-port", type=int, default=None, help="join: serve the pool's gauges to Prometheus")
    p.add_argument("--local-addr", "--local_addr", default=None,
                   help="join: the address the spare (or member) node this pool node starts advertises to the job "
                        "(torchrun's --local-addr; default its FQDN)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true")
    shape.add_argument("--prometheus", action="store_true")
    return p


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        conf = parse_conf(args.rdzv_conf)
        refuse_inline_secrets(conf)
        if args.local_addr is not None:
            args.local_addr = check_local_addr(args.local_addr)
        key = pool_key_from(conf, os.environ)
        if key is None:
            raise PoolError(f"no pool key: give --rdzv-conf {POOL_KEY_CONF}=PATH (a file only you can read) or "
                            f"${E.TPASSRUN_POOL_KEY}")
        conf.setdefault("read_timeout", "5")
        return asyncio.run(_run(args, conf, key))
    except (PoolError, RunKeyError, RendezvousError, ValueError) as exc:
        print(f"tpassctl pool: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


async def _run(args: argparse.Namespace, conf: dict[str, str], key: RunKey) -> int:
    etcd = EtcdConfig.from_endpoint(args.rdzv_endpoint, conf)
    if args.verb == "join":
        return await _join(args, etcd, conf, key)
    async with EtcdStore(etcd) as store:
        pool = open_pool(store, args.name, key, conf)
        if args.verb == "create":
            if not await pool.create():
                await pool.check()     # says why when it is another key's
                print(f"pool {args.name} exists already")
                return 0
            print(f"pool {args.name} created (key {key.fingerprint})")
            return 0
        await pool.check()
        if args.verb == "delete":
            await pool.delete()
            print(f"pool {args.name} deleted")
            return 0
        view, _revs, history = await pool.read()
        doc = status_doc(args.name, view, history, time.time())
        if args.json:
            print(json.dumps(doc, indent=2, sort_keys=True))
        elif args.prometheus:
            print(prometheus_text(args.name, doc["gauges"]), end="")
        else:
            print("\n".join(status_lines(doc)))
        return 0


async def _join(args: argparse.Namespace, etcd: EtcdConfig, conf: dict[str, str], key: RunKey) -> int:
    from tpassrun.pool.node import PoolNodeLoop

    node_id = args.node_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with EtcdStore(etcd, lease_ttl=LEASE_TTL) as store:
        pool = open_pool(store, args.name, key, conf)
        server = _serve_gauges(pool, args.metrics_port, loop) if args.metrics_port is not None else None
        try:
            node = PoolNode(node_id, socket.gethostname(), args.nproc_per_node, time.time())
            await PoolNodeLoop(pool, node, say=lambda s: print(s, flush=True), local_addr=args.local_addr).run(stop)
        finally:
            if server is not None:
                server.shutdown()
    return 0


def _serve_gauges(pool: Pool, port: int, loop: asyncio.AbstractEventLoop) -> Any:
    """Prometheus text at ``http://0.0.0.0:port/metrics``, read from etcd at scrape time (no per-tick cost)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name
            view, _, history = asyncio.run_coroutine_threadsafe(pool.read(), loop).result(10)
            body = prometheus_text(pool.name, gauges(view, history)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="pool-metrics").start()
    return server
