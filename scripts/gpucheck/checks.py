"""The checks of ``scripts/gpu_check.sh``, one function each: ``check(ctx) -> (result, figure)``.

Each runs in a process of its own (``harness.py``); it raises :class:`support.Skip` when it cannot run here
(``skipped: no GPU``), :class:`support.Failed` (or anything else) when it found a problem: the message is the
table's "where it failed". Jobs are ``examples/train_ddp.py`` with ``--device cuda``, compared
``torch.equal`` with the same command line under plain torchrun on the same GPU(s).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time

from support import (
    EXAMPLE,
    GPU_ENV,
    STEP_S,
    Ctx,
    Etcd,
    Failed,
    Skip,
    compare,
    events,
    faults_env,
    finish,
    first_difference,
    kill_at,
    logged,
    no_restart,
    pause_s,
    reference,
    sigkill_rank,
    start,
    taint,
    tpassrun_job,
    until,
    wait_event,
)

# isort: split
from faults import Job, hold_at  # tests/ is on the path through support

STEPS, SLEEP = 40, 0.05


def visible(ctx: Ctx, k: int) -> str:
    """The first ``k`` GPUs this machine shows the check, as a CUDA_VISIBLE_DEVICES value."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in given.split(",")] if given else [str(i) for i in range(ctx.gpus)]
    return ",".join(entries[:k])


# --------------------------------------------------------------------------------------------- environment


def environment(ctx: Ctx) -> tuple[str, str]:
    """What the machine offers: torch's build, CUDA, the GPUs, the driver. Writes facts.json for the harness."""
    facts: dict = {"gpus": 0}
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    facts["nvidia_smi"] = smi
    smi_first = smi.splitlines()[0] if smi else "no nvidia-smi"
    if ctx.dry_run:                     # what is installed, without paying for importing torch
        from importlib.metadata import version

        return "ok", f"dry run: torch {version('torch')} installed, {smi_first}"
    import torch

    facts.update(torch=torch.__version__, cuda_build=torch.version.cuda)
    problem = None
    if torch.version.cuda is None:
        problem = (f"torch {torch.__version__} is the CPU wheel: install the CUDA one "
                   f"(pip install torch==2.13.0 from PyPI, or --index-url https://download.pytorch.org/whl/cu128)")
    elif not torch.cuda.is_available():
        try:
            torch.cuda.init()
            problem = "torch.cuda.is_available() is False"
        except Exception as exc:  # noqa: BLE001 - its message is the reason (no driver, driver too old)
            problem = f"torch.cuda.is_available() is False: {str(exc).splitlines()[0]}"
    else:
        facts["gpus"] = torch.cuda.device_count()
        facts["names"] = [torch.cuda.get_device_name(i) for i in range(facts["gpus"])]
        try:
            version = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as exc:  # noqa: BLE001 - said in the figure, the NCCL row finds out more
            facts["nccl"] = f"unknown ({type(exc).__name__})"
    with open(os.path.join(os.path.dirname(ctx.dir), "facts.json"), "w") as fh:
        json.dump(facts, fh)
    if problem:
        raise Failed(f"{problem} ({smi_first})")
    return "ok", (f"torch {facts['torch']} (CUDA {facts['cuda_build']}, NCCL {facts['nccl']}), "
                  f"{facts['gpus']} x {facts['names'][0]}; driver: {smi_first}")


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


# --------------------------------------------------------------------------------------------- NVML


