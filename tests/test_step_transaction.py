"""The worker's step transaction, in one process against a real channel file: what a dead rank leaves behind.

At the start of step s the channel holds s's start snapshot; after the step's backward pass (its collectives)
the newest buffer holds the seal, labelled s + 1, and the other one still s's start; the optimizer step marks
the commit. User code after the step that changes per-rank state turns sealing off (the next start checks).
"""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import threading

import pytest
import torch

from tpassrun.channel import ChannelFile, Field, WorkerPhase
from tpassrun.transfer.light import decode
from tpassrun.worker import INT64_MAX, Session, _AgentLink


class Sampler:
    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


@pytest.fixture
def session(tmp_path):
    channel = ChannelFile.create(str(tmp_path / "channel"), n_slots=2)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "agent.sock"))
    listener.listen(1)

    def drain() -> None:
        conn, _ = listener.accept()
        with conn:
            while conn.recv(65536):
                pass

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    link = _AgentLink(channel.path, 1, str(tmp_path / "agent.sock"))
    sess = Session(backend=None, link=link, rank=0, world_size=1, local_rank=0, generation=0, joined=False,
                   timeout=None)
    yield sess, channel
    link.sock.close()
    listener.close()
    thread.join(5)
    link.ch.close()
    channel.close()


def _job(sess):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = Sampler()
    sess.track(model=model, optimizer=opt, sampler=sampler)
    return model, opt, sampler


def _steps(channel):
    return channel.light_step(1), channel.light_step(1, previous=True)


def test_the_channel_holds_the_step_start_and_the_seal_after_the_collectives(session):
    sess, channel = session
    model, opt, sampler = _job(sess)
    seen = {}

    def step(i: int) -> None:
        sampler.pos += 1
        seen[(i, "start")] = _steps(channel)
        model(torch.randn(2, 4)).sum().backward()
        seen[(i, "backward")] = _steps(channel)
        opt.step()
        seen[(i, "committed")] = channel.get(1, Field.COMMITTED)
        opt.zero_grad()

    sess.run(step, 12)
    for i in range(12):
        # the newest buffer is this step's start (or the previous step's seal, which is the same state)
        assert seen[(i, "start")][0] == i
        assert seen[(i, "backward")] == (i + 1, i), i    # sealed for the next step; the start kept
        assert seen[(i, "committed")] == i + 1
    # the seal is byte for byte the next step's start: what a joiner resumes from
    newest = decode(channel.read_light(1))
    assert newest.meta["step"] == 12


def test_user_code_changing_per_rank_state_after_the_step_turns_sealing_off(session, caplog):
    sess, channel = session
    model, opt, sampler = _job(sess)
    seen = {}

    def step(i: int) -> None:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        seen[i] = _steps(channel)
        sampler.pos += 1        # "prefetch" after the step: the seal would be wrong
        random.random()

    sess.run(step, 4)
    assert "changed after the backward pass" in caplog.text
    assert seen[0] == (1, 0)                 # sealed before anyone knew
    assert seen[2] == (2, 1)                 # no seal any more: the newest is the step start
    assert not sess._state.commit_snapshots


def test_an_accumulation_window_keeps_its_start_snapshot_until_it_commits(session):
    """An optimizer step every 3rd step: the steps since the last commit are rolled back as one, so the window's
    start stays in one buffer while the steps inside it seal into the other."""
    sess, channel = session
    model, opt, sampler = _job(sess)
    seen = {}

    def step(i: int) -> None:
        sampler.pos += 1
        seen[(i, "start")] = _steps(channel)
        model(torch.randn(2, 4)).sum().backward()
        seen[(i, "backward")] = _steps(channel)
        if i % 3 == 2:
            opt.step()
            opt.zero_grad()

    sess.run(step, 9)
    for w in (0, 3, 6):
        assert seen[(w, "start")][0] == w
        assert seen[(w, "backward")] == (w + 1, w)
        for i in (w + 1, w + 2):                     # inside the window: its start is always one of the two
            assert w in seen[(i, "start")] and w in seen[(i, "backward")], (i, seen[(i, "backward")])
            assert seen[(i, "backward")][0] == i + 1
    assert sess._state.window == 9


