"""Chaos: one long job under a random schedule of faults, and what it cost.

    .venv/bin/python bench/chaos.py --faults 50 --steps 3000 --seed 1

A job of 4 ranks on 2 agents (2 ranks + 1 warm spare each) against one external etcd, and the same script
uninterrupted as the reference. While the job runs, faults are drawn at random, one at a time, each followed by
a settling wait (until the job recovered from it, or a timeout): a worker SIGKILLed, a taint (a planned swap),
a stranger connecting to the spare during a swap with perturbed weights, a transfer corrupted on the wire, a
forged swap plan naming an arbitrary socket, a malformed etcd value, etcd frozen for a few seconds (SIGSTOP, a
partition of every agent), a taint storm (three taints at once). The table says, per kind: injected, survived
live (recovered with no whole-group restart), fell back (and why), and for the whole run: steps lost or
repeated, whether the final state is ``torch.equal`` to the uninterrupted run's, orphans, leftover files, and
any rank held by two live processes at once (from the per-step logs: two pids' step-time intervals overlap).

Fault kinds not drawn yet (left for later): SIGSTOP hangs of workers, agent SIGKILL, a donor/joiner dying
mid-transfer (tests/test_swap_e2e.py covers them one at a time), disk full for logs.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import random
import secrets
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(BENCH), "tests"))

from conftest import EtcdServer  # noqa: E402
from faults import EXAMPLE, Job, alive, assert_bit_exact, taint  # noqa: E402

KINDS = ("worker_sigkill", "taint", "stranger", "forged_plan", "malformed_value", "etcd_freeze", "taint_storm")


def _agent(out: str, endpoint: str, run_id: str, steps: int, step_sleep: float) -> Job:
    argv = [sys.executable, "-m", "tpassrun", "--nnodes", "2", "--nproc-per-node", "2", "--spares-per-node", "1",
            "--max-restarts", "3",
            "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--rdzv-conf", "lease_ttl=10,last_call_timeout=1", "--log-dir", os.path.join(out, "logs"),
            EXAMPLE, "--steps", str(steps), "--step-sleep", str(step_sleep),
            "--out", os.path.join(os.path.dirname(out), "train"), "--quiet"]
    return Job(argv=argv, out=out)


class Chaos:
    def __init__(self, args: argparse.Namespace, etcd: EtcdServer, work: str) -> None:
        self.args, self.etcd, self.work = args, etcd, work
        self.rng = random.Random(args.seed)
        self.run_id = "chaos-" + uuid.uuid4().hex[:8]
        self.agents = [_agent(os.path.join(work, n), etcd.endpoint, self.run_id, args.steps, args.step_sleep)
                       for n in ("a", "b")]
        self.train = os.path.join(work, "train")
        self.injected: Counter[str] = Counter()
        self.outcome: dict[str, Counter[str]] = defaultdict(Counter)

    # --- what the job says ---
    def events(self) -> list[dict]:
        return sorted((e for a in self.agents for e in a.events()), key=lambda e: e["time"])

    def losses(self, rank: int) -> list[dict]:
        path = os.path.join(self.train, f"loss_rank{rank}.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as fh:
            return [json.loads(x) for x in fh if x.strip()]

    def running(self) -> bool:
        return all(a.proc is not None and a.proc.poll() is None for a in self.agents)

    def count(self, *names: str) -> int:
        return sum(1 for e in self.events() if e["event"] in names)

    # --- faults ---
    async def put(self, key: str, value: bytes) -> None:
        from tpassrun.rendezvous import EtcdConfig, EtcdStore

        async with EtcdStore(EtcdConfig.from_endpoint(self.etcd.endpoint, {"read_timeout": "5"})) as store:
            client, _ = await store.connection.acquire()
            await client.put(key.encode(), value)

    def inject(self, kind: str) -> None:
        prefix = f"/tpassrun/v1/{self.run_id}/"
        rank = self.rng.randrange(4)
        if kind == "worker_sigkill":
            rows = self.losses(rank)
            if rows and alive(rows[-1]["pid"]):
                os.kill(rows[-1]["pid"], signal.SIGKILL)
        elif kind == "taint":
            taint(self.etcd.endpoint, self.run_id, rank=rank, reason="chaos")
        elif kind == "taint_storm":
            for r in self.rng.sample(range(4), 3):
                taint(self.etcd.endpoint, self.run_id, rank=r, reason="chaos storm")
        elif kind == "stranger":
            before = self.count("swap_phase")
            taint(self.etcd.endpoint, self.run_id, rank=rank, reason="chaos stranger")
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and self.running():
                sends = [e for e in self.events() if e["event"] == "swap_phase" and "listening at" in e.get("reason", "")]
                if len(sends) and self.count("swap_phase") > before:
                    host, port = sends[-1]["reason"].rsplit(" ", 1)[-1].rsplit(":", 1)
                    import torch

                    from tpassrun.handoff import HandoffError, StateBundle, send_bundle
                    try:
                        with socket.create_connection((host, int(port)), timeout=5) as s:
                            send_bundle(s, StateBundle({"step": 0}, [torch.full((64,), 7.0)]))
                        self.outcome[kind]["stranger ACCEPTED"] += 1
                    except (OSError, HandoffError):
                        pass
                    break
                time.sleep(0.02)
        elif kind == "forged_plan":
            with socket.socket() as trap:
                trap.bind(("127.0.0.1", 0))
                trap.listen(1)
                trap.settimeout(5)
                plan = {"v": 1, "id": "s-forged-" + uuid.uuid4().hex[:6], "secret": secrets.token_hex(32),
                        "kind": "planned", "generation": 0, "leaver": {"node": "x", "slot": 0, "rank": rank},
                        "joiner": {"node": "x", "slot": 2, "rank": rank}, "donor": None, "phase": "send",
                        "reason": "forged", "nodes": [], "boundary": 0,
                        "joiner_addr": ["127.0.0.1", trap.getsockname()[1]], "attempt": 0,
                        "history": [["pause", time.time()], ["send", time.time()]]}
                asyncio.run(self.put(prefix + "swaps/" + plan["id"], json.dumps(plan).encode()))
                try:
                    conn, _ = trap.accept()
                    conn.close()
                    self.outcome[kind]["forged plan CONNECTED"] += 1
                except TimeoutError:
                    pass
        elif kind == "malformed_value":
            asyncio.run(self.put(prefix + "swaps/x" + uuid.uuid4().hex[:4], b"\x00not json"))
        elif kind == "etcd_freeze":
            assert self.etcd.proc is not None
            self.etcd.proc.send_signal(signal.SIGSTOP)
            time.sleep(self.rng.uniform(1.0, 4.0))
            self.etcd.proc.send_signal(signal.SIGCONT)
        self.injected[kind] += 1

    def settle(self, before_restarts: int, before_done: int, kind: str) -> None:
        deadline = time.monotonic() + self.args.settle
        while time.monotonic() < deadline and self.running():
            if self.count("swap_resumed", "swap_aborted_here") > before_done and \
                    kind in ("taint", "stranger", "worker_sigkill", "taint_storm"):
                break
            time.sleep(0.2)
        restarts = self.count("restart", "fallback")
        if restarts > before_restarts:
            why = [e.get("reason", "") for e in self.events() if e["event"] in ("restart", "fallback")][-1]
            self.outcome[kind][f"fell back: {why[:60]}"] += 1
        elif not self.running():
            self.outcome[kind]["job ended"] += 1
        else:
            self.outcome[kind]["survived live"] += 1

    def run(self) -> dict:
        for a in self.agents:
            a.start()
        deadline = time.monotonic() + 600
        while len(self.losses(0)) < 3:
            if time.monotonic() > deadline or not self.running():
                raise SystemExit("the chaos job did not start:\n" + self.agents[0].log()[-2000:])
            time.sleep(0.2)
        while self.running() and sum(self.injected.values()) < self.args.faults:
            time.sleep(self.rng.uniform(0.5, 2.0))
            kind = self.rng.choice(self.args.kinds)
            before = (self.count("restart", "fallback"), self.count("swap_resumed", "swap_aborted_here"))
            print(f"[{time.strftime('%H:%M:%S')}] fault #{sum(self.injected.values()) + 1}: {kind}", flush=True)
            self.inject(kind)
            self.settle(*before, kind)
        codes = [a.wait(self.args.timeout) for a in self.agents]
        return {"codes": codes}


def _leftovers(agent_pids: set[int]) -> list[str]:
    """What these (finished) agents left on the machine: channel files, socket dirs, etcd data dirs."""
    found = [p for pid in agent_pids for p in glob.glob(f"/dev/shm/tpassrun-{pid}-*.chan")]
    for pattern in ("/tmp/tpr-*", os.path.join(tempfile.gettempdir(), "tpassrun-etcd-*")):
        for path in glob.glob(pattern):
            try:
                with open(os.path.join(path, "owner.pid")) as fh:
                    if int(fh.read().strip() or 0) in agent_pids:
                        found.append(path)
            except (OSError, ValueError):
                pass
    return sorted(found)


def _double_held(rows_by_rank: dict[int, list[dict]]) -> int:
    """Ranks whose step logs show two pids running at overlapping times."""
    bad = 0
    for rows in rows_by_rank.values():
        spans: dict[int, list[float]] = {}
        for x in rows:
            lo_hi = spans.setdefault(x["pid"], [x["t"], x["t"]])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], x["t"]), max(lo_hi[1], x["t"])
        ordered = sorted(spans.values())
        bad += any(b[0] < a[1] for a, b in zip(ordered, ordered[1:]))
    return bad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=50)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--settle", type=float, default=90.0, help="seconds to wait for recovery after each fault")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {', '.join(KINDS)}")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    work = tempfile.mkdtemp(prefix="tpassrun-chaos-")
    etcd = EtcdServer().start()
    try:
        base = Job.tpassrun(os.path.join(work, "base"), endpoint=None, run_id="", nproc=4, steps=args.steps,
                            step_sleep=args.step_sleep).start()
        chaos = Chaos(args, etcd, work)
        result = chaos.run()
        base_code = base.wait(args.timeout)
        pids = {x["pid"] for r in range(4) for x in chaos.losses(r)}
        orphans = sorted(pid for pid in pids if alive(pid))
        leftovers = _leftovers({a.proc.pid for a in chaos.agents if a.proc is not None} | {base.proc.pid})
        rows = {r: chaos.losses(r) for r in range(4)}
        lost = sum(len(set(range(args.steps)) - {x["step"] for x in rows[r]}) for r in range(4))
        repeated = sum(len(rows[r]) - len({x["step"] for x in rows[r]}) for r in range(4))
        train = Job(argv=[], out=chaos.train)
        try:
            assert_bit_exact(train, base, 4)
            exact = "yes"
        except (AssertionError, OSError, KeyError) as exc:
            exact = f"NO ({str(exc)[:80]})"
        print()
        print(f"{'fault':<16} {'injected':>8}  outcome")
        for kind in args.kinds:
            outcomes = ", ".join(f"{n}x {o}" for o, n in chaos.outcome[kind].most_common()) or "-"
            print(f"{kind:<16} {chaos.injected[kind]:>8}  {outcomes}")
        print()
        print(f"exit codes: chaos agents {result['codes']}, uninterrupted {base_code}")
        print(f"steps lost: {lost}, steps repeated in the logs: {repeated}")
        print(f"bit-identical to the uninterrupted run: {exact}")
        print(f"orphans: {len(orphans)} {orphans[:5]}, leftover files: {len(leftovers)} {leftovers[:3]}")
        print(f"ranks held by two live processes at once: {_double_held(rows)}")
        print(f"work dir: {work}" + ("" if args.keep else " (removed)"))
    finally:
        for job in locals().get("chaos").agents if "chaos" in locals() else []:
            job.kill()
        if "base" in locals():
            base.kill()
        etcd.cleanup()
        if not args.keep:
            import shutil
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
