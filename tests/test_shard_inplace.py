"""A survivor told to roll back to the step it stands at, holding no complete local copy of that step's start
(``ShardedState.rollback``'s in-place case), in one process against a real channel file.

The story. The leader rolls every survivor back to its own copy of step v (``restore``) when the survivors
stopped at different steps and v is the newest step every one of them can be put back to; a survivor standing
at v before its commit point counts as holding v with no copy at all (``shardplane.live_step``). Until the
worker was recomposed (ee9b5af) that survivor's rollback read ``self._last_light``, an attribute renamed to
``_rollback_light`` in a7da8aa, so it raised AttributeError; since then a RuntimeError: either way the
recovery was refused and the group restarted. Two positions reach it: paused at v's boundary before
``begin(v)`` took the copy (STOP_NOW seen at the top of the loop), and inside v before its commit point when v
had no copy (its copy failed: ``ShardRing.fence`` drops it; here: v is not a refresh step, K = 2). Both hold
v's heavy state (nothing changes it before the commit point): the paused one exactly v's start, the failed one
v's start but for what the step consumed (per-rank state, gradients), which goes back to the snapshot its
transaction began with. A rank inside an open accumulation window is not at any transaction's start (the
window's gradients would be lost): refused, with the reason.
"""

from __future__ import annotations

import pytest
import torch
from test_step_transaction import Sampler, session  # noqa: F401 - the fixture: a Session on a real channel file

from tpassrun.worker import Session
from tpassrun.worker.shards import ShardState


class Boom(Exception):
    pass


@pytest.fixture
def sharded(session):  # noqa: F811
    sess, _channel = session
    sess._state.shards = ShardState(0, 2, lambda f, v: None)   # copies at steps 1 (the first), 2, 4, ...
    yield sess
    sess._sharded.close()


def _job(sess: Session | None, *, every: int = 1):
    """A model with dropout (RNG), a per-rank sampler, a momentum optimizer tracked sharded; the optimizer
    steps every ``every`` steps (gradient accumulation in between). ``fail`` raises after the backward pass."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = Sampler()
    if sess is not None:
        sess.track(model=model, sampler=sampler)
        sess.track_sharded(optimizer=opt)
    fail: set[int] = set()

    def step(i: int) -> None:
        sampler.pos += 1
        x = torch.randn(3, 4) + sampler.pos
        model(x).pow(2).mean().backward()
        if i in fail:
            fail.discard(i)
            raise Boom(f"step {i}")
        if i % every == every - 1:
            opt.step()
            opt.zero_grad()

    return model, opt, sampler, step, fail


def _reference(total: int):
    model, opt, sampler, step, _fail = _job(None)
    for i in range(total):
        step(i)
    return model, opt, sampler, torch.get_rng_state()


def _assert_same(model, opt, sampler, ref) -> None:
    rmodel, ropt, rsampler, rng = ref
    assert sampler.pos == rsampler.pos
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), rmodel.state_dict().values()))
    for p, rp in zip(model.parameters(), rmodel.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], ropt.state[rp]["momentum_buffer"])
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_rank_paused_before_its_copy_is_rolled_back_in_place(sharded):
    """Paused at step 4's boundary (a refresh step whose copy ``begin(4)`` had not taken yet): holds exactly
    step 4's start; the rollback leaves it as it is and the run goes on bit-identical to one never stopped.
    Before: RuntimeError (AttributeError before ee9b5af), the recovery refused."""
    sess = sharded
    model, opt, sampler, step, _fail = _job(sess)
    sess.run(step, 4)                                   # stands at step 4, not begun
    assert sess._state.shards.ring.get(4) is None and sess._state.committed == 3
    sess._sharded.rollback(4)
    assert sess.step == 4 and sess._state.shard_restore_due is None
    sess.run(step, 7)
    _assert_same(model, opt, sampler, _reference(7))


def test_a_rank_failed_inside_a_step_without_its_copy_is_rolled_back_in_place(sharded):
    """Failed in step 3 after its backward pass, before its commit point, with no copy of step 3 (K = 2; in a
    real run: a copy that failed): its per-rank state goes back to the snapshot step 3 began with, its
    gradients are dropped, and the re-executed step 3 and the rest are bit-identical to an uninterrupted run."""
    sess = sharded
    model, opt, sampler, step, fail = _job(sess)
    fail.add(3)
    with pytest.raises(Boom):
        sess.run(step, 7)
    assert sess._state.shards.ring.get(3) is None and sess.step == 3 and sess._state.committed == 2
    sess._sharded.rollback(3)
    assert all(p.grad is None for p in model.parameters())
    sess.run(step, 7)
    _assert_same(model, opt, sampler, _reference(7))


def test_a_rank_inside_an_accumulation_window_is_refused_with_the_reason(sharded):
    """The optimizer steps every second step: standing at step 3, inside the window begun at step 2, the rank
    holds step 2's gradients; step 3 is no transaction's start: refused, and the state is left alone."""
    sess = sharded
    model, _opt, sampler, step, _fail = _job(sess, every=2)
    sess.run(step, 3)
    assert sess._state.window == 2
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="inside the accumulation window begun at step 2"):
        sess._sharded.rollback(3)
    assert sess.step == 3 and sampler.pos == 3
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_a_rank_rolled_back_twice_to_the_same_copy_still_loads_its_shards(sharded):
    """Rolled back from step 5 to its copy of step 4, the sharded objects wait for the re-formed world
    (``shard_restore_due``); told to roll back to step 4 again before that (a world given up, planned again) it
    stands at 4 uncommitted, but its live shards are still step 5's: the copy is loaded, never skipped as live."""
    sess = sharded
    model, opt, sampler, step, _fail = _job(sess)
    sess.run(step, 5)
    sess._sharded.rollback(4)
    assert sess.step == 4 and sess._state.shard_restore_due == 4
    sess._sharded.rollback(4)
    assert sess._state.shard_restore_due == 4
    sess._sharded.after_reform()
    sess._state.shards.retarget_due = False      # no agent here to ask where the mirror is
    sess.run(step, 7)
    _assert_same(model, opt, sampler, _reference(7))