def test_a_paused_rank_inside_a_window_offers_the_windows_start_and_rolls_back_to_it(session):
    sess, channel = session
    model, opt, sampler = _job(sess)
    sess._state.window = 0

    def step(i: int) -> None:
        sampler.pos += 1
        model(torch.randn(2, 4)).sum().backward()
        if i % 3 == 2:
            opt.step()
            opt.zero_grad()

    sess.run(step, 5)                  # window 3..4 open: step 5 would continue it
    assert sess._state.window == 3 and model[0].weight.grad is not None
    channel.set(1, Field.RUN_UNTIL, 0)
    sess._commands.roll_back(5, 3, failed=False)
    assert sess.step == 3 and sampler.pos == 3 and model[0].weight.grad is None


def test_every_backward_seals_before_its_gradient_reaches_ddp(session):
    """Sealed when the tracked model's first parameter gets its gradient, before DDP sees it: no all-reduce of
    this backward can complete on another rank before this rank's seal holds what its forward consumed, however
    many micro-batches the step has; the step's start stays in the other buffer."""
    sess, channel = session
    model, opt, sampler = _job(sess)
    seen = []

    def check(grad):            # registered after tpassrun's hook on the same parameter: runs right after it
        seen.append((_steps(channel), decode(channel.read_light(1)).meta["objects"]["sampler"]["pos"],
                     sampler.pos))
        return grad

    model[0].weight.register_hook(check)

    def step(i: int) -> None:
        for _ in range(3):
            sampler.pos += 1
            model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()

    sess.run(step, 2)
    assert [s for s, _, _ in seen] == [(1, 0)] * 3 + [(2, 1)] * 3
    assert all(sealed == pos for _, sealed, pos in seen)
    assert _steps(channel) == (2, 1)


def test_a_framework_adapters_model_chunks_seal_in_their_backward_pass(session):
    """Megatron's adapter tracks a view of its model chunks (not an nn.Module): the chunks under it seal the step
    in their backward pass, as a tracked model does (sealed only at the optimizer step, a rank that died after its
    part of the data-parallel all-reduce, before its commit point, left no state for the step the survivors
    completed: a restart)."""
    from tpassrun.adapters._common import register
    from tpassrun.adapters.megatron import MegatronProgress, ModelChunksState

    sess, channel = session
    torch.manual_seed(0)
    chunk = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(chunk.parameters(), lr=0.1)
    progress = MegatronProgress()
    register(sess, "megatron.progress", progress, heavy=False)
    register(sess, "megatron.model", ModelChunksState([chunk]), heavy=True)
    sess.track(optimizer=opt)
    seen = []

    def step(i: int) -> None:
        progress.advance(8)
        chunk(torch.randn(2, 4)).sum().backward()
        seen.append((_steps(channel), sess._state.sealed))       # after the backward pass, before the optimizer step
        opt.step()
        opt.zero_grad()

    sess.run(step, 3)
    assert seen == [((1, 0), 0), ((2, 1), 1), ((3, 2), 2)]
    assert sess._state.commit_snapshots                              # every seal was the next step's start


def test_a_grad_scaler_update_commits_a_step_whose_optimizer_step_was_skipped(session):
    sess, channel = session
    model, opt, sampler = _job(sess)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)    # overflows: every step skips opt.step
    sess.track(scaler=scaler)

    def step(i: int) -> None:
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    sess.run(step, 3)
    assert channel.get(1, Field.COMMITTED) == 3 and sess._state.window == 3
    assert "update" not in scaler.state_dict() and opt.state == {}     # never stepped, every step committed
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    scaler.unscale_(opt)         # a step re-executed after a failure past unscale_ may unscale again
    sess._txn.drop_grads()
    scaler.unscale_(opt)


