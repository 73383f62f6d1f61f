"""The control plane at scale (bench/scale.py, issue 43): what the triage reads of a status write (pure), and the
simulator itself at a tiny size against the session's etcd (no process of its own).

The incident: every agent's swap coordinator watched the run's whole prefix, though only the leader acts on it, and
every status write kicked it. Each agent writes its status every second, so N agents received N^2 watch events a
second (64 nodes: 4,096 a second, 8 MiB/s out of etcd; 2,048 nodes: 4 million), and the leader re-read every
status on each no-op kick (23% of a core at rest with 64 nodes). Now only the leader watches, and a status write
kicks it only when what the triage reads of it changed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tpassrun.records import NodeStatus, WorkerRow
from tpassrun.swapper.coordinator import status_shape

ROOT = Path(__file__).resolve().parents[1]


def _status(*, step: int = 7, state: str = "running", rank: int | None = 3, managed: bool = True,
            time: float = 1.0) -> dict:
    row = WorkerRow(0, rank=rank, local_rank=0, state=state, step=step, managed=managed, last_step_ms=step * 2.0)
    return NodeStatus("a", addr="10.0.0.1", generation=2, workers=(row,), time=time).to_json()


def test_a_status_write_kicks_the_leader_only_when_what_the_triage_reads_changed():
    base = status_shape(_status())
    assert base is not None
    assert status_shape(_status(step=8, time=2.0)) == base          # the every-second rewrite: no kick
    assert status_shape(_status(state="dead")) != base
    assert status_shape(_status(rank=None, state="spare")) != base
    assert status_shape(_status(managed=False)) != base
    assert status_shape({"node_id": "a", "workers": "garbage"}) is None   # the tick's strict reader judges it
    assert status_shape(None) is None


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "bench" / "scale.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(90)
def test_the_simulated_cluster_recovers_a_node_loss_and_only_the_leader_watches_status(etcd_server):
    """Six agents' real control plane (rendezvous, swapper, coordinator) and stand-in workers: a node loss is planned
    and carried to its committed generation by the leader's real coordinator; at rest no follower hears a thing."""
    bench = _bench()
    args = argparse.Namespace(spare_nodes=1, status_period=0.2, lease_ttl=10, agents_per_connection=4, trace=False,
                              settle=0.5, rest=1.0, ctl=False, faults=1, speedup=1e9)
    row = asyncio.run(bench.one_size([etcd_server.endpoint], 6, args))
    (fault,) = row["faults"]
    assert fault["plan_s"] <= fault["done_s"]            # planned, then done (lose() asserts it reached DONE)
    assert row["rest_events_follower_max"] == 0          # status writes reach the leader only
    assert row["rest_events_leader"] > 0
