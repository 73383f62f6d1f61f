"""Shared helpers for the launcher benchmarks: run tpassrun and torchrun side by side, read what the job left.

The jobs themselves are run by ``tests/faults.py`` (:class:`Job`, :func:`kill_at`, :func:`taint`); this module
only adds what the benchmarks need on top: alternating trials, timings derived from the loss logs (every row
carries the wall-clock ``t`` at which that rank finished that step) and from the agent's event log, and
printing medians next to every trial.

Pure functions of the job's files (``first_step_done``, ``steady_ms_per_step``, ``next_step_after``,
``steps_lost``) are separate from running things, so they can be checked on any saved output directory.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, os.path.join(REPO, "tests"))

from conftest import EtcdServer  # noqa: E402  (tests/ is not a package)
from faults import Job, faults_env, kill_at, taint  # noqa: E402,F401  (re-exported for the benches)

# ---------------------------------------------------------------------------------------------
# no orphans: a bench stopped by a signal kills what it started

# Jobs and etcd servers run in sessions of their own (so a fault can kill a job's whole group), so a signal to the
# bench reaches none of them, and a SIGTERMed bench used to leave its tpassrun/torchrun jobs training on. Everything
# a bench starts is remembered here; at exit (normal, an exception, Ctrl-C's KeyboardInterrupt) it is killed, and
# SIGTERM/SIGHUP become an exit (SystemExit: every ``finally`` and ``with`` runs first, then this).
_STARTED: list[Any] = []


def _remembered(cls: Any) -> None:
    start = cls.start

    def start_remembered(self: Any, *args: Any, **kwargs: Any) -> Any:
        _STARTED.append(self)
        return start(self, *args, **kwargs)

    cls.start = start_remembered


def stop_everything_started() -> None:
    """Kill every job and stop every etcd server this bench started that is still running (newest first)."""
    while _STARTED:
        thing = _STARTED.pop()
        try:
            thing.kill() if isinstance(thing, Job) else thing.cleanup()     # etcd: stopped, its data dir removed
        except Exception as exc:  # noqa: BLE001 - keep stopping the others
            print(f"bench: could not stop {type(thing).__name__}: {exc}", file=sys.stderr)


def _exit_on_signal(signum: int, _frame: Any) -> None:
    signal.signal(signum, signal.SIG_DFL)      # a second signal is not caught again
    raise SystemExit(128 + signum)


_remembered(Job)
_remembered(EtcdServer)
atexit.register(stop_everything_started)
for _sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, _exit_on_signal)

# torchrun 2.13 shares the rendezvous TCPStore with the workers by default, and every restart then fails in
# gloo init (torchrun.md 3.7 item 1); with sharing disabled a restart works, so that is the fair baseline.
TORCHRUN_RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


# ---------------------------------------------------------------------------------------------
# trials


def alternate(launchers: tuple[str, ...], trials: int) -> Iterator[tuple[int, str]]:
    """(trial, launcher) in ABAB... order, so that background load on a shared host hits both alike."""
    for trial in range(trials):
        for launcher in launchers:
            yield trial, launcher


@dataclass
class Series:
    """Every trial's figure for one measurement, per launcher."""

    name: str
    unit: str
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, launcher: str, value: float | None) -> None:
        if value is not None:
            self.values.setdefault(launcher, []).append(value)

    def median(self, launcher: str) -> float | None:
        vals = self.values.get(launcher)
        return statistics.median(vals) if vals else None

    def ratio(self, num: str, den: str) -> float | None:
        a, b = self.median(num), self.median(den)
        return a / b if a is not None and b else None

    def line(self, launcher: str, digits: int = 3) -> str:
        vals = self.values.get(launcher, [])
        med = self.median(launcher)
        med_s = f"{med:.{digits}f}" if med is not None else "n/a"
        return (f"{self.name:34s} {launcher:9s} median {med_s:>9s} {self.unit:5s} "
                f"trials [{', '.join(f'{v:.{digits}f}' for v in vals)}]")


def verdict(value: float | None, target: float, *, at_most: bool) -> str:
    if value is None:
        return "n/a"
    ok = value <= target if at_most else value >= target
    return "meets" if ok else "MISSES"


def ratio_line(label: str, value: float | None, target: float, *, at_most: bool) -> str:
    shown = f"{value:.3f}" if value is not None else "n/a"
    op = "<=" if at_most else ">="
    return f"{label:48s} {shown:>8s}   (target {op} {target:g}: {verdict(value, target, at_most=at_most)})"


def _rounded(obj: Any) -> Any:
    if isinstance(obj, float):
        return round(obj, 4)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v) for v in obj]
    return obj


def print_json(doc: dict[str, Any]) -> None:
    """The last line of every bench: one JSON object with every trial, for scripts."""
    print(json.dumps(_rounded(doc), default=str))


# ---------------------------------------------------------------------------------------------
# what the job left behind (pure: only reads files)


