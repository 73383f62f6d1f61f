"""A step's exception is classified by its type and the frame that raised it, never by its message."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tpassrun.worker import StepFailure, classify_failure, is_distributed_failure


def _caught(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError("did not raise")


def test_torch_typed_distributed_errors_are_distributed():
    def boom():
        raise dist.DistNetworkError("whatever the message says")

    assert classify_failure(_caught(boom)) == StepFailure.DIST_ERROR


def test_an_exception_raised_inside_torch_distributed_is_a_collective_failure():
    exc = _caught(lambda: dist.all_reduce(torch.ones(1)))   # no process group: raised by torch.distributed
    assert classify_failure(exc) == StepFailure.COLLECTIVE and is_distributed_failure(exc)


@pytest.mark.parametrize("message", ["Connection reset by peer", "socket timed out", "gloo NCCL ProcessGroup",
                                     "shapes do not match"])
def test_user_code_raising_is_a_user_error_whatever_its_message(message):
    def step():
        raise RuntimeError(message)

    assert classify_failure(_caught(step)) == StepFailure.USER and not is_distributed_failure(_caught(step))


def test_an_error_in_the_users_model_inside_ddp_like_wrappers_is_a_user_error():
    lin = torch.nn.Linear(3, 2)
    exc = _caught(lambda: lin(torch.ones(4, 5)))          # raised by torch.nn, not by a collective
    assert classify_failure(exc) == StepFailure.USER


def test_autograd_errors_outside_a_distributed_job_are_user_errors():
    exc = _caught(lambda: torch.ones(2).sum().backward())   # no grad: raised by autograd, no world
    assert classify_failure(exc) == StepFailure.USER
