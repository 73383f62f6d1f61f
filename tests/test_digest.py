"""The replica check after a swap or recovery (issue 22 item 2): the exact digest (tpassrun/worker/digest.py), the pure
decision (who differs, whom it may trust, what it loads from whom), the console line, and the worker's collectives
and repair on real gloo processes (tpassrun/worker/replicas.py; the whole job: tests/test_digest_e2e.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from tpassrun.ops.console import ConsoleReporter, Describer
from tpassrun.worker import digest
from tpassrun.worker import faultpoints as testing
from tpassrun.worker.digest import RankDigest, Repair, decide, describe_repairs, repair_plan, state_digest, tensor_digest
from tpassrun.worker.replicas import _renumber

pytestmark = pytest.mark.timeout(300)
GLOO = pytest.mark.timeout(900)     # a hang catcher: starting 4 torch processes on a loaded host takes minutes
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------------------------- the digest

def _flip(t: torch.Tensor, byte: int) -> torch.Tensor:
    out = t.clone()
    out.reshape(-1).view(torch.uint8)[byte:byte + 1].bitwise_xor_(1)
    return out


def test_equal_tensors_have_equal_digests_and_any_flipped_bit_changes_it():
    t = torch.randn(3000, 7)          # 84,000 bytes: 10 whole rows of 8 KiB and a tail
    assert tensor_digest(t) == tensor_digest(t.clone())
    seen = {tensor_digest(t)}
    for byte in (0, 1, 8191, 8192, 40_000, 81_919, 81_920, 83_999):    # rows, their edges, the tail
        d = tensor_digest(_flip(t, byte))
        assert d not in seen, byte
        seen.add(d)


def test_moved_words_change_the_digest():
    t = torch.arange(4096, dtype=torch.int64) * 7919        # 32 KiB: 4 rows of 1024 words
    within_row = t.clone()
    within_row[[3, 700]] = within_row[[700, 3]]
    across_rows = t.clone()
    across_rows[[3, 1027]] = across_rows[[1027, 3]]         # the same column, another row
    rows_swapped = t.view(4, 1024)[[1, 0, 2, 3]].reshape(-1)
    digests = {tensor_digest(x) for x in (t, within_row, across_rows, rows_swapped)}
    assert len(digests) == 4


def test_dtype_shape_views_and_odd_tensors():
    t = torch.randn(64, 32)
    assert tensor_digest(t) != tensor_digest(t.reshape(32, 64))               # same bytes, another shape
    assert tensor_digest(t) != tensor_digest(t.view(torch.int32))             # same bytes, another dtype
    assert tensor_digest(t.t()) == tensor_digest(t.t().contiguous())          # the values, not the layout
    flat = torch.randn(5000, dtype=torch.bfloat16)
    odd = flat[3:4003]                                                        # a view at an odd byte offset
    assert tensor_digest(odd) == tensor_digest(odd.clone())
    for x in (torch.tensor(3.0), torch.empty(0), torch.ones(10, dtype=torch.bool), torch.zeros(3, dtype=torch.int8)):
        assert tensor_digest(x) == tensor_digest(x.clone())
    assert tensor_digest(torch.tensor(0.0)) != tensor_digest(torch.tensor(-0.0))   # bit-level, not ==


def _job(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)}


def test_state_digest_names_every_tensor_and_the_values():
    objs = _job()
    got = state_digest(objs)
    assert set(got.leaves) == {"model", "optimizer", "scheduler"}
    assert {"model.0.weight", "model.1.bias", digest.VALUES} <= set(got.leaves["model"])
    assert {"optimizer.state.0.exp_avg", "optimizer.state.3.step"} <= set(got.leaves["optimizer"])
    assert set(got.leaves["scheduler"]) == {digest.VALUES}
    assert got.nbytes > 4 * (16 * 32 + 32 * 2)
    assert state_digest(_job()).summary == got.summary              # the same state elsewhere: the same digest
    objs["optimizer"].param_groups[0]["lr"] = 0.02                  # a hyper-parameter: a non-tensor value
    other = state_digest(objs)
    assert [k for k in other.leaves if other.leaves[k] != got.leaves[k]] == ["optimizer"]
    assert other.leaves["optimizer"][digest.VALUES] != got.leaves["optimizer"][digest.VALUES]


# --------------------------------------------------------------------------------------------- the decision

def _says(*sides: tuple[list[int], bytes], loaded: tuple[int, ...] = (), group: int = 1) -> list[RankDigest]:
    return [RankDigest(rank=r, group=group, summary=s, loaded=r in loaded) for ranks, s in sides for r in ranks]


A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def test_replicas_that_agree_pass():
    v = decide(_says(([0, 1, 2, 3], A), loaded=(1,)))
    assert v.ok and v.groups == ((0, 1, 2, 3),) and v.ranks == 4


def test_a_strict_majority_is_right_and_the_rest_take_from_a_rank_that_kept_its_state():
    v = decide(_says(([0, 2, 3], A), ([1], B), loaded=(1,)))
    assert not v.ok and not v.restart and v.differ == (1,) and v.trusted[1] == (0, 2, 3)
    v = decide(_says(([0, 1, 2], A), ([3], B), loaded=(0, 3)))     # the majority holds a joiner: it goes last
    assert v.trusted[3] == (1, 2, 0)


def test_two_replicas_trust_the_one_that_was_not_just_loaded():
    v = decide(_says(([0], A), ([1], B), loaded=(1,)))
    assert v.trusted == {1: (0,)} and not v.restart
    v = decide(_says(([0, 1], A), ([2, 3], B), loaded=(2, 3)))    # no majority: the joiners' side is the suspect
    assert v.trusted == {2: (0, 1), 3: (0, 1)}


def test_no_side_to_trust_restarts_saying_why():
    for says in (_says(([0], A), ([1], B), loaded=(0, 1)),        # both just loaded
                 _says(([0], A), ([1], B)),                        # neither: they differed before the recovery
                 _says(([0], A), ([1], B), ([2], C), loaded=(2,))):   # three ways, two sides kept their state
        v = decide(says)
        assert not v.ok and v.restart and not v.trusted, v
        assert "disagree" in v.restart and "no side can be trusted" in v.restart


def test_groups_are_compared_apart_and_alone_or_undigested_ranks_not_at_all():
    says = (_says(([0, 2], A), group=10) + _says(([1], B), ([3], C), loaded=(3,), group=11)
            + [RankDigest(rank=4, group=12, summary=A), RankDigest(rank=5, group=10, summary=C, compared=False)])
    v = decide(says)
    assert v.groups == ((0, 2), (1, 3)) and v.trusted == {3: (1,)} and not v.restart


def test_repair_plan_names_the_tensors_and_objects_that_differ():
    leaves = {0: {"model": {"(values)": "v", "model.w": "1", "model.b": "2"}, "sched": {"(values)": "s"}},
              1: {"model": {"(values)": "v", "model.w": "9", "model.b": "2"}, "sched": {"(values)": "t"}}}
    v = decide(_says(([0], A), ([1], B), loaded=(1,)))
    repairs, problem = repair_plan(v, leaves)
    assert problem == ""
    assert repairs == [Repair(src=0, dst=1, objects=("model", "sched"), tensors=("model.w", "sched (values)"))]
    assert describe_repairs(repairs) == "rank 1 differs in model.w, sched (values): takes model, sched from rank 0"
    leaves[1]["extra"] = {"(values)": "x"}
    repairs, problem = repair_plan(v, leaves)
    assert repairs == [] and "rank 1 tracks ['extra'] unlike rank 0" in problem


def test_renumbered_trees_point_into_one_shared_tensor_list():
    tree = {"$od": [[["w", {"$T": 0}], ["b", {"$T": 1}]], None], "n": {"$np": [2, "<f4", [3]]}, "s": {"$size": [1]}}
    assert _renumber(tree, 5) == {"$od": [[["w", {"$T": 5}], ["b", {"$T": 6}]], None], "n": {"$np": [7, "<f4", [3]]},
                                  "s": {"$size": [1]}}


# --------------------------------------------------------------------------------------------- what is said

def _line(**ev) -> tuple[str | None, str]:
    out: list[str] = []

    class Sink:
        def write(self, text: str) -> None:
            out.append(text)

        def flush(self) -> None:
            pass

    ev = {"event": "replicas_checked", "time": 0.0, "mono": 0.0, "node": "vm-1-ab", **ev}
    ConsoleReporter(stream=Sink(), pid=1)(ev)
    return Describer().describe(ev), (out[0][0] if out else "")


def test_console_lines():
    line, level = _line(step=12, ok=True, ranks=4, groups=1, nbytes=3 << 20, seconds=0.012)
    assert line == ("replicas agree at step 12: 4 rank(s) in 1 replica group(s) hold identical state (3.0 MiB "
                    "digested per rank in 12 ms)") and level == "I"
    line, level = _line(step=12, ok=False, action="repair", detail="rank 1 differs in model.fc1.weight: takes model "
                                                                   "from rank 0")
    assert line == ("replica check at step 12: MISMATCH: rank 1 differs in model.fc1.weight: takes model from rank 0 "
                    "(repairing from a replica)") and level == "W"
    line, _ = _line(step=12, ok=True, recheck=True, ranks=4)
    assert line == "replicas agree again at step 12 after the repair (4 rank(s) compared)"
    line, level = _line(step=3, ok=False, action="restart", detail="replicas [0, 1] disagree")
    assert line.endswith("(no replica to trust: whole-group restart)") and level == "W"
    line, _ = _line(step=3, ok=True, groups=0, ranks=0)
    assert "no rank has a replica to compare with" in line


def test_the_corrupt_fault_is_claimed_once_with_its_fields(tmp_path, monkeypatch):
    fault = {"rank": 1, "where": "loaded", "action": "corrupt", "tensor": "model.w", "marker": str(tmp_path / "m")}
    monkeypatch.setenv(testing.FAULTS_ENV, json.dumps([fault]))
    testing._faults.cache_clear()
    try:
        assert testing.claim(0, 5, "loaded", "corrupt") is None
        assert testing.claim(1, 5, "loaded", "corrupt") == fault
        assert testing.claim(1, 5, "loaded", "corrupt") is None
    finally:
        testing._faults.cache_clear()


# --------------------------------------------------------------------------------------------- real gloo

CHILD = r'''
import dataclasses, json, os, sys
import torch, torch.distributed as dist
from tpassrun.worker import digest
from tpassrun.worker.session import Session

cfg = json.loads(sys.argv[1])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
sess = Session(backend="gloo", link=None, rank=rank, world_size=world, local_rank=rank, generation=0, joined=False,
               timeout=None)
groups = cfg.get("groups")
group = next((g for g in groups if rank in g), None) if groups else None
torch.manual_seed(groups.index(group) if group else 0)      # each replica group its own model
model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 3))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
model(torch.randn(4, 64)).sum().backward()
opt.step()
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

class Position:                                              # per rank: never compared
    def state_dict(self): return {"rank": rank}
    def load_state_dict(self, s): pass

sess.track(model=model, optimizer=opt, scheduler=sched)
sess.track_per_rank(position=Position())
if group:
    sess.declare_replicas(group)
if rank in cfg.get("lr", []):
    opt.param_groups[0]["lr"] = 0.5                          # a non-tensor value differs too
said = []
sess._replicas._say = said.append
restart = sess._replicas.rounds(7, rank in cfg["loaded"])
tracked = {"model": model, "optimizer": opt, "scheduler": sched}
out = {"restart": restart, "said": [dataclasses.asdict(m) for m in said],
       "summary": digest.state_digest(tracked).summary.hex(), "lr": opt.param_groups[0]["lr"]}
with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as fh:
    json.dump(out, fh)
dist.barrier()
dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, world: int, *, loaded: list[int], corrupt: int | None = None, tensor: str | None = None,
         groups: list[list[int]] | None = None, lr: list[int] | None = None) -> list[dict]:
    cfg = {"out": str(tmp_path), "loaded": loaded, "groups": groups, "lr": lr or []}
    faults = [] if corrupt is None else [{"rank": corrupt, "where": "loaded", "action": "corrupt", "tensor": tensor,
                                          "marker": str(tmp_path / "corrupt")}]
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", testing.FAULTS_ENV: json.dumps(faults)}
        env.pop("TPASSRUN_CHANNEL", None)
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg)], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        logs = [p.communicate(timeout=850)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(world)]


@pytest.mark.e2e
@GLOO
def test_gloo_agreeing_replicas_say_so_in_one_round(tmp_path):
    out = _run(tmp_path, 3, loaded=[2])
    assert [o["restart"] for o in out] == [False] * 3
    assert len({o["summary"] for o in out}) == 1
    said = out[0]["said"]
    assert len(said) == 1 and said[0]["ok"] and said[0]["ranks"] == 3 and said[0]["groups"] == 1
    assert said[0]["nbytes"] > 3 * 4 * (64 * 300 + 300 * 3)     # model + AdamW's two moments


@pytest.mark.e2e
@GLOO
def test_gloo_a_corrupted_joiner_is_named_and_repaired_from_a_replica(tmp_path):
    out = _run(tmp_path, 3, loaded=[2], corrupt=2, tensor="model.1.weight", lr=[2])
    assert [o["restart"] for o in out] == [False] * 3
    assert len({o["summary"] for o in out}) == 1 and out[2]["lr"] == 0.01      # repaired: tensors and values
    first, again = out[0]["said"]
    assert not first["ok"] and first["action"] == "repair"
    assert first["differ"]["2"]["source"] == 0 and first["differ"]["2"]["tensors"] == ["model.1.weight",
                                                                                       "optimizer (values)"]
    assert "rank 2 differs in model.1.weight, optimizer (values): takes model, optimizer from rank 0" in first["detail"]
    assert again["ok"] and again["recheck"]


@pytest.mark.e2e
@GLOO
def test_gloo_replica_groups_are_compared_apart(tmp_path):
    """TP x DP (or HSDP): ranks {0, 2} hold one model, {1, 3} another (as declared): only rank 3, corrupted
    after loading, differs, and it takes its state from rank 1, not from a rank of the other group."""
    out = _run(tmp_path, 4, loaded=[3], corrupt=3, groups=[[0, 2], [1, 3]])
    assert [o["restart"] for o in out] == [False] * 4
    assert out[0]["summary"] == out[2]["summary"] != out[1]["summary"] == out[3]["summary"]
    first, again = out[0]["said"]
    assert list(first["differ"]) == ["3"] and first["differ"]["3"]["source"] == 1
    assert first["differ"]["3"]["tensors"] == ["model.0.weight"] and again["ok"] and again["ranks"] == 4


@pytest.mark.e2e
@GLOO
def test_gloo_two_replicas_both_just_loaded_restart(tmp_path):
    out = _run(tmp_path, 2, loaded=[0, 1], corrupt=1)
    assert [o["restart"] for o in out] == [True, True]
    (said,) = out[0]["said"]
    assert said["action"] == "restart" and "no side can be trusted" in said["detail"]
    assert out[0]["summary"] != out[1]["summary"]                   # nothing was loaded from anyone