def nvml(ctx: Ctx) -> tuple[str, str]:
    """Every sensor the health monitor reads, for real; a verdict per GPU; the monitor's loop for 20 s."""
    if ctx.dry_run:
        raise Skip("no GPU")
    import asyncio

    from tpassrun.health import HealthMonitor, NvmlSensor, Policy, PolicyEngine, SensorUnavailable

    sensor = NvmlSensor()
    try:
        readings = sensor.read()
    except SensorUnavailable as exc:
        raise Failed(f"NVML unavailable: {exc}") from None
    finally:
        sensor.close()
    engine = PolicyEngine(Policy.default())
    verdicts = {v.device: v for v in engine.observe(readings, time.monotonic())}
    per_gpu: dict[str, list[str]] = {}
    broken, missing = [], []
    for r in readings:
        if r.error is None:
            per_gpu.setdefault(r.device, []).append(f"{r.metric}={r.value:g}")
        elif "Not Supported" in r.error or "NOT_SUPPORTED" in r.error:
            missing.append(f"{r.device}.{r.metric}")
        else:
            broken.append(f"{r.device}.{r.metric}: {r.error}")
    for device, values in sorted(per_gpu.items()):
        verdict = verdicts.get(device)
        ctx.say(f"{device}: {verdict.status.value if verdict else '?'}: {', '.join(values)}")
    ctx.say(f"not supported on this GPU: {', '.join(missing) or 'none'}")
    polls: list[int] = []

    async def loop() -> None:
        async def delivered(_v: list) -> None:
            return None
        monitor = HealthMonitor([NvmlSensor()], PolicyEngine(Policy.default()), interval=1.0,
                                on_verdicts=delivered, log=ctx.say)
        task = asyncio.create_task(monitor.run())
        await asyncio.sleep(20)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        polls.append(monitor.polls)
        if monitor.unavailable or monitor._sensor_failures:
            raise Failed(f"monitor: {monitor.unavailable or monitor._sensor_failures}")

    asyncio.run(loop())
    if broken:
        raise Failed(f"{len(broken)} reading(s) failed, first: {broken[0]}")
    status = ", ".join(f"{d} {v.status.value}" for d, v in sorted(verdicts.items()) if d.startswith("gpu"))
    return "ok", (f"{len(per_gpu)} GPU(s): {status}; {sum(len(v) for v in per_gpu.values())} readings, "
                  f"{len(missing)} not supported; monitor 20 s: {polls[0]} polls, no error")


# --------------------------------------------------------------------------------------------- layout


