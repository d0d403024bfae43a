"""Where one rank's step time goes, always on and without a profiler: compute, waiting in
collectives (exposed communication), data, optimizer, checkpoint, and the rest.

The loop marks phases (`with clock.phase("data"): ...`); the clock adds up, per phase, the wall
time on CPU (time.perf_counter) or the device time on CUDA (torch.cuda.Event pairs on the
current stream, read once at `take`, where the caller synchronises anyway). Time the transport
reports as spent blocked waiting for peers (`mesh.collective_wait_clock`: the shared-memory backend
counts it in every collective it serves, FSDP's and tensor parallelism's included) is moved from
the phase it happened in to `comm`; elsewhere `comm` is the phases the caller marks as such (the
step's own reductions). The parts add up to the step: `other` is what no phase covers.

`HYBRID2D_TEST_SLOW_RANK=RANK:SECONDS` (tests and drills only) makes that global rank sleep
SECONDS at the start of each step's compute, a slow GPU or host seen from outside the trainer;
read once, when the clock is made.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from hybrid2d.errors import ConfigError
from hybrid2d.mesh import collective_wait_clock

PHASES = ("compute", "comm", "data", "optimizer", "checkpoint")
SLOW_RANK_ENV = "HYBRID2D_TEST_SLOW_RANK"


def injected_delay(rank: int) -> float:
    """Seconds this rank sleeps per step by `HYBRID2D_TEST_SLOW_RANK` (0 when not named)."""
    spec = os.environ.get(SLOW_RANK_ENV, "")
    if not spec:
        return 0.0
    try:
        named, seconds = spec.split(":")
        named_rank, delay = int(named), float(seconds)
    except ValueError:
        named_rank, delay = -1, -1.0
    if named_rank < 0 or not 0 <= delay < 3600:
        raise ConfigError(
            f"{SLOW_RANK_ENV}={spec!r} is not RANK:SECONDS (e.g. 3:0.5: rank 3 sleeps 0.5 s "
            "per step); unset it for a normal run"
        )
    return delay if named_rank == rank else 0.0


class _Phase:
    """One phase's `with` block; reused, so marking a phase allocates nothing on CPU."""

    __slots__ = ("clock", "name", "start", "waited", "event")

    def __init__(self, clock: StepClock, name: str):
        self.clock, self.name = clock, name

    def __enter__(self):
        self.clock._enter(self)

    def __exit__(self, *exc):
        self.clock._exit(self)


class _Off:
    def __enter__(self):
        pass

    def __exit__(self, *exc):
        pass


_OFF = _Off()


class StepClock:
    """Phase times of this rank's steps, averaged per step by `take` (every logged step).
    Phases do not nest; `begin_step` / `end_step` bound a step. Disabled: every call is a no-op."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.delay = injected_delay(rank)
        self._waited = collective_wait_clock()
        self._phases = {name: _Phase(self, name) for name in PHASES}
        self._open = False  # between begin_step and end_step
        self._reset()

    def _reset(self) -> None:
        self.sums = dict.fromkeys(("step", "cpu", *PHASES), 0.0)
        self.steps = 0
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._delayed = False

    def _event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def phase(self, name: str):
        """`with clock.phase(name):` times a phase of the step begun (outside a step: nothing,
        e.g. a train_step a benchmark or the simulation calls on its own)."""
        return self._phases[name] if self.enabled and self._open else _OFF

    def begin_step(self) -> None:
        if not self.enabled:
            return
        self._start = self._phase_start()
        self._cpu = time.process_time()
        self._delayed = False
        self._open = True

    def end_step(self) -> None:
        if not self.enabled or not self._open:
            return
        self._open = False
        self._add("step", self._start, self._phase_start(), moved=False)
        self.sums["cpu"] += time.process_time() - self._cpu
        self.steps += 1

    def _phase_start(self):
        if self.cuda:
            return (self._event(), None)
        return (time.perf_counter(), self._waited() if self._waited else None)

    def _enter(self, p: _Phase) -> None:
        p.start = self._phase_start()
        if p.name == "compute" and self.delay and not self._delayed:
            self._delayed = True  # after the start mark: the sleep counts as this rank's compute
            time.sleep(self.delay)

    def _exit(self, p: _Phase) -> None:
        self._add(p.name, p.start, self._phase_start(), moved=p.name != "comm")

    def _add(self, name: str, start, end, moved: bool) -> None:
        if self.cuda:  # resolved in take(), after one synchronisation
            self._events.append((name, start[0], end[0]))
            return
        (t0, w0), (t1, w1) = start, end
        self.sums[name] += t1 - t0
        if moved and w0 is not None:  # the transport's waits inside this phase are comm
            self.sums[name] -= w1 - w0
            self.sums["comm"] += w1 - w0

    def take(self) -> dict[str, float]:
        """Per-step averages since the last take (`step_s`, each phase's `*_s`, `other_s`,
        `cpu_s`: process CPU time), then start counting again."""
        if self._events:
            torch.cuda.synchronize()
            for name, start, end in self._events:
                self.sums[name] += start.elapsed_time(end) / 1000
        n = max(self.steps, 1)
        out = {f"{name}_s": self.sums[name] / n for name in PHASES}
        out["step_s"] = self.sums["step"] / n
        # What no phase covers (progress, logging, validation); never below 0 from rounding.
        out["other_s"] = max(0.0, out["step_s"] - sum(out[f"{name}_s"] for name in PHASES))
        out["cpu_s"] = self.sums["cpu"] / n
        out["steps"] = self.steps
        self._reset()
        return out
