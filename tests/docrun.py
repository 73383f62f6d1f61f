"""What the documentation says, run as written: the pages' command blocks (:func:`command_blocks`,
:func:`run_page`), and a user's training script as it is written (an adapter docstring's example, extracted),
under torchrun or tpassrun, leaving behind what the tests and ``bench/frameworks.py`` compare.

Pages (README.md, docs/*.md): every fenced block names its language; a shell block (``sh``, ``bash``) is preceded
by a marker line, ``<!-- docrun: run -->`` (run as written, in order with the page's other run blocks, in one
bash of a scratch directory, as a reader following the page would) or ``<!-- docrun: skip: WHY -->`` (not run in
CI, and why: the test says it). Anything else (``text``: output, ``python``, ``toml`` ...) is not a command.

Training scripts:

    torchrun --nproc-per-node 2 tests/docrun.py SCRIPT [script args] --out DIR

The script is run unchanged (``runpy``, as ``__main__``, with its own arguments in ``sys.argv``). Around it:

* CPU preparations a GPU machine does not need, each one line: DeepSpeed's shared-memory all-reduce is not
  JIT-built (~50 s of g++, unused by training); torchtitan's mesh device is ``"cpu"`` (0.3.0 falls back to
  ``"cuda"``); megatron-core's GPU-only calls go to the CPU (``examples/megatron/cpu_shims.py``).
* ``Session.run`` is wrapped so that every step the script runs calls the test fault point ``step`` at its start
  (``TPASSRUN_FAULTS``: holds, kills) and, at its end, appends ``{"step", "pid", "t", "generation"}`` to
  ``DIR/loss_rank<R>.jsonl`` (no loss: the script's step function returns none), which is where tests find the
  process holding a rank and how far the job got.
* After the script returns, every object among its globals with a ``state_dict()`` (the model, the engine, the
  torch optimizer, the data position, ...) is saved to ``DIR/final_rank<R>.pt``, DTensors as their local shards.
  Then the process leaves without the interpreter's teardown (gloo's threads may abort it at exit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHELL_LANGS = ("sh", "bash", "shell", "console")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: str
    line: int            # 1-based line of its opening fence
    lang: str            # "" when the fence names none
    text: str
    mark: str            # "run", "skip: WHY", or "" (no marker)

    @property
    def where(self) -> str:
        return f"{os.path.relpath(self.page, REPO)}:{self.line}"


def command_blocks(page: str) -> list[Block]:
    """Every fenced block of ``page`` with its language and the docrun marker on the line before it (pure)."""
    with open(page) as fh:
        lines = fh.read().split("\n")
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        before = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        mark = re.match(r"^<!-- docrun: (run|skip: .+?) -->$", before)
        out.append(Block(page, i + 1, fence.group(2), "\n".join(lines[i + 1:j]), mark.group(1) if mark else ""))
        i = j + 1
    return out


def run_page(page: str, cwd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """The page's ``run`` blocks in order, in one ``bash -euo pipefail`` in ``cwd`` (a variable one block exports
    is the next one's, as in a reader's shell); whatever they left running in the background is killed at the end
    (the session's process group). Returns the finished process (stdout and stderr together)."""
    script = "\n".join(f"# --- {b.where}\n{b.text}" for b in command_blocks(page) if b.mark == "run")
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = ""
        proc.returncode = -1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)     # the background jobs a block started (a pool node, a job)
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def example(module_doc: str) -> str:
    """The first literal block (``::``) of a docstring, as the script a reader copies from it."""
    import textwrap

    start = module_doc.index("::\n") + 3
    block = []
    for line in module_doc[start:].split("\n"):
        if line.strip() and not line.startswith("    "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip() + "\n"


def write_example(module: str, path: str) -> str:
    """``module``'s docstring example written to ``path`` (returned)."""
    import importlib

    with open(path, "w") as fh:
        fh.write(example(importlib.import_module(module).__doc__ or ""))
    return path


def ds_config(path: str, stage: int) -> str:
    """What the DeepSpeed docstring's comment shows, at ZeRO ``stage`` (ZeRO-3: parameters of more than 100
    elements partitioned, the others persistent, so that both kinds are exercised)."""
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 3:
        zero["stage3_param_persistence_threshold"] = 100
    with open(path, "w") as fh:
        json.dump({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
                   "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                                     "warmup_num_steps": 5, "total_num_steps": 100}},
                   "zero_optimization": zero, "steps_per_print": 1_000_000}, fh)
    return path


def docrun_job(kind: str, out: str, script: str, nproc: int, args: list[str], *, endpoint: str = "",
               run_id: str = "", spares: int = 0, env: dict[str, str] | None = None) -> Any:
    """``tests/docrun.py SCRIPT`` under torchrun (``kind="torchrun"``) or tpassrun."""
    from faults import Job
    from realjobs import CPU_ENV

    if kind == "torchrun":
        launcher = ["-m", "torch.distributed.run", "--standalone"]
    else:
        launcher = ["-m", "tpassrun", "--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint,
                    "--rdzv-id", run_id, "--spares-per-node", str(spares), "--max-restarts", "0",
                    "--log-dir", os.path.join(out, "logs")]
    argv = [sys.executable, *launcher, "--nproc-per-node", str(nproc), os.path.abspath(__file__), script, *args,
            "--out", out]
    return Job(argv=argv, out=out, env={**CPU_ENV, **(env or {})})


def prepare_cpu(script_text: str) -> Any:
    """The CPU-only preparations this script's framework needs; returns a context manager to run it in."""
    import contextlib
    import importlib

    import torch

    if torch.cuda.is_available():
        return contextlib.nullcontext()
    if "deepspeed" in script_text:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if "torchtitan" in script_text:
        importlib.import_module("torchtitan.distributed.parallel_dims").device_type = "cpu"
    if "megatron" in script_text:
        sys.path.insert(0, os.path.join(REPO, "examples", "megatron"))
        import cpu_shims

        cpu_shims.install()
        return cpu_shims.cuda_factories_on_cpu()
    return contextlib.nullcontext()


def wrap_session_run(out: str) -> None:
    from tpassrun.worker.faultpoints import fault_point
    from tpassrun.worker.session import Session

    original = Session.run

    def run(self: Any, step_fn: Any, total_steps: int) -> int:
        log = open(os.path.join(out, f"loss_rank{self.rank}.jsonl"), "a", buffering=1)

        def step(i: int) -> Any:
            fault_point(self.rank, i, "step")
            result = step_fn(i)
            log.write(json.dumps({"step": i, "pid": os.getpid(), "t": time.time(),
                                  "generation": self.generation}) + "\n")
            return result

        return original(self, step, total_steps)

    Session.run = run  # type: ignore[method-assign]


def local(tree: Any) -> Any:
    """``tree`` with DTensors as their local shards and non-tensor objects (loss scalers, ...) as their names."""
    import torch

    if isinstance(tree, torch.Tensor):
        return (tree.to_local() if hasattr(tree, "to_local") else tree).detach().clone()
    if isinstance(tree, dict):
        return {k: local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [local(v) for v in tree]
    if tree is None or isinstance(tree, (int, float, str, bool)):
        return tree
    return type(tree).__name__


def final_state(namespace: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in namespace.items():
        if name.startswith("_") or isinstance(value, type) or not callable(getattr(value, "state_dict", None)):
            continue
        groups = getattr(value, "param_groups", None)
        if isinstance(groups, list) and groups and not any(g.get("params") for g in groups):
            continue    # a torch optimizer DeepSpeed ZeRO-3 took the parameters out of (the engine's entry has them)
        out[name] = local(value.state_dict())
        stage = getattr(value, "zero_optimization_stage", None)
        if callable(stage) and stage() >= 3:
            # ZeRO-3: the module's parameters are this rank's partitions; the ZeRO optimizer holds the fp32 master
            # partition and the moments (compared without DeepSpeed's alignment padding: uninitialized memory that
            # differs run to run under torchrun too)
            from tpassrun.adapters.deepspeed import zero3_partition

            out[name + ".zero3"] = zero3_partition(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script")
    parser.add_argument("--out", required=True)
    args, script_args = parser.parse_known_args()
    os.makedirs(args.out, exist_ok=True)
    with open(args.script) as fh:
        text = fh.read()
    context = prepare_cpu(text)
    wrap_session_run(args.out)
    sys.argv = [args.script, *script_args]
    with context:
        namespace = runpy.run_path(args.script, run_name="__main__")
    import torch
    import torch.distributed as dist

    sess = namespace.get("sess")    # the script's session: its rank is the one it ends with (a joiner's included)
    rank = sess.rank if sess is not None else int(os.environ.get("RANK", "0"))
    torch.save(final_state(namespace), os.path.join(args.out, f"final_rank{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()
    from multiprocessing import util

    util._run_finalizers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