def layout(ctx: Ctx) -> tuple[str, str]:
    """``--nproc-per-node 2 --spares-per-node 1`` on one GPU: refused as before, taken with TPASSRUN_SHARE_GPUS=1,
    and what each slot would see. Needs no GPU (the launcher is told CUDA_VISIBLE_DEVICES=<one GPU>)."""
    from tpassrun.launch.devices import check_layout, node_devices, slot_env

    one = visible(ctx, 1) or "0"
    env = {k: v for k, v in os.environ.items() if k != "TPASSRUN_SHARE_GPUS"}
    argv = [ctx.python, "-m", "tpassrun", "--standalone", "--nproc-per-node", "2", "--spares-per-node", "1",
            os.path.join(ctx.dir, "never_started.py")]
    refused = subprocess.run(argv, env={**env, "CUDA_VISIBLE_DEVICES": one}, capture_output=True, text=True,
                             timeout=STEP_S)
    if refused.returncode != 1 or "needs 3 GPUs" not in refused.stderr or refused.stderr.count("\n") != 1:
        raise Failed(f"without the opt-in: exit {refused.returncode}, {refused.stderr.strip()[:200]!r}")
    devices = node_devices({"CUDA_VISIBLE_DEVICES": one, "TPASSRUN_SHARE_GPUS": "1"}, lambda: 1, slots=3)
    if check_layout(2, 1, devices) is not None:
        raise Failed(f"with TPASSRUN_SHARE_GPUS=1 still refused: {check_layout(2, 1, devices)}")
    seen = [slot_env(s, s, devices, spare=s == 2, virtual_local_rank=False) for s in range(3)]
    if any(e != {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": one} for e in seen):
        raise Failed(f"slots on a shared GPU see {seen}")
    return "ok", (f"refused without TPASSRUN_SHARE_GPUS=1 (exit 1, one line); with it 3 slots on GPU {one}, "
                  f"each CUDA_VISIBLE_DEVICES={one} LOCAL_RANK=0")


# --------------------------------------------------------------------------------------------- swaps on one GPU


def _held_job(ctx: Ctx, name: str, args: list[str], *, at: int, extra_faults: tuple = (), env: dict | None = None,
              gpus: str | None = None, flags: list[str] | None = None):
    """A 2-rank + 1-spare tpassrun job on the GPU(s), which rank 0 holds at step ``at`` (started, not waited for)."""
    out = ctx.sub(name)
    hold = hold_at(out, at)
    etcd = Etcd(ctx)
    job = tpassrun_job(ctx, os.path.join(out, "job"), etcd, steps=STEPS, sleep=SLEEP, args=args, flags=flags,
                       env={"CUDA_VISIBLE_DEVICES": gpus or visible(ctx, 1), **(env or {}),
                            **faults_env(hold.fault, *extra_faults)})
    try:
        start(ctx, job)
    except BaseException:
        etcd.stop()
        raise
    return job, hold, etcd


def _held_run(ctx: Ctx, name: str, args: list[str], act, *, at: int, **kw):
    """:func:`_held_job`, then ``act(job, hold, etcd)`` (the fault), then the job's end: a live recovery, not a
    whole-group restart. The job, its hold and its etcd are gone whatever happens."""
    job, hold, etcd = _held_job(ctx, name, args, at=at, **kw)
    try:
        until(lambda: hold.reached() or job.assert_running("the hold"), STEP_S, f"the job to reach step {at}")
        wait_event(job, "spare_ready")
        ctx.say(f"held at step {at}, spare ready")
        act(job, hold, etcd)
        finish(job)
    finally:
        hold.release()
        job.kill()
        etcd.stop()
    no_restart(job)
    return job


def _planned(ctx: Ctx, name: str, args: list[str], at: int, env: dict | None = None):
    """A held job whose rank 1 is tainted (tpassctl taint); the hold is released once the boundary is fixed."""
    def act(job, hold, etcd) -> None:
        if taint(etcd.endpoint, job.run_id, rank=1, reason="gpu check") != 0:
            raise Failed("tpassctl taint --rank 1 failed")
        hold.release_after(job, "swap_boundary", timeout=STEP_S)
    return _held_run(ctx, name, args, act, at=at, env=env)


def swap_planned(ctx: Ctx) -> tuple[str, str]:
    """A planned swap (tpassctl taint of rank 1) of a 2-rank DDP job on cuda (gloo, CUDA tensors), dropout on GPU."""
    ctx.need_gpus(1)
    args = ["--device", ctx.device]
    ref = reference(ctx, "ddp-gloo", steps=STEPS, sleep=SLEEP, args=args, env={"CUDA_VISIBLE_DEVICES": visible(ctx, 1)})
    at = random.randint(5, 15)
    job = _planned(ctx, "planned", args, at)
    compare(job, ref, 2)
    return "ok", f"taint at step {at}: swapped live, pause {pause_s(job)}, torch.equal to torchrun (CUDA RNG carried)"


def swap_sigkill(ctx: Ctx) -> tuple[str, str]:
    """SIGKILL of rank 1 from outside at a random instant; the spare takes over from rank 0's replica."""
    ctx.need_gpus(1)
    args = ["--device", ctx.device]
    ref = reference(ctx, "ddp-gloo", steps=STEPS, sleep=SLEEP, args=args, env={"CUDA_VISIBLE_DEVICES": visible(ctx, 1)})
    job = _killed(ctx, "sigkill", args, victim=1)
    compare(job, ref, 2)
    return "ok", f"recovered live, pause {pause_s(job)}, torch.equal to torchrun (CUDA RNG from the light snapshot)"


def _killed(ctx: Ctx, name: str, args: list[str], *, victim: int, gpus: str | None = None):
    """A held job released once its spare is ready; ``victim`` SIGKILLed from outside at a random instant."""
    def act(job, hold, _etcd) -> None:
        hold.release()
        time.sleep(random.uniform(0.0, 0.4))
        killed = sigkill_rank(job.out, victim)
        if killed is None:
            raise Failed(f"rank {victim}'s process was not found to kill")
        ctx.say(f"SIGKILLed rank {victim} (pid {killed[0]})")
    return _held_run(ctx, name, args, act, at=6, gpus=gpus)


def swap_compile(ctx: Ctx) -> tuple[str, str]:
    """A planned swap whose joiner runs torch.compile (inductor on the GPU) before its first step."""
    ctx.need_gpus(1, cuda=True)
    args = ["--device", ctx.device, "--compile"]
    env = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(os.path.dirname(ctx.dir), "inductor")}
    ref = reference(ctx, "compile", steps=STEPS, sleep=SLEEP, args=args,
                    env={"CUDA_VISIBLE_DEVICES": visible(ctx, 1), **env})
    job = _planned(ctx, "compile", args, 8, env)
    compare(job, ref, 2)
    return "ok", f"compiled joiner: pause {pause_s(job)}, torch.equal to torchrun --compile"


# --------------------------------------------------------------------------------------------- sharded mirror


def shard_mirror(ctx: Ctx) -> tuple[str, str]:
    """CudaCopier for real (its copies equal the live state; its cost per step), then a ZeRO-1 job (--zero)
    whose rank 1 is SIGKILLed in its backward pass: recovered from the buddy's mirror, torch.equal."""
    ctx.need_gpus(1)
    cost = _copier_cost(ctx) if not ctx.rehearse else "no copier on CPU"
    args = ["--device", ctx.device, "--zero"]
    ref = reference(ctx, "zero-gloo", steps=STEPS, sleep=SLEEP, args=args, env={"CUDA_VISIBLE_DEVICES": visible(ctx, 1)})
    kill_step = random.randint(9, 14)
    marker = os.path.join(ctx.sub("zero"), "killed")
    job = _held_run(ctx, "zero", args, lambda _job, hold, _etcd: hold.release(), at=6,
                    extra_faults=(kill_at(1, kill_step, marker),), flags=["--shard-mirror-interval", "1"])
    if not os.path.exists(marker):
        raise Failed(f"the fault at step {kill_step} did not fire")
    if not events(job, "shard_mirror"):
        raise Failed("no shard_mirror event: the sharded state was not mirrored")
    compare(job, ref, 2)
    return "ok", f"{cost}; kill at step {kill_step}: recovered from the mirror, pause {pause_s(job)}, torch.equal"


def _copier_cost(ctx: Ctx) -> str:
    """Steps of a ~60 MB model + AdamW on the GPU with and without a ShardRing snapshot at the step start
    (CudaCopier: side stream into pinned memory, fenced before the optimizer step); some copies compared with
    the live state captured synchronously at the same instant."""
    import torch

    from tpassrun.transfer import handoff
    from tpassrun.worker.shard_copy import CudaCopier
    from tpassrun.worker.shards import ShardRing

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(5)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 1024, device="cuda")
    ring = ShardRing(CudaCopier())
    with_copy, without = [], []
    for i in range(1, 41):
        snapshot = i % 2 == 0
        truth = {k: v.detach().clone() for k, v in model.state_dict().items()} if i % 10 == 0 else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        version = ring.begin(i, {"optimizer": opt}, {"model": model}, owner=0, light=None) if snapshot else None
        model(x).square().mean().backward()
        if snapshot:
            ring.fence()
        opt.step()                  # changes the live state: the copy must have read it before
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        (with_copy if snapshot else without).append(time.perf_counter() - t0)
        if truth is not None and version is not None:
            version.job.wait()
            copied = handoff.decode_tree(version.local.meta["objects"]["model"], version.local.tensors)
            for k, v in truth.items():
                if not torch.equal(copied[k], v.cpu()):
                    raise Failed(f"CudaCopier's copy of {k} at step {i} differs from the live state it snapshot")
            if not all(t.is_pinned() for t in version.local.tensors):
                raise Failed("CudaCopier's host buffers of GPU tensors are not pinned")
    mb = (sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3) / 2**20
    a, b = statistics.median(with_copy) * 1e3, statistics.median(without) * 1e3
    ctx.say(f"copier: {mb:.0f} MB per snapshot, step {a:.2f} ms with a snapshot, {b:.2f} ms without")
    return f"CudaCopier {mb:.0f} MB/snapshot: step {a:.2f} ms vs {b:.2f} ms without (+{a - b:.2f} ms), copies exact"


