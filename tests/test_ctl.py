"""tpassctl against a real etcd: a formed run plus hand-written status keys."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import pytest

from tpassrun.ops.ctl import main
from tpassrun.rendezvous import EtcdConfig, EtcdRendezvous, EtcdStore, NodeInfo, RendezvousSettings


def _status(node_id: str, first_rank: int, spare_rank_slot: bool = True) -> dict:
    workers = [{"slot": i, "rank": first_rank + i, "local_rank": i, "pid": 1000 + first_rank + i,
                "state": "running", "step": 17, "spare": False} for i in range(2)]
    if spare_rank_slot:
        workers.append({"slot": 2, "rank": None, "local_rank": None, "pid": 2000 + first_rank, "state": "spare",
                        "step": 0, "spare": True})
    return {"v": 1, "node_id": node_id, "workers": workers}


@pytest.fixture
def formed_run(etcd_server, run_id):
    """A 2-node run (a: ranks 0-1, b: ranks 2-3) left in etcd, with status and health keys."""
    async def form():
        cfg = EtcdConfig.from_endpoint(etcd_server.endpoint, {"read_timeout": "5"})
        s = RendezvousSettings(run_id=run_id, min_nodes=2, max_nodes=2, lease_ttl=30)
        async with contextlib.AsyncExitStack() as stack:
            rs = [await stack.enter_async_context(EtcdRendezvous(cfg, s, NodeInfo(n, "127.0.0.1", 2)))
                  for n in ("a", "b")]
            gen = (await asyncio.gather(*(r.join() for r in rs)))[0]
            # The agents' own keys are lease-bound; tpassctl reads plain copies left behind here.
            async with EtcdStore(cfg) as store:
                for m in gen.members:
                    await store.put_json(rs[0].key("status", m.node_id), _status(m.node_id, m.rank_offset))
                await store.put_json(rs[0].key("health", "a"), {"v": 1, "verdicts": [
                    {"v": 1, "device": "gpu0", "status": "healthy", "effect": "none", "reason": "ok"}]})
            return {m.node_id: m.rank_offset for m in gen.members}
    offsets = asyncio.run(form())
    return etcd_server.endpoint, run_id, offsets


def ctl(endpoint: str, run_id: str, *args: str) -> int:
    return main([args[0], "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, *args[1:]])


def taints(endpoint: str, run_id: str, capsys) -> dict:
    capsys.readouterr()
    assert ctl(endpoint, run_id, "status", "--json") == 0
    return json.loads(capsys.readouterr().out)["taints"]


@pytest.mark.timeout(60)
def test_status_json_and_table(formed_run, capsys):
    endpoint, run_id, offsets = formed_run
    assert ctl(endpoint, run_id, "status", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["v"] == 1 and doc["run_id"] == run_id
    assert doc["generation"]["state"] == "active"
    assert sorted(m["node_id"] for m in doc["generation"]["members"]) == ["a", "b"]
    assert doc["status"]["a"]["workers"][0]["step"] == 17
    assert doc["health"]["a"]["verdicts"][0]["device"] == "gpu0"
    assert ctl(endpoint, run_id, "status") == 0
    out = capsys.readouterr().out
    for text in ("generation 0", "workers", "running", "gpu0", "member"):
        assert text in out


@pytest.mark.timeout(60)
def test_taint_by_rank_and_node_then_untaint(formed_run, capsys):
    endpoint, run_id, offsets = formed_run
    rank = offsets["b"] + 1
    assert ctl(endpoint, run_id, "taint", "--rank", str(rank), "--reason", "ecc errors", "--no-wait") == 0
    assert ctl(endpoint, run_id, "taint", "--node", "a", "--local-rank", "0", "--reason", "slow",
               "--effect", "exclude") == 0
    found = taints(endpoint, run_id, capsys)
    by_node = {t["node_id"]: t for t in found.values()}
    assert by_node["b"]["rank"] == rank and by_node["b"]["local_rank"] == 1
    assert by_node["b"]["effect"] == "migrate" and by_node["b"]["source"] == "tpassctl"
    assert by_node["b"]["reason"] == "ecc errors" and by_node["b"]["v"] == 1 and by_node["b"]["time"] > 0
    assert by_node["a"]["local_rank"] == 0 and by_node["a"]["rank"] == offsets["a"]
    assert by_node["a"]["effect"] == "exclude"
    assert all(t["id"] == tid for tid, t in found.items())

    assert ctl(endpoint, run_id, "untaint", "--rank", str(rank)) == 0
    assert set(t["node_id"] for t in taints(endpoint, run_id, capsys).values()) == {"a"}
    tid = next(iter(taints(endpoint, run_id, capsys)))
    assert ctl(endpoint, run_id, "untaint", "--id", tid) == 0
    assert taints(endpoint, run_id, capsys) == {}
    assert ctl(endpoint, run_id, "untaint", "--node", "a") == 1
    assert "no matching taints" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_drain_taints_every_active_rank(formed_run, capsys):
    endpoint, run_id, offsets = formed_run
    assert ctl(endpoint, run_id, "drain", "--node", "a", "--reason", "maintenance") == 0
    found = taints(endpoint, run_id, capsys)
    assert sorted(t["rank"] for t in found.values()) == [offsets["a"], offsets["a"] + 1]
    assert {t["node_id"] for t in found.values()} == {"a"}
    assert ctl(endpoint, run_id, "untaint", "--node", "a") == 0
    assert taints(endpoint, run_id, capsys) == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,message", [
    (("taint", "--rank", "99", "--reason", "x"), "no rank 99"),
    (("taint", "--node", "zz", "--reason", "x"), "no node 'zz'"),
    (("taint", "--node", "a", "--local-rank", "5", "--reason", "x"), "no local rank 5"),
    (("drain", "--node", "zz", "--reason", "x"), "no node 'zz'"),
])
def test_unknown_targets_are_one_line_errors(formed_run, capsys, args, message):
    endpoint, run_id, _ = formed_run
    assert ctl(endpoint, run_id, *args) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.timeout(30)
def test_unknown_run_and_unreachable_etcd(etcd_server, capsys):
    assert ctl(etcd_server.endpoint, "no-such-run", "status") == 1
    err = capsys.readouterr().err
    assert "no run 'no-such-run'" in err and err.count("\n") == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "x",
                 "--rdzv-conf", "read_timeout=1"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach etcd at 127.0.0.1:{port}" in err and err.count("\n") == 1


@pytest.mark.timeout(60)
def test_status_with_the_run_key_shows_the_jobs_plans_only(formed_run, capsys, tmp_path, monkeypatch):
    """Given the job's run key (here its file, as --rdzv-conf run_key_file= or the registry names it), tpassctl
    checks plans as the agents do: a plan without a MAC of that key is not shown as the job's."""
    from tpassrun.plan.swap import Phase
    from tpassrun.records import SlotRef, SwapKind, SwapPlan
    from tpassrun.records.provenance import RUN_KEY_ENV, RunKey, seal

    endpoint, run_id, _ = formed_run
    monkeypatch.delenv(RUN_KEY_ENV, raising=False)
    key_file = tmp_path / "run.key"
    key_file.write_text("0123456789abcdef0123456789abcdef\n")
    key_file.chmod(0o600)
    prefix = f"/tpassrun/v1/{run_id}/swaps/"

    def plan(swap_id: str) -> dict:
        return SwapPlan(id=swap_id, kind=SwapKind.PLANNED, generation=0, leaver=SlotRef("a", 1, 1),
                        joiner=SlotRef("a", 2, 1), donor=None, phase=Phase.PAUSE, reason="r", nodes=("a", "b"),
                        secret="ab" * 32).to_json()

    async def write() -> None:
        async with EtcdStore(EtcdConfig.from_endpoint(endpoint, {"read_timeout": "5"})) as store:
            genuine = prefix + "s-genuine"
            await store.put_json(genuine, seal(genuine, plan("s-genuine"), RunKey.from_text(key_file.read_text())))
            await store.put_json(prefix + "s-forged", plan("s-forged"))
    asyncio.run(write())
    capsys.readouterr()
    assert ctl(endpoint, run_id, "status", "--json", "--rdzv-conf", f"run_key_file={key_file}") == 0
    swaps = json.loads(capsys.readouterr().out)["swaps"]
    assert sorted(swaps) == ["s-genuine"]
    assert ctl(endpoint, run_id, "status", "--json") == 0        # without the key: nothing to check them with
    assert sorted(json.loads(capsys.readouterr().out)["swaps"]) == ["s-forged", "s-genuine"]


