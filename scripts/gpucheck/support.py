"""What every check of ``scripts/gpu_check.sh`` shares: its context, an etcd of its own, jobs it starts and
always stops, and the comparisons it makes. No pytest: the jobs are ``tests/faults.py``'s :class:`Job` (a real
launcher in a session of its own), every process group started is written to the check's ``pids`` file so the
harness can kill it even when the check itself was killed, and every wait has a deadline of at most
:data:`STEP_S`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests"))

from faults import Hold, Job, faults_env, kill_at, sigkill_rank, taint  # noqa: E402,F401

EXAMPLE = os.path.join(REPO, "examples", "train_ddp.py")
# no single wait of a check is longer than this (a rehearsal on a loaded CPU host may stretch it)
STEP_S = float(os.environ.get("GPUCHECK_STEP_S", "60"))


class Skip(Exception):
    """The check cannot run here; its message is the reason shown in the table (``skipped: <reason>``)."""


class Failed(Exception):
    """The check ran and found something wrong; its message is the table's "where it failed"."""


@dataclass
class Ctx:
    name: str
    dir: str                 # this check's own directory (logs, jobs' outputs)
    dry_run: bool
    gpus: int                # CUDA devices torch sees (0 in a dry run)
    rehearse: bool = False   # the jobs on CPU (gloo): the harness's own rehearsal of the job checks
    python: str = sys.executable

    @property
    def device(self) -> str:
        return "cpu" if self.rehearse else "cuda"

    def say(self, message: str) -> None:
        """A progress line in the check's log: on a timeout, the last one says where the check stood."""
        print(f"[{time.strftime('%H:%M:%S')}] {self.name}: {message}", flush=True)

    def need_gpus(self, n: int = 1, *, cuda: bool = False) -> None:
        """Skip unless ``n`` GPUs are here; a rehearsal runs the checks of one GPU that need no CUDA API."""
        if self.rehearse and n == 1 and not cuda and not self.dry_run:
            return
        if self.dry_run or self.gpus == 0:
            raise Skip("no GPU")
        if self.gpus < n:
            raise Skip(f"needs {n} GPUs")

    def started(self, pid: int) -> None:
        """Remember a process group this check started (its leader's pid), for the harness's last sweep."""
        with open(os.path.join(self.dir, "pids"), "a") as fh:
            fh.write(f"{pid}\n")

    def sub(self, name: str) -> str:
        path = os.path.join(self.dir, name)
        os.makedirs(path, exist_ok=True)
        return path


# --------------------------------------------------------------------------------------------- etcd