# --------------------------------------------------------------------------------------------- Megatron DistOpt


MEGATRON = os.path.join(os.path.dirname(EXAMPLE), "megatron", "train_gpt.py")
MEGATRON_ARGS = ["--tp", "1", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "256",
                 "--micro-batch", "2", "--num-microbatches", "2", "--dropout", "0.0", "--use-distributed-optimizer"]


def megatron_distopt(ctx: Ctx) -> tuple[str, str]:
    """examples/megatron/train_gpt.py on real megatron-core (no CPU shim: bf16, Megatron's DistributedOptimizer,
    gradient clipping 1.0, NCCL), DP=2 + a spare, a rank SIGKILLed from outside at a random instant: its optimizer
    shard recovered live from the buddy's mirror, every rank's final state torch.equal to torchrun's. On 2 GPUs
    the spare shares rank 0's GPU, so rank 0 is the one killed."""
    ctx.need_gpus(2)
    try:
        from importlib.metadata import version

        found = version("megatron-core")
    except Exception:  # noqa: BLE001 - not installed: the reason is the row's
        raise Skip("megatron-core not installed (pip install megatron-core==0.16.1)") from None
    gpus = visible(ctx, min(3, ctx.gpus))
    env = {"CUDA_VISIBLE_DEVICES": gpus}
    ref_out = os.path.join(os.path.dirname(ctx.dir), "refs", "megatron-distopt")
    ref = Job(argv=[ctx.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", MEGATRON,
                    *MEGATRON_ARGS, "--steps", str(STEPS), "--out", ref_out], out=ref_out,
              env={**GPU_ENV, "CUDA_VISIBLE_DEVICES": visible(ctx, 2)})
    start(ctx, ref)
    finish(ref)
    out = ctx.sub("distopt")
    hold = hold_at(out, 6)
    etcd = Etcd(ctx)
    run_id = f"gpucheck-{random.randrange(1 << 30):x}"
    job = Job(argv=[ctx.python, "-m", "tpassrun", "--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                    etcd.endpoint, "--rdzv-id", run_id, "--nproc-per-node", "2", "--spares-per-node", "1",
                    "--log-dir", os.path.join(out, "logs"), MEGATRON, *MEGATRON_ARGS, "--steps", str(STEPS),
                    "--step-sleep", str(SLEEP), "--out", out], out=out,
              env={**GPU_ENV, **env, **faults_env(hold.fault)})
    victim = 0 if ctx.gpus == 2 else 1
    try:
        start(ctx, job)
        until(lambda: hold.reached() or job.assert_running("the hold"), STEP_S, "the job to reach step 6")
        wait_event(job, "spare_ready")
        hold.release()
        time.sleep(random.uniform(0.0, 0.5))
        killed = sigkill_rank(job.out, victim)
        if killed is None:
            raise Failed(f"rank {victim}'s process was not found to kill")
        ctx.say(f"SIGKILLed rank {victim} (pid {killed[0]})")
        finish(job)
    finally:
        hold.release()
        job.kill()
        etcd.stop()
    no_restart(job)
    if not events(job, "shard_mirror"):
        raise Failed("no shard_mirror event: the DistributedOptimizer's shard was not mirrored")
    for rank in range(2):
        where = first_difference(job.final(rank), ref.final(rank), f"rank {rank}")
        if where:
            raise Failed(f"not torch.equal to torchrun: {where}")
        a, b = logged(job, rank), logged(ref, rank)
        bad = sorted(s for s in a if a[s] != b.get(s))
        missing = sorted(set(b) - set(a))    # (the victim may die after its step's collectives, before its log)
        if bad or (missing and rank != victim):
            raise Failed(f"rank {rank}: per-step losses differ from torchrun's at {bad[:3]}, missing {missing[:3]}")
    return "ok", (f"megatron-core {found}, bf16 + DistOpt + clip 1.0 on NCCL: SIGKILL of rank {victim} recovered "
                  f"live from the mirror, pause {pause_s(job)}, torch.equal to torchrun")


