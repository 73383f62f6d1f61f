"""Whose fault a worker's exception is, when the worker could not prove it distributed (pure: failkind.cause_of).

Torchelastic's rule, "the first failure is the root cause": while the worker waits for the answer its collectives
stay open, so any failure of another rank of its world seen by then came first, and the exception is its casualty.
"""

from __future__ import annotations

import pytest

from tpassrun.channel import WorkerPhase
from tpassrun.plan.failkind import CAUSE_GRACE_S, Around, Cause, FailureKind, cause_of, classify_death


@pytest.mark.parametrize("around,why", [
    (Around(waited_s=0.0, dead=("rank 2's death (killed by SIGKILL)",)), "a casualty of rank 2's death"),
    (Around(waited_s=0.1, lost_nodes=("node-b",)), "a casualty of node node-b lost"),
    (Around(waited_s=0.1, recovering=True), "a casualty of the failure being recovered"),
    (Around(waited_s=0.1, failed_peers=(3,)), "rank 3's collective failed too"),
])
def test_a_failure_elsewhere_makes_it_a_casualty_at_once(around, why):
    cause, said = cause_of(around)
    assert cause is Cause.CASUALTY and said.startswith(why), said


def test_a_death_seen_late_still_counts_before_the_grace_ends():
    # a peer SIGKILLed resets the survivors' connections before its agent has reaped it
    assert cause_of(Around(waited_s=0.02))[0] is Cause.PENDING
    assert cause_of(Around(waited_s=CAUSE_GRACE_S - 0.01, dead=("rank 1's death",)))[0] is Cause.CASUALTY


def test_nothing_around_it_within_the_grace_is_a_user_error():
    assert cause_of(Around(waited_s=CAUSE_GRACE_S - 0.01))[0] is Cause.PENDING
    cause, why = cause_of(Around(waited_s=CAUSE_GRACE_S))
    assert cause is Cause.ROOT_CAUSE and "the script's own error" in why


def test_every_rank_raising_the_same_bug_is_each_ranks_own_error():
    """All ranks raise at once: each waits, its peers parked PENDING beside it (not FAILED, not dead): no one is
    another's casualty, every one takes torchrun's path after the grace, none waits for ever."""
    assert cause_of(Around(waited_s=CAUSE_GRACE_S, failed_peers=()))[0] is Cause.ROOT_CAUSE


def test_a_node_that_does_not_answer_is_waited_for_until_its_lease_tells():
    silent = Around(waited_s=CAUSE_GRACE_S + 1, silent_nodes=("node-b",), lease_s=10.0)
    assert cause_of(silent)[0] is Cause.PENDING
    assert cause_of(Around(waited_s=CAUSE_GRACE_S + 10, silent_nodes=("node-b",), lease_s=10.0))[0] is Cause.ROOT_CAUSE
    assert cause_of(Around(waited_s=CAUSE_GRACE_S + 1, lease_s=10.0))[0] is Cause.ROOT_CAUSE   # none silent


def test_the_grace_is_seconds():
    assert 1.0 <= CAUSE_GRACE_S <= 10.0


def test_a_worker_that_dies_while_it_waits_is_no_user_error():
    assert classify_death(-9, WorkerPhase.PENDING)[0] is FailureKind.SIGNAL
    assert classify_death(1, WorkerPhase.PENDING)[0] is FailureKind.EXIT_CODE
