"""The adapters' documentation is what runs: each adapter docstring's example is extracted as the script a reader
copies and run on CPU (gloo, 2 ranks) by ``tests/docrun.py``, under plain torchrun (the reference) and under
tpassrun with spares: one rank is SIGKILLed from outside at a uniformly random instant of a random step, then
another rank is moved to a spare by a planned swap, and the job must end live (no restart) with every rank's
final state ``torch.equal`` to torchrun's and every step done. Each example README's diff is checked against the
example script the framework's real tests run (``tests/test_<framework>_real.py``): every line it adds is in
the script, every line it removes is not.

The DeepSpeed example is the script shaped as DeepSpeed users write it (a torch optimizer handed to
``deepspeed.initialize``, ``engine.backward``, ``engine.step`` per micro-batch, ZeRO and gradient accumulation
from the JSON config; ZeRO-1 or ZeRO-2, drawn per run); ``bench/frameworks.py --framework deepspeed`` runs it for
many random instants.
"""

from __future__ import annotations

import os
import random
import re
import time

import pytest
from docrun import docrun_job, ds_config, write_example
from faults import Job, faults_env, hold_at, pids_by_rank, sigkill_rank, taint
from realjobs import assert_same_training, example, swap_pause_s

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def _ds_args(work: str) -> list[str]:
    """ZeRO-1 or ZeRO-2, drawn per session (both are covered over runs at the cost of one; the config file's name
    says which in every failure message): gradient accumulation 2, clipping, WarmupDecayLR, as the docstring's
    comment shows."""
    stage = random.choice((1, 2))
    return ["--deepspeed_config", ds_config(os.path.join(work, f"ds_zero{stage}.json"), stage)]


# framework -> (module whose docstring holds the example, its steps, world size, args given a work dir)
EXAMPLES = {
    "deepspeed": ("tpassrun.adapters.deepspeed", 60, 2, _ds_args),
    "torchtitan": ("tpassrun.adapters.torchtitan", 40, 2, lambda d: []),
    "megatron": ("tpassrun.adapters.megatron", 30, 2, lambda d: []),
}


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """framework -> (script, args, torchrun reference), made on first use."""
    made: dict[str, tuple[str, list[str], Job]] = {}

    def get(framework: str) -> tuple[str, list[str], Job]:
        if framework not in made:
            module, steps, world, args_of = EXAMPLES[framework]
            pytest.importorskip(framework if framework != "megatron" else "megatron.core")
            work = str(tmp_path_factory.mktemp(f"doc-{framework}"))
            script = write_example(module, os.path.join(work, f"{framework}_example.py"))
            args = args_of(work)
            ref = docrun_job("torchrun", os.path.join(work, "ref"), script, world, args).start()
            try:
                assert ref.wait(400) == 0, ref.log()[-4000:]
            finally:
                ref.kill()
            made[framework] = (script, args, ref)
        return made[framework]
    return get


@pytest.mark.parametrize("framework", sorted(EXAMPLES))
def test_the_docstring_example_survives_a_random_sigkill_and_a_planned_swap(tmp_path, etcd_server, run_id, docs,
                                                                            framework):
    script, args, ref = docs(framework)
    _module, steps, world, _args = EXAMPLES[framework]
    rnd = random.Random()
    at = rnd.randint(2, steps // 2)
    per_step = _seconds_per_step(ref)
    late = hold_at(str(tmp_path), steps - 6)
    job = docrun_job("tpassrun", str(tmp_path / "job"), script, world, args, endpoint=etcd_server.endpoint,
                     run_id=run_id, spares=2, env=faults_env(late.fault)).start()
    try:
        job.wait_step(at - 1, 300, rank=1)
        time.sleep(rnd.uniform(0.0, per_step))        # a uniformly random instant of step `at` (as rank 1 runs it)
        assert sigkill_rank(job.out, 1) is not None
        job.wait_event("swap_resumed", 1, 300)
        tainted = time.time()
        assert taint(etcd_server.endpoint, run_id, rank=0, reason="test: planned after a SIGKILL") == 0
        job.wait_event("swap_boundary", 1, 300, match=lambda e: e["time"] >= tainted)
        late.release()
        assert job.wait(400) == 0, job.log()[-4000:]
    finally:
        late.release()
        job.kill()
    print(f"{framework} docstring example {' '.join(args)}: SIGKILL at step {at}, pause {swap_pause_s(job):.2f} s")
    events = job.events()
    assert len([e for e in events if e["event"] == "swap_resumed"]) == 2, job.log()[-4000:]
    assert not [e for e in events if e["event"] in ("fallback", "restart")], job.log()[-4000:]
    assert_same_training(job, ref, world, steps)
    pids = pids_by_rank(job, world)
    assert len(pids[0]) == 2 and len(pids[1]) == 2, pids       # each rank moved once, to a spare


def _seconds_per_step(ref: Job) -> float:
    rows = ref.losses(0)
    return (rows[-1]["t"] - rows[0]["t"]) / max(1, len(rows) - 1)


# ---------------------------------------------------------------------------------------------
# the example READMEs' diffs


def _diff_lines(readme: str) -> tuple[list[str], list[str]]:
    """The ``+`` and ``-`` lines of the README's ```diff block, without trailing comments."""
    with open(readme) as fh:
        text = fh.read()
    block = re.search(r"```diff\n(.*?)```", text, re.S)
    assert block, f"{readme} has no diff"
    added, removed = [], []
    for line in block.group(1).splitlines():
        code = _normal(line[1:])
        if line.startswith("+") and code:
            added.append(code)
        elif line.startswith("-") and code:
            removed.append(code)
    return added, removed


def _normal(code: str) -> str:
    return re.sub(r"\s+", " ", code.split("  #")[0].split(" # ")[0]).strip()


@pytest.mark.parametrize("framework,script", [("deepspeed", "train.py"), ("torchtitan", "train.py"),
                                              ("megatron", "train_gpt.py")])
def test_the_readme_diff_is_what_the_tested_example_runs(framework, script):
    """Every ``+`` line of the README's diff is in the script (``...`` stands for any text; a call may span
    lines), and every ``-`` line not added back is gone from it."""
    added, removed = _diff_lines(example(framework, "README.md"))
    with open(example(framework, script)) as fh:
        body = " ".join(_normal(line) for line in fh.read().splitlines())

    def found(code: str) -> bool:
        return re.search(".*?".join(re.escape(part) for part in code.split("...")), body) is not None

    missing = [a for a in added if not found(a)]
    assert not missing, f"examples/{framework}/README.md adds lines {script} does not have: {missing}"
    present = [r for r in removed if r not in added and found(r)]
    assert not present, f"examples/{framework}/README.md removes lines {script} still has: {present}"

