"""What a healthy rank pays per step for tpassrun: the boundary check and the light snapshot, in microseconds.

    python bench/step_overhead.py [--steps 20000] [--repeats 5]

Measured in one process, against the real code: a :class:`tpassrun.channel.ChannelFile` in a temp file (as the
agent creates it), a real :class:`tpassrun.worker.Session` linked to it over a unix socket that a thread
drains (standing in for the agent), tracking a model (replicated: not in the light snapshot) and a sampler
(per rank: in it). Prints:

  * the boundary check alone (one ``run_until`` read from the mmap);
  * the per-step channel bookkeeping of ``Session.run`` (step, heartbeat, phase, last step time, the check);
  * the per-step light snapshot (``Session._txn.snapshot_light``: :class:`tpassrun.transfer.light.LightSnapshotter` and the
    double-buffered write), with its parts, and the general handoff codec it replaced, for comparison;
  * ``Session.run`` with a no-op step, managed vs. not launched by tpassrun: the whole per-step overhead;
  * ``Session.run`` with a tiny training step (forward, backward, SGD step on a tracked 16x16 linear model,
    one sampler advance), managed vs. not: what a real step pays, the seal in the backward pass, the commit
    point and the window bookkeeping included.
  * the no-op and the training step again with every light snapshot also pushed by the worker into a buddy's mirror (a real
    :class:`tpassrun.mirror.MirrorServer` in another process, over loopback TCP: ``tpassrun/worker/light_mirror.py``),
    and the push alone (``PushStream.push``: frame, HMAC, one non-blocking ``sendmsg``).

Best and median of ``--repeats`` rounds (each round measures every item once, in turn). Figures only, no assertions. The last line is JSON.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import torch
from common import print_json

from tpassrun.channel import ChannelFile, Field
from tpassrun.transfer import handoff
from tpassrun.transfer.light import LightSnapshotter
from tpassrun.worker import Session, _AgentLink

CLOCK = [time.perf_counter]   # --clock cpu: this process's CPU time (steadier than wall time on a loaded host)
SLOT = 1  # not slot 0, so that an offset bug would show up as a wrong field rather than pass unnoticed


class Sampler:
    """A per-rank data position, like the example's ShuffledSampler."""

    def __init__(self) -> None:
        self.epoch, self.pos, self.seed = 0, 0, 1234

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos, self.seed = state["epoch"], state["pos"], state["seed"]


class DrainingAgent:
    """The agent's end of the unix socket, reduced to reading whatever the worker sends."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.thread = threading.Thread(target=self._drain, daemon=True)

    def _drain(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            while conn.recv(65536):
                pass

    def __enter__(self) -> "DrainingAgent":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.listener.close()
        self.thread.join(timeout=5)


def batch_us(fn: Callable[[], Any], calls: int) -> float:
    """Microseconds per call over one batch of ``calls``."""
    started = CLOCK[0]()
    for _ in range(calls):
        fn()
    return (CLOCK[0]() - started) / calls * 1e6


def loop_batch_us(sess: Session, steps: int) -> float:
    """Per-step microseconds of ``Session.run`` with a step that does nothing."""
    sess.step = 0
    started = CLOCK[0]()
    sess.run(lambda _step: None, steps)
    return (CLOCK[0]() - started) / steps * 1e6


def train_job(sess: Session) -> tuple[Callable[[int], None], Session]:
    """A tiny tracked training step: forward, backward, SGD step, a sampler advance."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sampler = Sampler()
    sess.track(model=model, optimizer=opt, sampler=sampler)
    x = torch.randn(4, 16)

    def step(_i: int) -> None:
        sampler.pos += 1
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()

    return step, sess


def train_batch_us(job: tuple[Callable[[int], None], Session], steps: int) -> float:
    """Per-step microseconds of ``Session.run`` with the training step, going on from where the last batch
    stopped (restarting at step 0 would look like user code changing per-rank state between steps)."""
    step, sess = job
    started = CLOCK[0]()
    sess.run(step, sess.step + steps)
    return (CLOCK[0]() - started) / steps * 1e6


def interleaved(items: dict[str, Callable[[], float]], repeats: int) -> dict[str, tuple[float, float]]:
    """(best, median) of each item over ``repeats`` rounds; every round runs every item once, so that
    a burst of load on a shared host lands on all items rather than on whichever ran at that moment."""
    for measure in items.values():
        measure()  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in items}
    for _ in range(repeats):
        for name, measure in items.items():
            samples[name].append(measure())
    return {name: (min(v), statistics.median(v)) for name, v in samples.items()}


BUDDY = """
import asyncio, sys
from tpassrun.mirror import MirrorServer, MirrorStore

async def main():
    server = MirrorServer(MirrorStore(1 << 28), bytes.fromhex(sys.argv[1]), host="127.0.0.1", run_id="bench")
    await server.start()
    print(server.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)   # until the bench closes stdin
    await server.close()

asyncio.run(main())
"""


