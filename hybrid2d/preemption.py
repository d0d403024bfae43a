"""Preemption: SIGTERM (or SIGUSR1, which SLURM can send ahead of time with --signal) asks the
run to save a checkpoint at the current step and exit cleanly. Under torchrun --max_restarts
only SIGUSR1 does (see preemption_signals). Ctrl-C (SIGINT) does the same, and says so at once;
a second Ctrl-C stops at once, without that checkpoint (KeyboardInterrupt). Before the first
step there is nothing to save: launcher.stop_start_up_on_signals stops the start-up at once, and
this object takes over from it.

Signals reach ranks at slightly different moments, so the handler only sets a flag; once per
step the ranks agree (a one-element MAX all-reduce) and all stop after the same step. A rank can
therefore stop on a peer's signal before its own arrives: after a stop, close() leaves these
signals ignored, so that a late one cannot kill the rank while it writes its summary and exits.

A rank that hangs (stuck in I/O, or in a collective with a hung peer) never reaches the step
boundary where the request is acted on, and only the launcher's SIGKILL after its grace period
would end it, silently. So a signal also arms a watchdog thread: if no step boundary acts on it
within parallel.timeout_s of the last sign of progress (the signal itself, each validation batch,
the start of a checkpoint save), the process prints one line saying so and exits 1: a long
validation or save between the signal and the step boundary is slow, not hung. The thread learns
of the signal through signal.set_wakeup_fd, which the interpreter's C-level handler writes to at
once, even while the main thread waits in a C call and the Python handler cannot run.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from hybrid2d.launcher import handler_before_start_up, preemption_signals

_CTRL_C = "\nCtrl-C: stopping after this step with a checkpoint (again: stop now, without it)\n"


class Preemption:
    """The stop request (see the module doc). `step` returns the last finished step (for the
    watchdog's line); `timeout_s` bounds how long a signal may wait for a step boundary."""

    def __init__(
        self,
        device: torch.device,
        timeout_s: float | None = None,
        step: Callable[[], int] = lambda: 0,
    ):
        self.device = device
        self.signal_name: str | None = None
        self.stopping = False  # some rank got a signal: the run stops after this step
        self._previous = {}
        self._timeout_s = timeout_s
        self._step = step
        self._acted = threading.Event()  # a step boundary saw the request: disarms the watchdog
        self._progress_at = 0.0  # monotonic time of the last progress() (read by the watchdog)
        self._closed = False
        self._interrupted = False  # a first Ctrl-C came
        self._wakeup = None  # (read socket, write socket, previous wakeup fd)
        self._watchdog: threading.Thread | None = None
        if threading.current_thread() is threading.main_thread():
            for sig in preemption_signals():
                previous = signal.signal(sig, self._handle)  # start-up's ends here
                self._previous[sig] = handler_before_start_up(sig, previous)
            if timeout_s is not None:
                self._start_watchdog()

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            if self._interrupted:
                raise KeyboardInterrupt  # Ctrl-C again: stop now
            self._interrupted = True
            if int(os.environ.get("RANK", 0)) == 0:  # os.write: safe inside a handler
                os.write(2, _CTRL_C.encode())
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def progress(self) -> None:
        """Work between step boundaries is moving (a validation batch, a save starting): a
        watchdog armed by a signal waits timeout_s from now rather than from the signal."""
        self._progress_at = time.monotonic()

    def requested(self) -> bool:
        """Whether any rank got a signal (a collective: every rank calls it each step)."""
        flag = torch.tensor([1.0 if self.signal_name else 0.0], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stopping = bool(flag.item())
        if self.stopping:
            self._acted.set()
        return self.stopping

    def close(self) -> None:
        """Restore the previous handlers; after a stop, ignore these signals instead (the
        process is exiting on purpose, and the launcher's SIGKILL still ends a hung one), except
        Ctrl-C, which stays the user's way to stop at once."""
        for sig, handler in self._previous.items():
            ignore = self.stopping and sig != signal.SIGINT
            signal.signal(sig, signal.SIG_IGN if ignore else handler)
        self._previous.clear()
        self._stop_watchdog()

    # -- the watchdog --------------------------------------------------------------------------

    def _start_watchdog(self) -> None:
        read, write = socket.socketpair()
        read.setblocking(False)
        write.setblocking(False)
        try:
            previous = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter
            read.close()
            write.close()
            return
        if previous != -1:  # someone else (an event loop) listens there: leave it to them
            signal.set_wakeup_fd(previous)
            read.close()
            write.close()
            return
        self._wakeup = (read, write, previous)
        self._watchdog = threading.Thread(
            target=self._watch, args=(read,), name="hybrid2d-preemption-watchdog", daemon=True
        )
        self._watchdog.start()

    def _stop_watchdog(self) -> None:
        if self._wakeup is None:
            return
        read, write, previous = self._wakeup
        self._wakeup = None
        self._closed = True
        signal.set_wakeup_fd(previous)
        try:
            write.send(b"\0")  # wake the thread: it sees _closed and returns
        except OSError:
            pass
        self._watchdog.join()
        read.close()
        write.close()

    def _watch(self, read: socket.socket) -> None:
        ours = {int(sig) for sig in self._previous}
        armed: tuple[float, int, int] | None = None  # (deadline, signal, step then running)
        while not self._closed:
            wait = None if armed is None else max(0.0, armed[0] - time.monotonic())
            ready, _, _ = select.select([read], [], [], wait)
            if ready:
                try:
                    data = read.recv(4096)
                except BlockingIOError:
                    data = b""
                got = [b for b in data if b in ours]
                if got and armed is None and not self._acted.is_set():
                    deadline = time.monotonic() + self._timeout_s
                    armed = (deadline, got[0], self._step() + 1)
                continue
            if armed is not None and not self._acted.is_set() and not self._closed:
                moved = self._progress_at + self._timeout_s
                if moved > armed[0]:  # progress since: wait timeout_s from the last of it
                    armed = (moved, *armed[1:])
                    continue
                self._give_up(*armed[1:])
            armed = None  # acted on in time: nothing left to watch

    def _give_up(self, signum: int, step: int) -> None:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        print(
            f"rank {rank}: got {signal.Signals(signum).name} but step {step} did not finish "
            f"within {self._timeout_s:g} s; exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