@pytest.mark.timeout(60)
def test_status_checks_the_rendezvous_records_with_the_run_key_or_says_it_did_not(etcd_server, run_id, capsys, tmp_path,
                                                                                  monkeypatch):
    """The job seals its generation, registrations and leader record: with its key tpassctl shows only what the job
    wrote; without it, it shows what it reads and says that nothing was verified."""
    from tpassrun.records import rendezvous_guard
    from tpassrun.records.provenance import RUN_KEY_ENV, RunKey

    monkeypatch.delenv(RUN_KEY_ENV, raising=False)
    key_file = tmp_path / "run.key"
    key_file.write_text("0123456789abcdef0123456789abcdef\n")
    key_file.chmod(0o600)
    cfg = EtcdConfig.from_endpoint(etcd_server.endpoint, {"read_timeout": "5"})
    s = RendezvousSettings(run_id=run_id, min_nodes=1, max_nodes=2, lease_ttl=30, last_call_timeout=0)
    with_key = ("--rdzv-conf", f"run_key_file={key_file}")

    async def status(*extra: str) -> dict:
        capsys.readouterr()
        assert await asyncio.to_thread(ctl, etcd_server.endpoint, run_id, "status", "--json", *extra) == 0
        return json.loads(capsys.readouterr().out)

    async def main() -> None:
        guard = rendezvous_guard(RunKey.from_text(key_file.read_text()))
        async with EtcdRendezvous(cfg, s, NodeInfo("a", "127.0.0.1", 2), guard=guard) as rdzv:
            await rdzv.join()
            async with EtcdStore(cfg) as store:
                await store.put_json(rdzv.key("nodes", "evil"), NodeInfo("evil", "6.6.6.6", 2).to_json())
                verified = await status(*with_key)
                unverified = await status()
                capsys.readouterr()
                assert await asyncio.to_thread(ctl, etcd_server.endpoint, run_id, "status") == 0
                table = capsys.readouterr().out
                await store.delete(rdzv.key("nodes", "evil"))
        assert verified["provenance"] == "verified" and sorted(verified["nodes"]) == ["a"]
        assert verified["leader"] == "a" and verified["generation"]["members"][0]["node_id"] == "a"
        assert unverified["provenance"] == "unverified" and sorted(unverified["nodes"]) == ["a", "evil"]
        assert "unverified" in table and "run_key_file" in table

    asyncio.run(main())
