"""A rank whose join into a re-formed world takes too long says where it stands (tpassrun/worker/world.py): its agent
cannot reach it inside torch (a store that never answers, gloo waiting for a peer), and the swap's 120 s phase
timeout then gives up without knowing why. Past ``JOIN_STACKS_AFTER_S`` every thread's stack goes to the worker's
stderr (its log), and nothing is dumped for a join that ends in time."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from tpassrun.worker import world
    from tpassrun.channel.protocol import WorldSpec

    world.JOIN_STACKS_AFTER_S = float(sys.argv[1])
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spec = WorldSpec(rank=0, world_size=2).with_store("127.0.0.1", server.port, "/w/1/", 1)
    give_up = time.monotonic() + 1.5          # the other rank never arrives: the agent gives the join up
    try:
        world.join_world("gloo", spec, timedelta(seconds=30), lambda: time.monotonic() > give_up)
    except world.JoinAborted as exc:
        print("given up:", exc, flush=True)
""")


@pytest.mark.parametrize("after, dumped", [(0.5, True), (30.0, False)])
def test_a_join_that_takes_too_long_dumps_every_threads_stack_to_stderr(after, dumped):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(after)], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0 and "given up" in r.stdout, r.stdout + r.stderr
    assert ("Timeout (0:00:00" in r.stderr and "_join_world" in r.stderr) is dumped, r.stderr
