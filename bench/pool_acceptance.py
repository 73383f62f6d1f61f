"""Issue 24's acceptance on separate hosts: two jobs sharing one pool node, real agents, network namespaces.

    .venv/bin/python bench/pool_acceptance.py share [--trials 1] [--steps 600] [--step-sleep 0.5]
    .venv/bin/python bench/pool_acceptance.py heal
    .venv/bin/python bench/pool_acceptance.py race [--trials 20]

Root only (iproute2). Every agent is a host of its own: a network namespace on a bridge (``tests/faults.NetLab``), the
one etcd on the bridge's address; each host's link has the same name (``tpeth0``), as a cluster's NICs do, so the
``GLOO_SOCKET_IFNAME`` a job ships to the pool node is right there too. The pool node is given its own address
(``tpassctl pool join --local-addr``: the spare node it starts advertises it; on real hosts ``getfqdn()`` may do).

``share``: job A (hosts a1, a2) and job B (b1, b2), each 2 nodes x 2 ranks, no spares of their own,
``--spare-pool P --migrate-back``, and one pool node (host p). A's node a2 dies at a random instant (its agent's
whole process group and its workers, SIGKILL): the pool node joins A, A recovers live. Then B's node b2 dies: B finds
the pool empty, says so, waits (``--pool-wait``). a2's agent is started again on its host with the same command line:
it rejoins A as a spare node, ``--migrate-back`` moves the pool node's ranks home, the pool node is given back and B
claims it and recovers live. Both jobs end ``torch.equal`` to plain torchrun, survivors keep their processes. The
timeline and the consoles' one-liners are printed; the last line is JSON.

``heal``: a pool node SIGKILLed while idle (its record leaves with its lease) and while it runs a job's ranks (the job
waits; the node started again serves it), a claimer killed mid-claim (the claim expires with its lease): nothing
hangs, nothing is double-held (``tpassctl pool status --json``, the history, the pool sampled twice a second).

``race``: ``bench/pool_race.py`` with real agents: A and B lose a node at the same instant, one idle pool node;
exactly one claim wins (the count over ``--trials``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from typing import Any

from faults import Job, NetLab, assert_bit_exact
from pool_lab import (
    RANKS,
    Lab,
    Sampler,
    idle_and_free,
    kill_host,
    reference,
    restart_host,
    restart_pool_node,
    said,
    start_job,
    summarize_status,
    until,
)


def share_trial(args: argparse.Namespace, ref: Job, rng: random.Random) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="tpassrun-poolacc-")
    lab = Lab(["a1", "a2", "b1", "b2", "p"], work, args.tag)
    t: dict[str, float] = {}
    row: dict[str, Any] = {}
    try:
        assert lab.pool("create")
        pool_node = lab.join_pool("p", "poolnode1")
        a = start_job(lab, "A", ("a1", "a2"), args, args.pool_wait_a)
        b = start_job(lab, "B", ("b1", "b2"), args, args.pool_wait_b)
        everyone = [*a.agents(lab), *b.agents(lab), pool_node]
        until(lambda: a.min_step() >= 3 and b.min_step() >= 3, 300, "both jobs past step 3", *everyone)
        pids0 = {"A": {r: p[-1] for r, p in a.pids().items()}, "B": {r: p[-1] for r, p in b.pids().items()}}
        time.sleep(rng.uniform(0.0, 5.0))      # a random instant of A's training
        a2_workers = lab.hosts["a2"].job.worker_pids()
        t["A kill"] = kill_host(lab.hosts["a2"].job)
        row["A_step_at_kill"] = a.min_step()
        claimed_a = until(lambda: a.first(lab, "pool_claimed", t["A kill"]), 300, "A claimed the pool node",
                          lab.hosts["a1"].job, pool_node)
        t["A pool claimed"] = claimed_a["time"]
        back_a = until(lambda: a.first(lab, "node_recovered", t["A kill"]), 300, "A recovered live",
                       lab.hosts["a1"].job, pool_node)
        t["A training again"] = back_a["time"]
        b2_workers = lab.hosts["b2"].job.worker_pids()
        t["B kill"] = kill_host(lab.hosts["b2"].job)
        waiting = until(lambda: b.first(lab, "pool_waiting", t["B kill"]), 300, "B waiting for the pool",
                        lab.hosts["b1"].job)
        t["B waiting"] = waiting["time"]
        row["B_waiting_said"] = waiting.get("reason")
        restart_host(lab, "a2")
        t["A node back"] = time.time()
        released = until(lambda: a.first(lab, "pool_released", t["A node back"]), args.timeout,
                         "A gave the pool node back", lab.hosts["a1"].job, lab.hosts["a2"].job)
        t["A migrated back, released"] = released["time"]
        row["A_released_reason"] = released.get("reason")
        moved = [e for e in a.events(lab) if e["event"] == "swap_resumed" and e["time"] >= t["A node back"]]
        if moved:
            t["A first rank home"] = moved[0]["time"]
        claimed_b = until(lambda: b.first(lab, "pool_claimed", t["B kill"]), args.timeout, "B claimed the pool node",
                          lab.hosts["b1"].job, pool_node)
        t["B pool claimed"] = claimed_b["time"]
        back_b = until(lambda: b.first(lab, "node_recovered", t["B kill"]), args.timeout, "B recovered live",
                       lab.hosts["b1"].job, pool_node)
        t["B training again"] = back_b["time"]
        codes = {"A": [j.wait(args.timeout) for j in (lab.hosts["a1"].job, lab.hosts["a2"].job)],
                 "B": [lab.hosts["b1"].job.wait(args.timeout)]}
        row["exit_codes"] = codes
        until(lambda: (lambda s: s)(idle_and_free(lab)), 120, "the pool node idle again, no claim")
        row["history"] = [h.event for h in lab.pool("read")[2]]
        row["status_json"] = summarize_status(lab.status())
        for name, job, dead in (("A", a, a2_workers), ("B", b, b2_workers)):
            try:
                assert_bit_exact(Job(argv=[], out=job.train), ref, RANKS, relogged_by=dead)
                row[f"{name}_bit_identical"] = True
            except AssertionError as exc:
                row[f"{name}_bit_identical"] = f"no: {exc}"
            now = job.pids()
            row[f"{name}_survivors_kept_pids"] = all(now[r] == [pid] for r, pid in pids0[name].items()
                                                     if pid not in dead)
            row[f"{name}_pids_per_rank"] = {r: len(p) for r, p in now.items()}
        k = t["A kill"]
        row["timeline_s"] = {what: round(when - k, 2) for what, when in sorted(t.items(), key=lambda kv: kv[1])}
        row["said"] = {"A": said(lab.hosts["a1"].job) + said(lab.hosts["a2"].job),
                       "B": said(lab.hosts["b1"].job), "pool": said(pool_node)}
        row["ok"] = (codes == {"A": [0, 0], "B": [0]} and row["A_bit_identical"] is True and
                     row["B_bit_identical"] is True and row["A_survivors_kept_pids"] and row["B_survivors_kept_pids"]
                     and row["history"].count("claimed") == 2 and row["history"].count("released") >= 1)
        return row
    except AssertionError as exc:
        row.update(ok=False, error=str(exc)[-4000:], timeline_s={w: round(v - t.get("A kill", v), 2)
                                                                  for w, v in t.items()})
        for h in lab.hosts.values():
            row.setdefault("tails", {})[h.name] = h.job.log()[-2500:]
        return row
    finally:
        lab.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            row["work"] = work


def share(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    refdir = tempfile.mkdtemp(prefix="tpassrun-poolacc-ref-")
    rows = []
    try:
        ref = reference(args, refdir)
        for i in range(args.trials):
            load = os.getloadavg()
            row = share_trial(args, ref, rng)
            row["load_before"] = [round(x, 1) for x in load]
            row["load_after"] = [round(x, 1) for x in os.getloadavg()]
            rows.append(row)
            print(f"--- trial {i + 1}: {'ok' if row['ok'] else 'FAILED'} (load {row['load_before'][0]} -> "
                  f"{row['load_after'][0]})", flush=True)
            for what, s in row.get("timeline_s", {}).items():
                print(f"  {s:8.2f} s  {what}")
            for who, lines in row.get("said", {}).items():
                for ln in lines:
                    print(f"  [{who}] {ln}")
            for k in ("B_waiting_said", "A_released_reason", "history", "status_json", "exit_codes",
                      "A_bit_identical", "B_bit_identical", "A_survivors_kept_pids", "B_survivors_kept_pids",
                      "error"):
                if k in row:
                    print(f"  {k}: {row[k]}")
            for h, tail in row.get("tails", {}).items():
                print(f"  --- {h} tail ---\n{tail}")
            sys.stdout.flush()
    finally:
        shutil.rmtree(refdir, ignore_errors=True)
    return rows


def heal(args: argparse.Namespace) -> dict[str, Any]:
    """(1) the idle pool node SIGKILLed, then started again; (2) job C's leader SIGKILLed right after it claimed the
    pool node for C's lost node (mid-claim); (3) job D's claimed pool node SIGKILLed once D's ranks run on it, then
    started again: D claims it again and recovers live. One pool node on host p, every kill a whole host."""
    work = tempfile.mkdtemp(prefix="tpassrun-poolheal-")
    refdir = os.path.join(work, "ref")
    lab = Lab(["c1", "c2", "d1", "d2", "p"], work, args.tag)
    out: dict[str, Any] = {}
    sampler: Sampler | None = None
    try:
        ref = reference(args, refdir)
        assert lab.pool("create")
        lab.join_pool("p", "poolnode1")
        sampler = Sampler(lab, {"poolnode1": lab.hosts["p"].job})
        gone = lambda: "poolnode1" not in lab.pool("read")[0].nodes  # noqa: E731
        free = lambda: idle_and_free(lab) and "poolnode1" in lab.pool("read")[0].nodes  # noqa: E731

        # (1) idle, killed: its record leaves with its lease; started again, it is idle in the pool again
        t0 = kill_host(lab.hosts["p"].job)
        until(gone, 120, "the killed idle pool node left the pool")
        out["idle_killed_left_pool_s"] = round(time.time() - t0, 2)
        restart_pool_node(lab, "p", "poolnode1")
        until(free, 60, "the pool node idle again")

        # (2) a claimer dying mid-claim: C's node c2 dies, C's leader (c1) claims the pool node and dies at once
        c = start_job(lab, "C", ("c1", "c2"), args, 120)
        until(lambda: c.min_step() >= 3, 300, "C past step 3", *c.agents(lab))
        kill_host(lab.hosts["c2"].job)
        claimed = until(lambda: c.first(lab, "pool_claimed", 0), 300, "C claimed the pool node", lab.hosts["c1"].job)
        t1 = kill_host(lab.hosts["c1"].job)
        out["claimer_killed_after_claim_s"] = round(t1 - claimed["time"], 2)
        joined_first = "joined" in [h.event for h in lab.pool("read")[2] if h.job and h.job.startswith("C-")]
        until(free, 180, "the dead claimer's claim expired and the pool node is idle again")
        out["claim_expired_pool_node_idle_s"] = round(time.time() - t1, 2)
        out["claimer_died_after_its_spare_node_joined"] = joined_first

        # (3) claimed and serving, killed: D's ranks on it are a lost node again; D waits, the node comes back, D
        # claims it again and recovers live
        d = start_job(lab, "D", ("d1", "d2"), args, args.pool_wait_b)
        until(lambda: d.min_step() >= 3, 300, "D past step 3", *d.agents(lab))
        pids0 = {r: p[-1] for r, p in d.pids().items()}
        d2_workers = lab.hosts["d2"].job.worker_pids()
        t2 = kill_host(lab.hosts["d2"].job)
        until(lambda: d.first(lab, "node_recovered", t2), 300, "D recovered on the pool node", lab.hosts["d1"].job)
        on_pool = [r for r, p in d.pids().items() if p[-1] not in (pids0[r],)]
        pool_workers = [p[-1] for r, p in d.pids().items() if r in on_pool]
        t3 = kill_host(lab.hosts["p"].job)
        waiting = until(lambda: d.first(lab, "pool_waiting", t3), 300, "D waiting for the pool", lab.hosts["d1"].job)
        out["claimed_killed_D_waiting_s"] = round(waiting["time"] - t3, 2)
        out["claimed_killed_D_said"] = waiting.get("reason")
        until(gone, 120, "the killed claimed pool node left the pool")
        out["claimed_killed_left_pool_s"] = round(time.time() - t3, 2)
        t4 = time.time()
        restart_pool_node(lab, "p", "poolnode1")
        again = until(lambda: d.first(lab, "node_recovered", t4), args.timeout, "D recovered on the pool node again",
                      lab.hosts["d1"].job)
        out["node_back_to_D_training_s"] = round(again["time"] - t4, 2)
        out["D_exit"] = lab.hosts["d1"].job.wait(args.timeout)
        until(free, 120, "the pool node idle again after D")
        try:
            assert_bit_exact(Job(argv=[], out=d.train), ref, RANKS, relogged_by=[*d2_workers, *pool_workers])
            out["D_bit_identical"] = True
        except AssertionError as exc:
            out["D_bit_identical"] = f"no: {exc}"
        now = d.pids()
        out["D_survivors_kept_pids"] = all(now[r] == [pid] for r, pid in pids0.items() if pid not in d2_workers)
        out["history"] = [(h.event, (h.job or "")[:1]) for h in sorted(lab.pool("read")[2], key=lambda h: h.time)]
        out["status_json"] = summarize_status(lab.status())
        out["double_held"] = sampler.bad
        out["samples"] = sampler.samples
        out["ok"] = (out["D_exit"] == 0 and out["D_bit_identical"] is True and out["D_survivors_kept_pids"]
                     and not sampler.bad)
        return out
    except AssertionError as exc:
        out.update(ok=False, error=str(exc)[-4000:])
        out["tails"] = {h.name: h.job.log()[-2500:] for h in lab.hosts.values() if h.jobs}
        return out
    finally:
        if sampler is not None:
            sampler.close()
        lab.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            out["work"] = work


def race_trial(lab: Lab, i: int, args: argparse.Namespace) -> dict[str, Any]:
    """One trial of :func:`race` on a started lab whose pool node is idle; returns its row."""
    jobs = {n: start_job(lab, f"{n}{i}", (f"{n.lower()}1", f"{n.lower()}2"), args, 300) for n in "AB"}
    agents = [lab.hosts[h].job for h in ("a1", "a2", "b1", "b2")]
    until(lambda: all(j.min_step() >= 3 for j in jobs.values()), 300, "both jobs past step 3", *agents)
    order = ["a2", "b2"] if i % 2 == 0 else ["b2", "a2"]
    t0 = min(kill_host(lab.hosts[h].job) for h in order)
    said_ = {n: until(lambda j=j: j.first(lab, "pool_claimed", t0) or j.first(lab, "pool_waiting", t0), 180,
                      f"job {n} asked the pool") for n, j in jobs.items()}
    claims = sorted(c.job.split("-")[0] for c in lab.pool("read")[0].claims.values())
    winners = sorted(n for n, e in said_.items() if e["event"] == "pool_claimed")
    losers = {n: e.get("reason", "") for n, e in said_.items() if e["event"] == "pool_waiting"}
    return {"trial": i + 1, "first_killed": order[0], "claims": claims, "winners": winners, "losers": losers,
            "one_winner": len(winners) == 1 and claims == [f"{winners[0]}{i}"] and
            all("claimed" in r for r in losers.values())}


def race(args: argparse.Namespace) -> dict[str, Any]:
    """Jobs A and B (fresh each trial) each lose a node at the same instant (b2 SIGKILLed right after a2, or the other
    way round), one idle pool node: exactly one claim wins, the other job is told the pool is claimed and waits; then
    every agent and the pool node are killed (the claim expires with the winner's lease) and the pool node is started
    again. A trial that does not get there (a deadline that only catches a hang) counts as failed, with the hosts'
    consoles printed, and the next one starts."""
    work = tempfile.mkdtemp(prefix="tpassrun-poolrace-")
    lab = Lab(["a1", "a2", "b1", "b2", "p"], work, args.tag)
    rows: list[dict[str, Any]] = []
    sampler: Sampler | None = None
    try:
        assert lab.pool("create")
        lab.join_pool("p", "poolnode1")
        sampler = Sampler(lab, {})
        for i in range(args.trials):
            if i:
                restart_pool_node(lab, "p", "poolnode1")
            until(lambda: idle_and_free(lab) and "poolnode1" in lab.pool("read")[0].nodes, 120, "pool node idle")
            sampler.pool_jobs = {"poolnode1": lab.hosts["p"].job}
            try:
                row = race_trial(lab, i, args)
                print(f"trial {i + 1}: {row['first_killed']} killed first; claim won by {row['winners']}; the other "
                      f"told: {list(row['losers'].values())}", flush=True)
            except AssertionError as exc:
                row = {"trial": i + 1, "one_winner": False, "winners": [], "error": str(exc)[:300]}
                print(f"trial {i + 1}: FAILED: {str(exc)[:2000]}", flush=True)
                for h in lab.hosts.values():
                    print(f"--- {h.name} ---\n{h.job.log()[-1500:]}", flush=True)
            rows.append(row)
            for h in lab.hosts.values():
                if h.job.proc is not None and h.job.proc.poll() is None:
                    kill_host(h.job)
            until(lambda: "poolnode1" not in lab.pool("read")[0].nodes and not lab.pool("read")[0].claims, 120,
                  "the pool node and the claim gone with their leases")
        good = sum(r["one_winner"] for r in rows)
        out = {"trials": len(rows), "one_winner": good, "double_held": sampler.bad,
               "wins": {n: sum(r["winners"] == [n] for r in rows) for n in "AB"}, "rows": rows}
        print(f"{len(rows)} trials, two jobs losing a node at the same instant, one pool node, real agents on netns "
              f"hosts: exactly one claim won in {good}/{len(rows)} (A {out['wins']['A']}, B {out['wins']['B']}); "
              f"two jobs on one pool node: {len(sampler.bad)} sample(s)")
        return out
    finally:
        if sampler is not None:
            sampler.close()
        lab.close()
        shutil.rmtree(work, ignore_errors=True)

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)

    def scenario(name: str, *, steps: int, step_sleep: float, pool_wait: float = 0.0) -> argparse.ArgumentParser:
        q = sub.add_parser(name)
        q.add_argument("--steps", type=int, default=steps)
        q.add_argument("--step-sleep", type=float, default=step_sleep)
        q.add_argument("--lease-ttl", type=int, default=5)
        q.add_argument("--pool-wait-b", type=float, default=pool_wait, help="the waiting job's finite --pool-wait")
        q.add_argument("--timeout", type=float, default=600, help="a deadline that only catches a hang")
        q.add_argument("--keep", action="store_true", help="keep the work directory")
        q.add_argument("--tag", default=None, help="the namespaces' name tag (tp<tag>-h<i>; default random)")
        return q

    # 600 steps: A must still train when p is given back (67 s after a2's restart at load 18)
    s = scenario("share", steps=600, step_sleep=0.5, pool_wait=400)
    s.add_argument("--trials", type=int, default=1)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--pool-wait-a", type=float, default=120)
    scenario("heal", steps=300, step_sleep=0.3, pool_wait=400)
    scenario("race", steps=100000, step_sleep=0.2).add_argument("--trials", type=int, default=20)
    args = p.parse_args()
    if not NetLab.available():
        raise SystemExit("needs root and iproute2 (network namespaces)")
    if args.what == "race":
        res = race(args)
        print(json.dumps(res, default=str))
        if res["one_winner"] != res["trials"] or res["double_held"]:
            raise SystemExit(1)
        return
    if args.what == "heal":
        res = heal(args)
        for k, v in res.items():
            if k != "tails":
                print(f"  {k}: {v}")
        for host, tail in res.get("tails", {}).items():
            print(f"  --- {host} tail ---\n{tail}")
        print(json.dumps({k: v for k, v in res.items() if k != "tails"}, default=str))
        if not res["ok"]:
            raise SystemExit(1)
        return
    rows = share(args)
    print(json.dumps({"trials": [{k: v for k, v in r.items() if k not in ("said", "tails")} for r in rows]},
                     default=str))
    if not all(r["ok"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()