# --------------------------------------------------------------------------------------------- NCCL


def nccl(ctx: Ctx) -> tuple[str, str]:
    """The DDP job on NCCL across 2 GPUs (+ a spare), a SIGKILL recovered live: the communicator aborted, the
    world re-created with the spare. On 2 GPUs the spare shares rank 0's GPU, so rank 0 is the one killed."""
    ctx.need_gpus(2)
    args = ["--device", ctx.device, "--backend", "nccl"]
    ref = reference(ctx, "ddp-nccl", steps=STEPS, sleep=SLEEP, args=args, env={"CUDA_VISIBLE_DEVICES": visible(ctx, 2)})
    victim = 0 if ctx.gpus == 2 else 1
    job = _killed(ctx, "nccl", args, victim=victim, gpus=visible(ctx, min(3, ctx.gpus)))
    compare(job, ref, 2)
    return "ok", f"SIGKILL of rank {victim} recovered live on NCCL, pause {pause_s(job)}, torch.equal"


# --------------------------------------------------------------------------------------------- transfer


def transfer(ctx: Ctx) -> tuple[str, str]:
    """1 GiB of state on a GPU to another process's GPU through the handoff (authenticated, checksummed; D2H,
    TCP, H2D), against torch's device copy and raw loopback TCP of the same bytes."""
    ctx.need_gpus(1)
    from transfer_gpu import measure

    figures = measure(ctx, 1 << 30 if not ctx.rehearse else 64 << 20)
    return "ok", (f"handoff {figures['handoff']:.2f} GB/s GPU->GPU, torch device copy {figures['device']:.1f} GB/s, "
                  f"raw TCP {figures['tcp']:.2f} GB/s ({figures['where']})")


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def stream(ctx: Ctx) -> tuple[str, str]:
    """``bench/transfer.py --auth-only --pin auto`` (issue 42): raw loopback TCP, the authenticated stream (GMAC
    frames) and the encrypted one (AES-256-GCM), each end on half the machine's cores, so the 0.9-of-raw goal is
    measured where the cores allow it (a 2-core host shares them between both ends and their MAC threads). Figures
    only: the row passes when the bench ran; the figure says whether the goal was met."""
    if ctx.dry_run:
        raise Skip("dry run (the bench measures this machine's cores)")
    cores = len(os.sched_getaffinity(0))
    if cores < 4:
        raise Skip(f"needs >= 4 cores to pin each end to its own (this machine: {cores})")
    ctx.say(f"bench/transfer.py --auth-only --pin auto on {cores} cores")
    run = subprocess.run([ctx.python, os.path.join(REPO, "bench", "transfer.py"), "--auth-only", "--pin", "auto",
                          "--mb", "300", "--rounds", "3"], capture_output=True, text=True, timeout=STEP_S, cwd=REPO)
    print(run.stdout[-4000:], run.stderr[-2000:], flush=True)
    if run.returncode != 0:
        raise Failed(f"bench/transfer.py exited {run.returncode}: {(run.stderr.strip() or run.stdout.strip())[-300:]}")
    out = json.loads(run.stdout.strip().splitlines()[-1])
    raw, auth, enc = out["raw"], out["gmac-aes-256"], out["encrypted"]
    med = statistics.median
    return "ok", (f"{len(out['pinned']['sender'])}+{len(out['pinned']['receivers'])} cores: raw {med(raw['gbps']):.2f} "
                  f"GB/s; GMAC {med(auth['gbps']):.2f} ({auth['ratio_median']:.2f} of raw: goal 0.9 "
                  f"{'met' if auth['ratio_median'] >= 0.9 else 'not met'}); AES-GCM {med(enc['gbps']):.2f} "
                  f"({enc['ratio_median']:.2f}); cpu-s/GB {raw['cpu_s_per_gb_median']:.2f}/"
                  f"{auth['cpu_s_per_gb_median']:.2f}/{enc['cpu_s_per_gb_median']:.2f}; load {out['load'][0]:.1f}")