def loss_rows(out: str, rank: int) -> list[dict[str, Any]]:
    path = os.path.join(out, f"loss_rank{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def first_step_done(out: str, world: int, started_wall: float) -> float | None:
    """Seconds from launch until every rank had finished its first step."""
    firsts = []
    for rank in range(world):
        rows = loss_rows(out, rank)
        if not rows:
            return None
        firsts.append(rows[0]["t"])
    return max(firsts) - started_wall


def step_done_all(out: str, world: int) -> dict[int, float]:
    """step -> wall time at which the last rank finished it (first execution only)."""
    done: dict[int, float] = {}
    seen: list[dict[int, float]] = []
    for rank in range(world):
        per_rank: dict[int, float] = {}
        for row in loss_rows(out, rank):
            per_rank.setdefault(row["step"], row["t"])
        seen.append(per_rank)
    for step in set.intersection(*(set(s) for s in seen)) if seen else set():
        done[step] = max(s[step] for s in seen)
    return done


def steady_ms_per_step(out: str, world: int, first: int = 20) -> float | None:
    """Median milliseconds between consecutive steps done on all ranks, from step ``first`` on."""
    done = step_done_all(out, world)
    steps = sorted(s for s in done if s >= first)
    gaps = [(done[b] - done[a]) * 1e3 for a, b in zip(steps, steps[1:]) if b == a + 1]
    return statistics.median(gaps) if gaps else None


def next_step_after(out: str, world: int, after_wall: float) -> float | None:
    """Seconds from ``after_wall`` until every rank had logged a step finished after it."""
    latest = []
    for rank in range(world):
        later = [row["t"] for row in loss_rows(out, rank) if row["t"] > after_wall]
        if not later:
            return None
        latest.append(min(later))
    return max(latest) - after_wall


def steps_lost(out: str, world: int, total_steps: int) -> dict[str, int]:
    """Work lost to a failure, from the loss logs: ``redone`` = steps finished twice (work thrown away and
    done again: a restart from scratch), ``missing`` = steps of ``range(total_steps)`` never logged."""
    redone = missing = 0
    for rank in range(world):
        steps = [row["step"] for row in loss_rows(out, rank)]
        redone = max(redone, len(steps) - len(set(steps)))
        missing = max(missing, len(set(range(total_steps)) - set(steps)))
    return {"redone": redone, "missing": missing}


def events(out: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for root, _dirs, files in os.walk(os.path.join(out, "logs")):
        if "events.jsonl" in files:
            with open(os.path.join(root, "events.jsonl")) as fh:
                found += [json.loads(line) for line in fh if line.strip()]
    return sorted(found, key=lambda e: e["time"])


def first_event(evs: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((e for e in evs if e["event"] == name), None)


def marker_time(path: str) -> float | None:
    """When a fault fired: ``fault_point`` writes its pid and ``time.time()`` into its marker file right
    before it kills the process (the file's mtime is only a fallback: it can be several ms coarse)."""
    try:
        with open(path) as fh:
            fields = fh.read().split()
        return float(fields[1]) if len(fields) > 1 else os.stat(path).st_mtime
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# running


class Workdir:
    """A temp directory for one bench run; removed at exit unless ``keep``."""

    def __init__(self, keep: bool = False, prefix: str = "tpassrun-bench-") -> None:
        self.keep = keep
        self.path = tempfile.mkdtemp(prefix=prefix)

    def sub(self, name: str) -> str:
        return os.path.join(self.path, name)

    def __enter__(self) -> "Workdir":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.keep:
            print(f"outputs kept in {self.path}")
        else:
            shutil.rmtree(self.path, ignore_errors=True)


def run_to_end(job: Job, timeout: float, during: Callable[[Job], None] | None = None) -> tuple[int, float]:
    """Start ``job``, optionally act on it while it runs, wait for it; (exit code, wall time it started)."""
    started_wall = time.time()
    job.start()
    try:
        if during is not None:
            during(job)
        return job.wait(timeout), started_wall
    finally:
        job.kill()


def tail(job: Job, chars: int = 1500) -> str:
    return job.log()[-chars:]


def add_common_args(parser: Any, trials: int) -> None:
    parser.add_argument("--trials", type=int, default=trials, help="trials per launcher (alternated)")
    parser.add_argument("--quick", action="store_true", help="one trial per launcher")
    parser.add_argument("--keep", action="store_true", help="keep the jobs' output directories")


def taint_times(endpoint: str, run_id: str, root: str = "/tpassrun/v1") -> list[float]:
    """The ``time`` field of every taint of a run (when ``tpassctl`` wrote it), read straight from etcd."""
    import asyncio

    import aetcd

    async def read() -> list[float]:
        host, _, port = endpoint.rpartition(":")
        async with aetcd.Client(host, int(port), timeout=10) as client:
            kvs = await client.get_prefix(f"{root}/{run_id}/taints/".encode())
            return sorted(float(json.loads(kv.value)["time"]) for kv in kvs)

    return asyncio.run(read())


def tracked_state_bytes(hidden: int, dim: int = 32) -> int:
    """Bytes of model + AdamW state (exp_avg, exp_avg_sq) of examples/train_ddp.py's Net, float32."""
    params = dim * hidden + hidden + hidden * hidden + hidden + hidden + 1
    return 3 * 4 * params


def hidden_for_state(target_bytes: int, dim: int = 32) -> int:
    hidden = 16
    while tracked_state_bytes(hidden + 16, dim) <= target_bytes:
        hidden += 16
    return hidden


def with_script(job: Job, script: str, script_args: list[str]) -> Job:
    """``job``, built for ``examples/train_ddp.py`` (``Job.tpassrun``/``Job.agent``/``Job.torchrun``), running
    ``script`` instead with the same ``--steps``/``--step-sleep``/``--out`` and ``script_args`` (its own, in place
    of train_ddp's), on the CPU settings the framework examples need (``DS_ACCELERATOR=cpu``, ...)."""
    from faults import EXAMPLE
    from realjobs import CPU_ENV

    at = job.argv.index(EXAMPLE)
    rest = job.argv[at + 1:]
    kept = {rest[i]: rest[i + 1] for i in range(len(rest) - 1) if rest[i] in ("--steps", "--step-sleep", "--out")}
    job.argv[at:] = [os.path.abspath(script), *(x for k, v in kept.items() for x in (k, v)), *script_args]
    job.env = {**CPU_ENV, **job.env}
    return job
