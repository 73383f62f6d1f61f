"""Detection latency end to end: a site tool writes a reading -> the taint key is in etcd.

Runs :class:`tpassrun.agent.healthd.AgentHealth` (the agent's health daemon) against a throw-away etcd with a
FileSensor and a stand-in agent (one rank per GPU). For each polling interval, the readings file is
rewritten at a random phase of the polling cycle with rising uncorrected ECC on one GPU, and we time until
a watch on ``P taints/`` sees the key. The ratio to the interval should stay <= 2 (one interval of phase,
plus the read, the verdict and one etcd write).

    python bench/health_detect.py [trials per interval, default 8] [etcd endpoint, default: start one]
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
import urllib.request

from tpassrun.agent.healthd import AgentHealth
from tpassrun.channel.slots import SlotState
from tpassrun.health import FileSensor
from tpassrun.ops.events import EventLog
from tpassrun.rendezvous import EtcdConfig, EtcdStore, find_etcd_binary

INTERVALS = (0.05, 0.1, 0.25, 0.5, 1.0)
ECC = "ecc_uncorrected_volatile"


class Slots:
    """One running rank per GPU; each trial taints a fresh GPU (the default ECC rule is sticky)."""

    def __init__(self, n: int) -> None:
        self.slots = [types.SimpleNamespace(index=i, rank=i, proc=None, pid=None, state=SlotState.RUNNING)
                      for i in range(n)]

    def field(self, slot, f) -> int:  # no straggler detection in this bench
        return 0


class Rdzv:
    def __init__(self, store: EtcdStore, prefix: str) -> None:
        self.store, self.prefix = store, prefix

    def key(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)


def write(path: str, readings: list[dict]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump({"v": 1, "readings": readings}, f)
    os.replace(path + ".tmp", path)


async def measure(endpoint: str, interval: float, trials: int, directory: str) -> list[float]:
    path = os.path.join(directory, f"readings-{interval}.json")
    prefix = f"/tpassrun/v1/bench-{os.getpid()}-{interval}/"
    counts = {f"gpu{i}": 0 for i in range(trials)}
    write(path, [{"device": d, "metric": ECC, "value": 0} for d in counts])
    store = EtcdStore(EtcdConfig.from_endpoint(endpoint, {}), lease_ttl=10)
    await store.open()
    agent = types.SimpleNamespace(
        cfg=types.SimpleNamespace(health_config=None, health_interval=interval, straggler_factor=0.0),
        node_id="bench", rdzv=Rdzv(store, prefix), slots=Slots(trials), events=EventLog(None), environ={})
    health = AgentHealth(agent, sensors=[FileSensor(path)])
    task = asyncio.ensure_future(health.run())
    latencies: list[float] = []
    try:
        seen: asyncio.Queue[float] = asyncio.Queue()

        async def watch() -> None:
            async for ev in store.watch_prefix(prefix + "taints/"):
                if ev.kind == "put":
                    seen.put_nowait(time.monotonic())

        watcher = asyncio.ensure_future(watch())
        await asyncio.sleep(2 * interval + 0.2)   # the zero readings become the counters' baselines
        for trial in range(trials):
            device = f"gpu{trial}"
            await asyncio.sleep(random.uniform(0, interval))    # random phase against the poll
            counts[device] += 1
            write(path, [{"device": d, "metric": ECC, "value": v} for d, v in counts.items()])
            written = time.monotonic()
            arrived = await asyncio.wait_for(seen.get(), timeout=10 * interval + 5)
            latencies.append(arrived - written)
        watcher.cancel()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.delete_prefix(prefix)
        await store.close()
    return latencies


def start_etcd(directory: str) -> tuple[subprocess.Popen, str]:
    def free() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    port, peer = free(), free()
    proc = subprocess.Popen(
        [find_etcd_binary(None), "--name", "b", "--data-dir", os.path.join(directory, "etcd"),
         "--listen-client-urls", f"http://127.0.0.1:{port}", "--advertise-client-urls", f"http://127.0.0.1:{port}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"b=http://127.0.0.1:{peer}", "--log-level", "error", "--logger", "zap"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("etcd did not start")


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    directory = tempfile.mkdtemp(prefix="tpassrun-health-detect-")
    etcd = None
    try:
        endpoint = sys.argv[2] if len(sys.argv) > 2 else None
        if endpoint is None:
            etcd, endpoint = start_etcd(directory)
        print(f"reading written -> taint key in etcd ({trials} trials per interval, etcd {endpoint})")
        print(f"{'interval s':>10} {'mean ms':>9} {'p50 ms':>8} {'max ms':>8} {'mean/int':>9} {'max/int':>8}")
        for interval in INTERVALS:
            lat = asyncio.run(measure(endpoint, interval, trials, directory))
            print(f"{interval:>10.2f} {statistics.mean(lat) * 1e3:>9.1f} {statistics.median(lat) * 1e3:>8.1f} "
                  f"{max(lat) * 1e3:>8.1f} {statistics.mean(lat) / interval:>9.2f} {max(lat) / interval:>8.2f}")
        print("target: max/int <= 2")
    finally:
        if etcd is not None:
            etcd.terminate()
            etcd.wait(5)
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