def test_a_step_failing_after_its_commit_point_resumes_next_only_if_its_state_changes_are_complete(session):
    """After opt.step() a collective fails (a logging all-reduce, a barrier): the step can be finished only if the
    scheduler stepped as in every other step (then its seal is the next step's start)."""
    sess, channel = session
    model, opt, sampler = _job(sess)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    sess.track(scheduler=sched)
    seen = {}

    def step(i: int) -> None:
        sampler.pos += 1
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        seen[(i, "before sched")] = sess._txn.complete_after_commit()
        sched.step()
        seen[(i, "after sched")] = sess._txn.complete_after_commit()
        opt.zero_grad()

    sess.run(step, 3)
    assert seen[(0, "after sched")] is False                      # nothing to compare with yet
    assert seen[(1, "before sched")] is False and seen[(1, "after sched")] is True
    assert seen[(2, "before sched")] is False and seen[(2, "after sched")] is True


def test_a_rank_that_committed_a_step_the_others_did_not_goes_back_to_its_start(tmp_path):
    """A mixed commit, the other way (tpassrun/worker/catchup.py): this rank committed step 2 and stopped at step 3; the
    others failed inside step 2. It keeps the start snapshot of its previous transaction (step 2's), takes the
    replicated state of step 2's start from one of them (CatchUp), goes back at Reform, and re-executes step 2 on:
    exactly where an uninterrupted rank ends."""
    from test_catchup_worker import KEY, Agent
    from test_catchup_worker import _job as _adamw_job
    from test_catchup_worker import _step as _adamw_step

    from tpassrun.channel.protocol import CatchUp, SendState
    from tpassrun.transfer import handoff
    from tpassrun.worker.commands import _send_state

    torch.manual_seed(7)
    ref = _adamw_job(None)
    torch.manual_seed(7)
    for i in range(5):
        _adamw_step(*ref, i)
    ref_rng = torch.get_rng_state()
    torch.manual_seed(7)
    behind = _adamw_job(None)               # a survivor that did not commit step 2: at step 2's start
    torch.manual_seed(7)
    for i in range(2):
        _adamw_step(*behind, i)
    state = handoff.capture({"model": behind[0], "optimizer": behind[1]}, step=2,
                            extra={"objects": ["model", "optimizer"], "swap_id": "u-b"})

    channel = ChannelFile.create(str(tmp_path / "channel"), n_slots=2)
    agent = Agent(str(tmp_path / "agent.sock"))
    link = _AgentLink(channel.path, 1, str(tmp_path / "agent.sock"))
    sess = Session(backend=None, link=link, rank=1, world_size=2, local_rank=1, generation=0, joined=False,
                   timeout=None)
    sess._state.light_retarget_due = 0
    model, opt, sampler = _adamw_job(sess)
    torch.manual_seed(7)
    sess.run(lambda i: _adamw_step(model, opt, sampler, i), 3)     # committed step 2: a step ahead of the others
    random.random(), torch.rand(5)                                 # whatever the failure path consumed
    sess._catchup.publish_back(3)                                          # as a rank paused at step 3 does
    assert channel.get(1, Field.ALT_BACK) == 3

    def donor() -> None:
        port = agent.wait("listening")["port"]
        _send_state(SendState(addr="127.0.0.1", port=port, swap_id="u-b", key=KEY, rank=1), state,
                    corrupt=lambda: False)

    thread = threading.Thread(target=donor, daemon=True)
    thread.start()
    sess._catchup.on_catch_up(CatchUp(swap_id="u-b", key=KEY, rank=1, listen_host="127.0.0.1", step=2), 3, None)
    thread.join(20)
    received = agent.wait("received")
    assert received["ok"] and received["step"] == 2, received
    assert channel.get(1, Field.OFFER) == 3 and channel.get(1, Field.ALT_BACK) == 0   # it offers step 2 now
    sess._commands.roll_back(3, 2, False)            # the re-formed world: resume at 2 (the world itself is not joined)
    assert sess.step == 2 and sampler.pos == 2 and sess._state.committed == 1
    sess.run(lambda i: _adamw_step(model, opt, sampler, i), 5)
    for a, b in zip(model.parameters(), ref[0].parameters()):
        assert torch.equal(a, b)
    for k, v in opt.state_dict()["state"].items():
        for name, t in v.items():
            assert torch.equal(t, ref[1].state_dict()["state"][k][name]), (k, name)
    assert sampler.pos == ref[2].pos == 5 and torch.equal(torch.get_rng_state(), ref_rng)
    link.sock.close()
    channel.close()


