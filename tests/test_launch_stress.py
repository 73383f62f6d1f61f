"""Acceptance (issue 14): sequential launches of a tiny job all finish.

A plain ``--nproc-per-node=N`` job once hung in ~1 launch out of 10 after its workers had all exited: a
generation task whose cancel Python 3.11's ``asyncio.wait_for`` had swallowed (inside aetcd's ``watch()``)
kept re-opening its etcd watch, and the agent waited for it forever. See
``rendezvous.etcd_link.raise_if_cancelling``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from tpassrun.rendezvous.etcd_link import raise_if_cancelling

LAUNCHES = 50   # the hang it guards against (2ec8367) showed in ~2 of 30 launches under load; bench-sized: raise it
PER_LAUNCH_TIMEOUT = 90.0  # a hang detector, not a speed target (a launch takes ~1 s on an idle machine)


def test_a_swallowed_cancel_is_raised_again():
    """What ``wait_for`` does in 3.11 when the inner future completes as the cancel arrives: return normally.
    The loop's check turns the still-pending cancel request back into CancelledError."""
    rounds = []

    async def loop_like_a_watch(started: asyncio.Event) -> None:
        while True:
            rounds.append(1)
            started.set()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass  # swallowed, as wait_for does
            raise_if_cancelling()

    async def main() -> None:
        started = asyncio.Event()
        task = asyncio.ensure_future(loop_like_a_watch(started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert len(rounds) == 1


@pytest.mark.e2e
@pytest.mark.acceptance   # ~65 s of CI's budget: the mechanism is checked in CI, in one process, just above
@pytest.mark.timeout(LAUNCHES * 30)
def test_sequential_tiny_launches_all_finish(tmp_path):
    script = tmp_path / "tiny.py"
    # one write per line: two workers' print() calls under -u can interleave mid-line
    script.write_text("import os\nos.write(1, f\"tiny {os.environ['RANK']}\\n\".encode())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TPASSRUN_"))}
    env["TMPDIR"] = str(tmp_path)  # the default torchelastic_* log dirs land here and go with tmp_path
    finished, failures = 0, []
    for i in range(LAUNCHES):
        cmd = [sys.executable, "-m", "tpassrun", "--nproc-per-node=2", str(script)]
        proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=PER_LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            failures.append((i, "hung", out[-2000:]))
            continue
        if proc.returncode == 0 and {"tiny 0", "tiny 1"} <= set(out.splitlines()):
            finished += 1
        else:
            failures.append((i, proc.returncode, out[-2000:]))
    print(f"{finished} of {LAUNCHES} launches finished")
    assert finished == LAUNCHES, [(i, rc) for i, rc, _ in failures] + failures[:1]