def unsent(stream: Any) -> int:
    """Bytes a push stream's kernel queue still holds (not yet acknowledged by the buddy: Linux SIOCOUTQ)."""
    import fcntl
    import struct
    import termios

    sock = stream._sock
    if sock is None:
        return 0
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]


class Buddy:
    """A buddy node's mirror server in a process of its own (as on another host: its reads and MAC checks do
    not share this process's GIL)."""

    def __init__(self) -> None:
        self.key = os.urandom(32)
        self.proc = subprocess.Popen([sys.executable, "-c", BUDDY, self.key.hex()], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def target(self) -> Any:
        from tpassrun.mirror import MirrorTarget

        return MirrorTarget("buddy", "127.0.0.1", self.port, self.key, "bench", 0)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


def channel_bookkeeping(link: _AgentLink) -> Callable[[], None]:
    """What ``Session.run`` does with the channel around one step, minus the snapshot and the step itself."""
    step = [0]

    def once() -> None:
        s = step[0]
        link.set(Field.STEP, s)
        start = time.monotonic_ns()
        link.set(Field.HEARTBEAT_NS, start)
        if link.get(Field.RUN_UNTIL) <= s:
            raise AssertionError("run_until must not stop this loop")
        link.set(Field.PHASE, 1)
        link.set(Field.LAST_STEP_NS, time.monotonic_ns() - start)
        step[0] = s + 1

    return once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000, help="calls per batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer calls")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: time.process_time (what the process spent, steadier on a shared host)")
    args = parser.parse_args()
    if args.clock == "cpu":
        CLOCK[0] = time.process_time
    calls = 2000 if args.quick else args.steps
    snapshot_calls = max(200, calls // 10)  # each snapshot is ~100x a channel access
    # pushes per batch: ~0.5 MB, what the buddy's socket takes in without waiting (a worker pushes once per step;
    # back to back, thousands would fill the buffer and the worker would skip them: cheaper, and not the case)
    push_calls = 50

    with tempfile.TemporaryDirectory(prefix="tpassrun-bench-step-") as tmp:
        channel = ChannelFile.create(os.path.join(tmp, "channel"), n_slots=SLOT + 1)
        with DrainingAgent(os.path.join(tmp, "agent.sock")):
            link = _AgentLink(channel.path, SLOT, os.path.join(tmp, "agent.sock"))
            sess = Session(backend=None, link=link, rank=0, world_size=1, local_rank=0, generation=0,
                           joined=False, timeout=None)
            plain = Session(backend=None, link=None, rank=0, world_size=1, local_rank=0, generation=0,
                            joined=False, timeout=None)
            trained = train_job(Session(backend=None, link=link, rank=0, world_size=1, local_rank=0, generation=0,
                                        joined=False, timeout=None))
            trained_plain = train_job(Session(backend=None, link=None, rank=0, world_size=1, local_rank=0,
                                              generation=0, joined=False, timeout=None))
            sampler = Sampler()
            sess.track(model=torch.nn.Linear(256, 256), sampler=sampler)
            sess._state.light_retarget_due = 0            # this stand-in agent knows no buddy: nothing to ask
            # the same session pushing every snapshot into a buddy's mirror itself (tpassrun/worker/light_mirror.py)
            pushing = Session(backend=None, link=link, rank=0, world_size=1, local_rank=0, generation=0,
                              joined=False, timeout=None)
            pushing.track(model=torch.nn.Linear(256, 256), sampler=Sampler())
            pushing._state.light_retarget_due = 0
            buddy = Buddy()
            from tpassrun.mirror.client import PushStream
            from tpassrun.worker.light_mirror import LightMirror

            trained_pushing = train_job(Session(backend=None, link=link, rank=0, world_size=1, local_rank=0,
                                                generation=0, joined=False, timeout=None))
            for s in (pushing, trained_pushing[1]):
                s._state.light_retarget_due = 0
                s._state.light_mirror = LightMirror(0, link)
                s._state.light_mirror.retarget(buddy.target(), 0)
                assert s._state.light_mirror.wait_up(10), "the buddy's mirror did not answer"
            trained[1]._state.light_retarget_due = 0
            raw = PushStream("127.0.0.1", buddy.port, buddy.key, run_id="bench").connect()
            snapper = LightSnapshotter()
            light = snapper.take({"sampler": sampler}, step=7)
            step = [0]

            def snapshot() -> None:
                step[0] += 1
                sess._state.window = step[0]        # a step outside an accumulation window, as run() sets it
                sess._txn.snapshot_light(step[0])

            def snapshot_pushed() -> None:
                step[0] += 1
                pushing._state.window = step[0]     # a step outside an accumulation window, as run() sets it
                pushing._txn.snapshot_light(step[0])

            def drained(measure: Callable[[], float]) -> Callable[[], float]:
                """``measure`` once the buddy has read everything pushed so far (untimed): a worker pushes once per
                step, so its pushes never queue up behind each other as a tight loop's would."""
                def run() -> float:
                    streams = [raw, *(s._state.light_mirror._stream for s in (pushing, trained_pushing[1]))]
                    deadline = time.monotonic() + 10
                    while any(unsent(x) for x in streams if x is not None) and time.monotonic() < deadline:
                        time.sleep(0.002)
                    return measure()
                return run

            def push_alone() -> None:
                step[0] += 1
                if raw.push(0, "light", step[0], 0, light) is not None:
                    raise AssertionError("the push did not fit the send buffer")

            figures = interleaved({
                "boundary check (run_until read)": lambda: batch_us(
                    lambda: link.get(Field.RUN_UNTIL) <= 12345, calls),
                "boundary check, ChannelFile.get": lambda: batch_us(
                    lambda: channel.get(SLOT, Field.RUN_UNTIL), calls),
                "channel bookkeeping per step": lambda: batch_us(channel_bookkeeping(link), calls),
                "light snapshot per step": lambda: batch_us(snapshot, snapshot_calls),
                "light snapshot per step, pushed to the buddy by the worker": drained(lambda: batch_us(
                    snapshot_pushed, push_calls)),
                "  PushStream.push of one snapshot (frame, HMAC, sendmsg)": drained(lambda: batch_us(push_alone,
                                                                                                 push_calls)),
                "  LightSnapshotter.take": lambda: batch_us(lambda: snapper.take({"sampler": sampler}, 7),
                                                             snapshot_calls),
                "  (general codec: capture_rng + capture + encode_small)": lambda: batch_us(
                    lambda: handoff.encode_small(handoff.capture({"sampler": sampler}, step=7,
                                                                 rng=handoff.capture_rng())), snapshot_calls),
                "  (general codec: capture_rng alone)": lambda: batch_us(handoff.capture_rng, snapshot_calls),
                "  ChannelFile.write_light": lambda: batch_us(lambda: channel.write_light(SLOT, light), calls),
                "Session.run no-op step, managed": lambda: loop_batch_us(sess, snapshot_calls),
                "Session.run no-op step, unmanaged": lambda: loop_batch_us(plain, calls),
                "Session.run tiny training step, managed": lambda: train_batch_us(trained, snapshot_calls),
                "Session.run tiny training step, unmanaged": lambda: train_batch_us(trained_plain, snapshot_calls),
                "Session.run no-op step, managed, 50-step runs": lambda: loop_batch_us(sess, push_calls),
                "Session.run tiny training step, managed, 50-step runs": lambda: train_batch_us(trained, push_calls),
                "Session.run no-op step, managed, pushing to the buddy": drained(lambda: loop_batch_us(
                    pushing, push_calls)),
                "Session.run tiny training step, managed, pushing to the buddy": drained(lambda: train_batch_us(
                    trained_pushing, push_calls)),
            }, args.repeats)
            pushed = pushing._state.light_mirror.pushed + trained_pushing[1]._state.light_mirror.pushed
            assert pushing._state.light_mirror.up and trained_pushing[1]._state.light_mirror.up, \
                "the worker stopped pushing to the buddy (its send buffer filled: a skipped push is cheaper)"
            for s in (pushing, trained_pushing[1]):
                s._state.light_mirror.close()
            raw.close()
            buddy.close()
            assert channel.read_light(SLOT) is not None
            link.sock.close()
        channel.close()

    print(f"light snapshot: {len(light)} bytes (sampler + RNG); {calls} calls per batch, {args.repeats} interleaved "
          f"rounds; {args.clock} clock; load average {os.getloadavg()[0]:.1f}")
    for name, (best, median) in figures.items():
        print(f"  {name:62s} best {best:8.2f} us   median {median:8.2f} us")
    managed = figures["Session.run no-op step, managed"]
    unmanaged = figures["Session.run no-op step, unmanaged"]
    print(f"  {'=> per-step overhead of tpassrun':56s} best {managed[0] - unmanaged[0]:8.2f} us   "
          f"median {managed[1] - unmanaged[1]:8.2f} us")
    managed = figures["Session.run tiny training step, managed"]
    unmanaged = figures["Session.run tiny training step, unmanaged"]
    print(f"  {'=> per training step (seal, commit point, window)':56s} best {managed[0] - unmanaged[0]:8.2f} us   "
          f"median {managed[1] - unmanaged[1]:8.2f} us")
    for kind in ("no-op step", "tiny training step"):
        # side by side, in runs of the same length (a run's start costs a little; pushes come 50 to a run)
        with_push = figures[f"Session.run {kind}, managed, pushing to the buddy"]
        without = figures[f"Session.run {kind}, managed, 50-step runs"]
        print(f"  {'=> ' + kind + ': what pushing adds':56s} best {with_push[0] - without[0]:8.2f} us"
              f"   median {with_push[1] - without[1]:8.2f} us")
    print(f"  ({pushed} snapshots pushed to the buddy's mirror in all)")
    print_json({"bench": "step_overhead", "light_bytes": len(light), "clock": args.clock,
                "load": os.getloadavg()[0], "pushed": pushed,
                "us": {name.strip(): {"best": b, "median": m} for name, (b, m) in figures.items()}})


if __name__ == "__main__":
    main()