# --------------------------------------------------------------------------------------------- transparent mode

_HOLDER = """
import sys, time, torch
x = torch.randn(64 << 20, device="cuda", generator=torch.Generator("cuda").manual_seed(7))
want = x.double().sum().item()
print("ready", flush=True)
sys.stdin.readline()                      # the check suspends and resumes this process's CUDA state meanwhile
print("equal" if x.double().sum().item() == want and torch.cuda.is_available() else "differs", flush=True)
"""


def cuda_checkpoint(ctx: Ctx) -> tuple[str, str]:
    """The transparent mode's GPU half (docs/transparent.md#gpus): NVIDIA's cuda-checkpoint suspends a process
    holding 256 MB on the GPU (device memory to host, the device released) and resumes it; the tensor is unchanged."""
    ctx.need_gpus(1, cuda=True)
    import shutil

    tool = shutil.which("cuda-checkpoint")
    if tool is None:
        raise Skip("cuda-checkpoint not on PATH (NVIDIA driver >= 570 ships it)")
    proc = subprocess.Popen([ctx.python, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": visible(ctx, 1)})
    try:
        assert proc.stdout is not None and proc.stdin is not None
        if proc.stdout.readline().strip() != "ready":
            raise Failed("the holder did not start")
        times = []
        for want in ("checkpointed", "running"):
            t0 = time.monotonic()
            subprocess.run([tool, "--toggle", "--pid", str(proc.pid)], check=True, capture_output=True, timeout=60)
            times.append(time.monotonic() - t0)
            state = _run([tool, "--get-state", "--pid", str(proc.pid)])
            if want not in state:
                raise Failed(f"after a toggle the state is {state!r}, not {want}")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        said = proc.stdout.readline().strip()
        if said != "equal":
            raise Failed(f"the tensor after a suspend and resume: {said or 'the holder died'}")
    finally:
        proc.kill()
        proc.wait(10)
    return "ok", f"256 MB suspended in {times[0]:.2f} s, resumed in {times[1]:.2f} s, unchanged"


CHECKS = {
    # name: (function, hard timeout in seconds, runs alongside the others)
    "environment": (environment, 60, False),
    "nvml": (nvml, 50, True),
    "layout": (layout, 60, False),
    "swap: planned": (swap_planned, 150, False),
    "swap: SIGKILL": (swap_sigkill, 100, False),
    "shard mirror": (shard_mirror, 150, False),
    "nccl (2 GPUs)": (nccl, 130, False),
    "megatron DistOpt (2 GPUs)": (megatron_distopt, 200, False),
    "transfer 1 GiB": (transfer, 90, False),
    "transparent: cuda-checkpoint": (cuda_checkpoint, 90, False),
    "stream: auth-only, pinned": (stream, 120, False),  # issue 42: raw / GMAC / AES-GCM, each end on its own cores
    "swap: compile joiner": (swap_compile, 170, False),     # last: inductor's first compile is the slowest
}

if __name__ == "__main__":  # pragma: no cover
    sys.exit("run scripts/gpu_check.sh")
