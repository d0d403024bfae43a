"""Preemption: SIGTERM (or SIGUSR1, which SLURM can send ahead of time with --signal) asks the
run to save a checkpoint at the current step and exit cleanly. Under torchrun --max_restarts
only SIGUSR1 does (see preemption_signals).

Signals reach ranks at slightly different moments, so the handler only sets a flag; once per
step the ranks agree (a one-element MAX all-reduce) and all stop after the same step. A rank can
therefore stop on a peer's signal before its own arrives: after a stop, close() leaves these
signals ignored, so that a late one cannot kill the rank while it writes its summary and exits.
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist


def preemption_signals() -> tuple[signal.Signals, ...]:
    """SIGUSR1 always. SIGTERM too, unless the launcher restarts failed workers
    (torchrun --max_restarts > 0): its agent stops the surviving ranks with SIGTERM after a
    failure and restarts them, which must not be mistaken for a preemption."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
        return (signal.SIGUSR1,)
    return (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    def __init__(self, device: torch.device):
        self.device = device
        self.signal_name: str | None = None
        self.stopping = False  # some rank got a signal: the run stops after this step
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in preemption_signals():
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def requested(self) -> bool:
        """Whether any rank got a signal (a collective: every rank calls it each step)."""
        flag = torch.tensor([1.0 if self.signal_name else 0.0], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stopping = bool(flag.item())
        return self.stopping

    def close(self) -> None:
        """Restore the previous handlers; after a stop, ignore these signals instead (the
        process is exiting on purpose, and the launcher's SIGKILL still ends a hung one)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if self.stopping else handler)
        self._previous.clear()
