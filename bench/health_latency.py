"""Detection latency of the health monitor: FileSensor reading written -> on_verdicts called.

For each polling interval, a site tool's file is rewritten (atomically) at a random phase of the
polling cycle with a reading that breaches a rule; we time until the monitor hands the verdict
to ``on_verdicts``. Expected: at most one interval plus the read, i.e. a ratio <= 1 on average and
<= 2 in the worst case (target: <= 2 polling intervals).

    python bench/health_latency.py [trials per interval, default 8]
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time

from tpassrun.health import FileSensor, HealthMonitor, Policy, PolicyEngine, Rule, TaintEffect


async def measure(interval: float, trials: int, directory: str) -> list[float]:
    path = os.path.join(directory, f"readings-{interval}.json")
    written: dict[str, float] = {}
    latencies: list[float] = []
    arrived = asyncio.Event()

    async def on_verdicts(verdicts) -> None:
        now = time.monotonic()
        for verdict in verdicts:
            if verdict.taints and verdict.device in written:
                latencies.append(now - written.pop(verdict.device))
                arrived.set()

    policy = Policy((Rule("site_alarm", ">=", 1, effect=TaintEffect.MIGRATE),))
    monitor = HealthMonitor([FileSensor(path)], PolicyEngine(policy), interval=interval, on_verdicts=on_verdicts)
    task = asyncio.create_task(monitor.run())
    readings: list[dict] = []
    try:
        for trial in range(trials):
            await asyncio.sleep(random.uniform(0, interval))    # random phase against the poll
            device = f"slot{trial}"
            readings.append({"device": device, "metric": "site_alarm", "value": 1})
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"v": 1, "readings": readings}, f)
            written[device] = time.monotonic()
            os.replace(tmp, path)
            arrived.clear()
            await asyncio.wait_for(arrived.wait(), timeout=10 * interval + 5)
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    return latencies


async def main(trials: int) -> None:
    print(f"health detection latency, FileSensor -> on_verdicts, {trials} trials per interval")
    print(f"{'interval s':>10} {'mean ms':>9} {'p50 ms':>8} {'max ms':>8} {'mean/int':>9} {'max/int':>8}")
    with tempfile.TemporaryDirectory(prefix="tpassrun-bench-health-") as directory:
        for interval in (0.1, 0.5, 1.0):
            lat = await measure(interval, trials, directory)
            mean, p50, worst = statistics.mean(lat), statistics.median(lat), max(lat)
            print(f"{interval:>10.1f} {mean * 1e3:>9.1f} {p50 * 1e3:>8.1f} {worst * 1e3:>8.1f} "
                  f"{mean / interval:>9.2f} {worst / interval:>8.2f}")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 8))
