"""Preemption signals in one process: a signal becomes a stop request, and after a stop a late
signal (a peer's stop reached this rank before its own signal did) must not kill the rank."""

import os
import signal

import pytest
import torch

from hybrid2d.preemption import Preemption


@pytest.fixture
def saved_handlers():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield before
    for sig, handler in before.items():
        signal.signal(sig, handler)


def test_signal_requests_a_stop_and_a_late_one_is_ignored(saved_handlers):
    p = Preemption(torch.device("cpu"))
    assert not p.requested()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert p.requested() and p.signal_name == "SIGUSR1"
    p.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGTERM)  # the default action would end pytest here
    os.kill(os.getpid(), signal.SIGUSR1)


def test_without_a_stop_close_restores_the_previous_handlers(saved_handlers):
    p = Preemption(torch.device("cpu"))
    assert signal.getsignal(signal.SIGTERM) is not saved_handlers[signal.SIGTERM]
    assert not p.requested()
    p.close()
    for sig, handler in saved_handlers.items():
        assert signal.getsignal(sig) is handler