def test_a_rollback_loads_per_rank_objects_in_the_order_they_were_tracked(session):
    """Per-rank objects are restored in the order the script tracked them, as a joiner loads them, whatever the
    process's hash seed (a set's order: a Megatron survivor rebuilt its data iterator from counters not restored
    yet on some seeds and resumed a batch ahead)."""
    sess, _channel = session
    loaded: list[str] = []

    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

        def state_dict(self) -> dict:
            return {"name": self.name}

        def load_state_dict(self, state: dict) -> None:
            loaded.append(state["name"])

    names = [f"obj{i:02d}" for i in range(16)]
    for name in names:
        sess.track_per_rank(**{name: Named(name)})
    sess._txn.restore_light(sess._txn.publish_light(0))
    assert loaded == names


def test_a_rank_parking_before_a_step_never_shows_that_step_as_running(session, monkeypatch):
    """What the agent reads (phase and step, ChannelFile.position) after every single write of the worker, through
    an accumulation window (optimizer step every 2nd step) and a pause at the window's end: "running step B" from
    a rank about to park before B once made an agent waiting at a boundary move it a whole window further."""
    sess, channel = session
    model, opt, sampler = _job(sess)
    link = sess._state.link
    channel.set(1, Field.RUN_UNTIL, 3)   # inside window 2..3: the rank parks before step 4
    seen: list[tuple[object, int]] = []
    write = link.set

    def write_and_read(field: Field, value: int) -> None:
        write(field, value)
        seen.append(channel.position(1))

    def resumed_at_once(step: int, failed: BaseException | None = None) -> None:
        seen.append(("parked", step))
        channel.set(1, Field.RUN_UNTIL, INT64_MAX)
        link.set(Field.PHASE, WorkerPhase.RUNNING)

    monkeypatch.setattr(link, "set", write_and_read)
    monkeypatch.setattr(sess._commands, "serve", resumed_at_once)

    def step(i: int) -> None:
        sampler.pos += 1
        model(torch.randn(2, 4)).sum().backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()

    sess.run(step, 6)
    parked = seen.index(("parked", 4))
    before = seen[:parked]
    assert (WorkerPhase.RUNNING, 3) in before                  # the window's last step ran
    assert (WorkerPhase.RUNNING, 4) not in before, before       # step 4 never showed as running before the park
    assert before[-1] == (WorkerPhase.PAUSED, 4)
    assert (WorkerPhase.RUNNING, 4) in seen[parked:]            # and ran once resumed


_FLIPPER = """
import sys
from tpassrun.channel import ChannelFile, Field, WorkerPhase
ch = ChannelFile.open(sys.argv[1])
for k in range(1, int(sys.argv[2])):
    ch.set(0, Field.PHASE, WorkerPhase.PAUSING)   # parks before every even step,
    ch.set(0, Field.STEP, 2 * k)
    ch.set(0, Field.PHASE, WorkerPhase.PAUSED)
    ch.set(0, Field.STEP, 2 * k + 1)              # runs every odd one
    ch.set(0, Field.PHASE, WorkerPhase.RUNNING)
ch.set(0, Field.PHASE, WorkerPhase.DONE)
"""


def test_the_agent_reads_phase_and_step_as_one(tmp_path):
    """Another process moves a slot through a step boundary after another; what ChannelFile.position reads is
    always a pair the slot held (never "running" an even step, which it never is), however the reads interleave
    with its writes."""
    channel = ChannelFile.create(str(tmp_path / "channel"), n_slots=1)
    channel.set(0, Field.STEP, 1)
    channel.set(0, Field.PHASE, WorkerPhase.RUNNING)
    proc = subprocess.Popen([sys.executable, "-c", _FLIPPER, channel.path, "100000"])
    try:
        reads, torn = 0, []
        while True:
            phase, step = channel.position(0)
            reads += 1
            if phase == WorkerPhase.DONE:
                break
            if phase == WorkerPhase.RUNNING and step % 2 == 0:
                torn.append(step)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()
        channel.close()
    assert not torn, (len(torn), reads)
