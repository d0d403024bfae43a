"""Preemption signals in one process: a signal becomes a stop request, and after a stop a late
signal (a peer's stop reached this rank before its own signal did) must not kill the rank.
A signal that no step boundary acts on within timeout_s (a hung rank) ends the process with
one line; one that is acted on leaves the process alone however long the save then takes."""

import os
import signal
import subprocess
import sys

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


WATCHDOG = """
import os, signal, sys, threading, time
import torch
from hybrid2d.preemption import Preemption
timeout_s, how = float(sys.argv[1]), sys.argv[2]
p = Preemption(torch.device("cpu"), timeout_s, step=lambda: 3)
os.kill(os.getpid(), signal.SIGTERM)
if how == "hang":  # as a rank whose peer hangs: alive, never back at a step boundary
    threading.Event().wait()
assert p.requested()  # the step boundary acts on it: saving may then take longer
time.sleep(3 * timeout_s)
p.close()
print("finished the save and exited")
"""


def run_watchdog(how: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WATCHDOG, "1", how],
        capture_output=True,
        text=True,
        timeout=120,  # hang guard
        env={k: v for k, v in os.environ.items() if k != "RANK"},
    )


def test_a_signal_no_step_boundary_acts_on_ends_the_process_with_one_line():
    r = run_watchdog("hang")
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert r.stderr == "rank 0: got SIGTERM but step 4 did not finish within 1 s; exiting\n"


def test_a_signal_acted_on_at_a_step_boundary_disarms_the_watchdog():
    r = run_watchdog("acts")
    assert r.returncode == 0 and r.stdout == "finished the save and exited\n", r.stderr


PROGRESS = """
import os, signal, sys, time
import torch
from hybrid2d.preemption import Preemption
p = Preemption(torch.device("cpu"), 2.0, step=lambda: 3)
os.kill(os.getpid(), signal.SIGTERM)
for _ in range(20):  # a validation or save after the signal: 5 s, a tick every 0.25 s
    time.sleep(0.25)
    p.progress()
print("alive after 5 s of progress", flush=True)
time.sleep(60)  # then no progress: hung
print("not reached", flush=True)
"""


def test_progress_after_a_signal_holds_the_watchdog_off_until_it_stops():
    """A signal during a validation or save longer than timeout_s does not end the rank while
    batches / saves keep coming; timeout_s without progress still does, with the same line."""
    r = subprocess.run(
        [sys.executable, "-c", PROGRESS],
        capture_output=True,
        text=True,
        timeout=120,  # hang guard
        env={k: v for k, v in os.environ.items() if k != "RANK"},
    )
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert r.stdout == "alive after 5 s of progress\n"  # not "not reached": the watchdog ended it
    assert r.stderr == "rank 0: got SIGTERM but step 4 did not finish within 2 s; exiting\n"


def test_close_stops_the_watchdog_and_restores_the_wakeup_fd(saved_handlers):
    p = Preemption(torch.device("cpu"), timeout_s=60)
    watchdog = p._watchdog
    assert watchdog is not None and watchdog.is_alive()
    p.close()
    assert not watchdog.is_alive()
    assert signal.set_wakeup_fd(-1) == -1
