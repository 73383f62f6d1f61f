"""What a healthy rank pays per step for tpassrun: the boundary check and the light snapshot, in microseconds.

    python bench/step_overhead.py [--steps 20000] [--repeats 5]

Measured in one process, against the real code: a :class:`tpassrun.channel.ChannelFile` in a temp file (as the
agent creates it), a real :class:`tpassrun.worker.Session` linked to it over a unix socket that a thread
drains (standing in for the agent), tracking a model (replicated: not in the light snapshot) and a sampler
(per rank: in it). Prints:

  * the boundary check alone (one ``run_until`` read from the mmap);
  * the per-step channel bookkeeping of ``Session.run`` (step, heartbeat, phase, last step time, the check);
  * the per-step light snapshot (``Session._snapshot_light``: :class:`tpassrun.light.LightSnapshotter` and the
    double-buffered write), with its parts, and the general handoff codec it replaced, for comparison;
  * ``Session.run`` with a no-op step, managed vs. not launched by tpassrun: the whole per-step overhead;
  * ``Session.run`` with a tiny training step (forward, backward, SGD step on a tracked 16x16 linear model,
    one sampler advance), managed vs. not: what a real step pays, the seal in the backward pass, the commit
    point and the window bookkeeping included.

Best and median of ``--repeats`` rounds (each round measures every item once, in turn). Figures only, no assertions. The last line is JSON.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import threading
import time
from typing import Any, Callable

import torch

from common import print_json
from tpassrun import handoff
from tpassrun.channel import ChannelFile, Field
from tpassrun.light import LightSnapshotter
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
            rng = handoff.capture_rng()
            snapper = LightSnapshotter()
            light = snapper.take({"sampler": sampler}, step=7)
            step = [0]

            def snapshot() -> None:
                step[0] += 1
                sess._window = step[0]        # a step outside an accumulation window, as run() sets it
                sess._snapshot_light(step[0])

            figures = interleaved({
                "boundary check (run_until read)": lambda: batch_us(
                    lambda: link.get(Field.RUN_UNTIL) <= 12345, calls),
                "boundary check, ChannelFile.get": lambda: batch_us(
                    lambda: channel.get(SLOT, Field.RUN_UNTIL), calls),
                "channel bookkeeping per step": lambda: batch_us(channel_bookkeeping(link), calls),
                "light snapshot per step": lambda: batch_us(snapshot, snapshot_calls),
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
            }, args.repeats)
            assert channel.read_light(SLOT) is not None
            link.sock.close()
        channel.close()

    print(f"light snapshot: {len(light)} bytes (sampler + RNG); {calls} calls per batch, {args.repeats} interleaved "
          f"rounds; {args.clock} clock; load average {os.getloadavg()[0]:.1f}")
    for name, (best, median) in figures.items():
        print(f"  {name:56s} best {best:8.2f} us   median {median:8.2f} us")
    managed = figures["Session.run no-op step, managed"]
    unmanaged = figures["Session.run no-op step, unmanaged"]
    print(f"  {'=> per-step overhead of tpassrun':56s} best {managed[0] - unmanaged[0]:8.2f} us   "
          f"median {managed[1] - unmanaged[1]:8.2f} us")
    managed = figures["Session.run tiny training step, managed"]
    unmanaged = figures["Session.run tiny training step, unmanaged"]
    print(f"  {'=> per training step (seal, commit point, window)':56s} best {managed[0] - unmanaged[0]:8.2f} us   "
          f"median {managed[1] - unmanaged[1]:8.2f} us")
    print_json({"bench": "step_overhead", "light_bytes": len(light), "clock": args.clock,
                "load": os.getloadavg()[0],
                "us": {name.strip(): {"best": b, "median": m} for name, (b, m) in figures.items()}})


if __name__ == "__main__":
    main()