class Etcd:
    """A throw-away etcd on free loopback ports (the binary tpassrun's embedded etcd would use)."""

    def __init__(self, ctx: Ctx) -> None:
        from tpassrun.rendezvous.embedded import find_etcd_binary

        self.dir = tempfile.mkdtemp(prefix="gpucheck-etcd-", dir=ctx.dir)
        self.port, peer = _free_port(), _free_port()
        self.proc = subprocess.Popen(
            [find_etcd_binary(None), "--name", "g", "--data-dir", os.path.join(self.dir, "data"),
             "--listen-client-urls", f"http://127.0.0.1:{self.port}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.port}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
             f"http://127.0.0.1:{peer}", "--initial-cluster", f"g=http://127.0.0.1:{peer}",
             "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, "log"), "w"), start_new_session=True)
        ctx.started(self.proc.pid)
        until(lambda: self._healthy(), 20, "etcd to answer /health")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise Failed(f"etcd exited {self.proc.returncode}: {open(os.path.join(self.dir, 'log')).read()[-300:]}")
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as resp:
                return b"true" in resp.read()
        except OSError:
            return False

    def stop(self) -> None:
        kill_group(self.proc.pid)
        shutil.rmtree(self.dir, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(ready: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``ready()`` until it is truthy (returned) or ``timeout`` (<= STEP_S) passes (Failed)."""
    deadline = time.monotonic() + min(timeout, STEP_S)
    while True:
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Failed(f"waited {min(timeout, STEP_S):.0f}s for {what}")
        time.sleep(0.05)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --------------------------------------------------------------------------------------------- jobs


GPU_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",     # cuBLAS picks the same kernels in every run (bit-identical)
    "TPASSRUN_SHARE_GPUS": "1",               # fewer GPUs than slots: slots share them (tpassrun/launch/devices.py)
    "NCCL_DEBUG": "WARN",
    "PYTHONUNBUFFERED": "1",
}


def script_args(steps: int, sleep: float, out: str, extra: list[str]) -> list[str]:
    return [EXAMPLE, "--steps", str(steps), "--step-sleep", str(sleep), "--out", out, "--quiet", *extra]


def tpassrun_job(ctx: Ctx, out: str, etcd: Etcd, *, steps: int, sleep: float, args: list[str],
                 env: dict[str, str], nproc: int = 2, spares: int = 1, flags: list[str] | None = None) -> Job:
    run_id = f"gpucheck-{random.randrange(1 << 30):x}"
    argv = [ctx.python, "-m", "tpassrun", "--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint",
            etcd.endpoint, "--rdzv-id", run_id, "--nproc-per-node", str(nproc), "--spares-per-node", str(spares),
            "--log-dir", os.path.join(out, "logs"), *(flags or []), *script_args(steps, sleep, out, args)]
    job = Job(argv=argv, out=out, env={**GPU_ENV, **env})
    job.run_id = run_id            # type: ignore[attr-defined]
    return job


def torchrun_job(ctx: Ctx, out: str, *, steps: int, sleep: float, args: list[str], env: dict[str, str],
                 nproc: int = 2) -> Job:
    argv = [ctx.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            *script_args(steps, sleep, out, args)]
    return Job(argv=argv, out=out, env={**GPU_ENV, **env})


def start(ctx: Ctx, job: Job) -> Job:
    job.start()
    assert job.proc is not None
    ctx.started(job.proc.pid)
    ctx.say(f"started {' '.join(os.path.basename(a) for a in job.argv[:3])} ... (pid {job.proc.pid}, out {job.out})")
    return job


def finish(job: Job, timeout: float = STEP_S) -> None:
    """Wait for the job's end (at most ``timeout``); a non-zero exit is a failure naming its log's last error."""
    try:
        code = job.wait(min(timeout, STEP_S))
    except AssertionError:
        raise Failed(f"the job did not finish in {min(timeout, STEP_S):.0f}s: {last_error(job.log())}") from None
    finally:
        job.kill()
    if code != 0:
        raise Failed(f"the job exited {code}: {last_error(job.log())}")


def last_error(log: str) -> str:
    """The most telling line of a job's log: the last exception or error line, else its last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if any(k in line for k in ("Error", "error:", "Exception", "FAILED", "Traceback")) and "Traceback" not in line:
            return line[:300]
    return lines[-1][:300] if lines else "(empty log)"


def reference(ctx: Ctx, key: str, *, steps: int, sleep: float, args: list[str], env: dict[str, str]) -> Job:
    """The same script under plain torchrun on the same GPU(s), run once per harness run (the checks that
    compare against the same command line share it, under the harness's ``refs`` directory)."""
    out = os.path.join(os.path.dirname(ctx.dir), "refs", key)
    job = torchrun_job(ctx, out, steps=steps, sleep=sleep, args=args, env=env)
    if os.path.exists(os.path.join(out, "final_rank1.pt")) and os.path.exists(os.path.join(out, "ok")):
        ctx.say(f"torchrun reference {key}: reused")
        return job
    shutil.rmtree(out, ignore_errors=True)
    start(ctx, job)
    try:
        finish(job)
    except Failed as exc:
        raise Failed(f"the torchrun reference failed: {exc}") from None
    open(os.path.join(out, "ok"), "w").close()
    ctx.say(f"torchrun reference {key}: done")
    return job


def compare(job: Job, ref: Job, world: int) -> None:
    """Every rank's final model, optimizer (a torch one or ZeroAdamW's slice), scheduler and sampler
    ``torch.equal`` to torchrun's, and the same per-step losses (no step lost or repeated)."""
    for rank in range(world):
        mine, theirs = job.final(rank), ref.final(rank)
        for key in ("model", "optimizer", "scheduler", "sampler"):
            where = first_difference(mine[key], theirs[key], key)
            if where:
                raise Failed(f"not torch.equal to torchrun: rank {rank}: {where}")
        a, b = logged(job, rank), logged(ref, rank)
        if a != b:
            at = next((step for step in sorted(set(a) | set(b)) if a.get(step) != b.get(step)), None)
            raise Failed(f"rank {rank}: per-step losses differ from torchrun's at step {at} "
                         f"({a.get(at)} against {b.get(at)}; {len(a)} vs {len(b)} steps logged)")


def logged(job: Job, rank: int) -> dict[int, float]:
    """step -> loss of a rank's log. A step recomputed after a rollback to the shard mirror's copies is logged
    again (docs/concepts.md, the shard mirror): it must be logged with the same loss, and counts once."""
    out: dict[int, float] = {}
    for row in job.losses(rank):
        step, loss = row["step"], row["loss"]
        if step in out and out[step] != loss:
            raise Failed(f"rank {rank}: step {step} recomputed with another loss ({loss} after {out[step]})")
        out[step] = loss
    return out


def first_difference(a: Any, b: Any, path: str) -> str | None:
    """Where two state trees differ (tensors by ``torch.equal`` on the host), or None."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.detach().cpu(), b.detach().cpu()))
        return None if same else f"{path} differs"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path} has keys {sorted(map(str, a))} against {sorted(map(str, b))}"
        return next((d for k in a if (d := first_difference(a[k], b[k], f"{path}.{k}"))), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path} has {len(a)} entries against {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := first_difference(x, y, f"{path}[{i}]"))), None)
    return None if a == b else f"{path}: {a!r} against {b!r}"[:200]


def events(job: Job, name: str) -> list[dict[str, Any]]:
    return [e for e in job.events() if e["event"] == name]


def wait_event(job: Job, name: str, timeout: float = STEP_S, **kw: Any) -> list[dict[str, Any]]:
    try:
        return job.wait_event(name, timeout=min(timeout, STEP_S), **kw)
    except AssertionError as exc:
        raise Failed(f"no {name} event: {last_error(str(exc))}") from None


def no_restart(job: Job) -> None:
    """A live recovery, not torchrun's whole-group restart (said in the event log)."""
    for name in ("fallback", "restart"):
        found = events(job, name)
        if found:
            why = found[0].get("reason") or found[0].get("why") or json.dumps(found[0])[:200]
            raise Failed(f"fell back to a whole-group restart: {why}")


def pause_s(job: Job) -> str:
    resumed = events(job, "swap_resumed")
    return f"{resumed[-1]['seconds']:.2f} s" if resumed and "seconds" in resumed[-1] else "?"
