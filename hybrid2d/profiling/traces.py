"""`--profile.trace_steps A-B`: torch.profiler traces of steps A to B on every rank, and what
they say per rank (compute, communication, overlap, idle), printed at the end of the run.

The trainer makes one `StepTraces` and calls it at three places: `step(n)` around step n (the
batch and `train_step`), `close()` in its `finally` and `report()` once training ended
normally. With the setting off each call is a no-op.

Each rank writes `RUN/traces/rank{r}.pt.trace.json` (chrome trace format: Perfetto,
chrome://tracing, TensorBoard's profile plugin), steps marked `ProfilerStep#n` as torch's own
schedule marks them. `report()` reads back each rank's own file (`breakdown`), gathers the
figures on rank 0 (one small collective: files may be on node-local disks), writes
`RUN/traces/breakdown.json` and prints the table.

How a trace is read (`breakdown`): inside the marked steps, communication is every interval a
collective runs (by name: nccl / gloo / c10d ops, functional collectives and their waits), on
any thread or stream; compute is what runs on the compute lanes outside the collectives nested
in it. With device events (CUDA kernels) only they count and the lanes are the device's
streams (the host's ops only queue them); on the CPU the lane is the thread that runs the
steps, so compute is its torch ops and idle is Python, the loader and anything else between
ops. Overlap is communication that runs while compute runs (FSDP's prefetches on gloo's worker
threads or nccl streams). compute + comm - overlap + idle = wall.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import sys

import torch
import torch.distributed as dist

STEP_MARK = "ProfilerStep#"  # what torch.profiler's schedule names a step; TensorBoard reads it

# A collective or the wait for one, by the names torch, gloo and nccl give them in a trace: the
# ops of c10d's namespaces (the process group's and the functional collectives with their
# wait_tensor), gloo's and nccl's own events and kernels, torch's record_param_comms. Only
# these namespaces: an autograd Function named after a collective runs other ops as well.
COLLECTIVE = re.compile(r"^(c10d::|_?c10d_functional::|gloo:|nccl|record_param_comms)", re.I)
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
PARTS = ("wall_s", "compute_s", "comm_s", "overlap_s", "idle_s")


class StepTraces:
    """torch.profiler on from the start of step A to the end of step B of `steps` (None: off)."""

    def __init__(self, steps: tuple[int, int] | None, run_dir: str):
        self.steps = steps
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.dir = os.path.join(run_dir, "traces")
        self.path = os.path.join(self.dir, f"rank{self.rank}.pt.trace.json")
        self.profiler: torch.profiler.profile | None = None
        self.traced: list[int] = []

    @contextlib.contextmanager
    def step(self, number: int):
        """Around step `number`: start the profiler at step A, mark the step, stop after B."""
        if self.steps is None or not self.steps[0] <= number <= self.steps[1]:
            yield
            return
        if self.profiler is None:
            os.makedirs(self.dir, exist_ok=True)
            # Every activity this build supports: the CPU, and the accelerator's kernels.
            self.profiler = torch.profiler.profile()
            self.profiler.start()
        with torch.profiler.record_function(f"{STEP_MARK}{number}"):
            yield
        self.traced.append(number)
        if number == self.steps[1]:
            self.close()

    def close(self) -> None:
        """Stop and write this rank's trace (a run stopped inside the range keeps what ran)."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler.export_chrome_trace(self.path)
            self.profiler = None

    def report(self) -> list[dict] | None:
        """After a normal end: every rank's breakdown on rank 0, written and printed (rank 0
        returns the rows, the others None). A collective over the default group."""
        if self.steps is None:
            return None
        self.close()
        mine = None
        if self.traced:
            try:  # a trace this rank cannot read back must not leave the others waiting
                with open(self.path) as f:
                    mine = {"rank": self.rank} | breakdown(json.load(f))
            except (OSError, ValueError) as e:
                print(f"rank {self.rank}: trace {self.path} not read: {e}", file=sys.stderr)
        rows = [mine]
        if dist.is_initialized():
            rows = [None] * dist.get_world_size() if self.rank == 0 else None
            dist.gather_object(mine, rows, dst=0)
        if self.rank != 0:
            return None
        missing = [rank for rank, r in enumerate(rows) if r is None]
        rows = [r for r in rows if r is not None]
        if rows:
            with open(os.path.join(self.dir, "breakdown.json"), "w") as f:
                json.dump({"steps": list(self.steps), "ranks": rows}, f, indent=1)
        table = format_table(rows, self.steps, self.dir)
        if rows and missing:
            table += f"\n  no figures from rank(s) {_ranks_text(missing)} (see their stderr)"
        print(table, flush=True)
        return rows


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (
        f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    )


# ---- reading a trace ---------------------------------------------------------------------------


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]):
    """Intersection of two unions (sorted, disjoint spans)."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(x: list[tuple[float, float]], y: list[tuple[float, float]]):
    """x without y (both unions)."""
    out, j = [], 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k = j
        while k < len(y) and y[k][0] < b:
            if y[k][0] > a:
                out.append((a, y[k][0]))
            a = max(a, y[k][1])
            k += 1
        if a < b:
            out.append((a, b))
    return out


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def breakdown(trace: dict) -> dict:
    """Seconds of wall, compute, communication, overlap and idle over the steps marked in a
    chrome trace (`STEP_MARK`), with the steps and the collectives that took longest."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    marks = [
        e for e in events if e["name"].startswith(STEP_MARK) and e.get("cat") == "user_annotation"
    ]
    if not marks:
        return {"steps": [], **dict.fromkeys(PARTS, 0.0), "lanes": "none", "collectives": {}}
    windows = _union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in marks])
    main = (marks[0]["pid"], marks[0]["tid"])
    on_device = any(e.get("cat") in DEVICE_CATEGORIES for e in events)

    def span(e):
        return float(e["ts"]), float(e["ts"]) + float(e["dur"])

    # compute and communication per lane (a thread or stream): a collective nested in an op of
    # the same lane (autograd's backward node issuing it) is taken out of that op's compute
    compute: dict[tuple, list] = {}
    comm_on: dict[tuple, list] = {}
    comm, by_name = [], {}
    for e in events:
        cat, collective = e.get("cat"), COLLECTIVE.search(e["name"])
        # gloo marks its work on its worker threads as annotations, not ops
        if cat not in ("cpu_op", *DEVICE_CATEGORIES) and not (
            collective and cat == "user_annotation"
        ):
            continue
        if on_device and cat not in DEVICE_CATEGORIES:
            continue  # the host only queues the device's work (its c10d ops launch kernels)
        lane = (e["pid"], e["tid"])
        on_lane = on_device or lane == main
        if collective:
            comm.append(span(e))
            by_name.setdefault(e["name"], []).append(span(e))
            comm_on.setdefault(lane, []).append(span(e))
        elif on_lane:
            compute.setdefault(lane, []).append(span(e))
    comm_u = _intersect(_union(comm), windows)
    lanes = [_subtract(_union(s), _union(comm_on.get(k, []))) for k, s in compute.items()]
    compute_u = _intersect(_union([x for spans in lanes for x in spans]), windows)
    overlap = _length(_intersect(compute_u, comm_u))
    wall = _length(windows)
    busy = _length(compute_u) + _length(comm_u) - overlap
    names = {n: _length(_intersect(_union(s), windows)) / 1e6 for n, s in by_name.items()}
    top = dict(sorted(names.items(), key=lambda kv: -kv[1])[:5])
    return {
        "steps": sorted(int(e["name"][len(STEP_MARK) :]) for e in marks),
        "wall_s": wall / 1e6,
        "compute_s": _length(compute_u) / 1e6,
        "comm_s": _length(comm_u) / 1e6,
        "overlap_s": overlap / 1e6,
        "idle_s": (wall - busy) / 1e6,
        "lanes": "device streams" if on_device else "the step's CPU thread",
        "collectives": top,
    }


def format_table(rows: list[dict], steps: tuple[int, int], where: str) -> str:
    """The per-rank table printed at the end; beyond 16 ranks the median, the extremes and
    the 8 ranks that spend the most time outside compute."""
    a, b = steps
    lines = [
        f"traces of steps {a}-{b}: {where}/rank*.pt.trace.json (https://ui.perfetto.dev); "
        f"per rank, seconds over the {b - a + 1} step(s):"
    ]
    if not rows:
        return lines[0] + " none recorded (no step of the range ran in this launch)"
    head = f"  {'rank':>6s} {'wall':>8s} {'compute':>8s} {'comm':>8s} {'overlap':>8s} {'idle':>8s}"
    lines.append(head + "  longest collective")

    def line(label, r):
        top = next(iter(r.get("collectives") or {}), "-")
        figures = "".join(f" {r[k]:8.3f}" for k in PARTS)
        return f"  {label:>6s}{figures}  {top}"

    shown = rows
    if len(rows) > 16:
        shown = sorted(rows, key=lambda r: r["compute_s"] / max(r["wall_s"], 1e-9))[:8]
        shown.sort(key=lambda r: r["rank"])
        for name, pick in (("min", min), ("median", statistics.median), ("max", max)):
            lines.append(line(name, {k: pick(r[k] for r in rows) for k in PARTS}))
        lines.append(f"  the 8 of {len(rows)} ranks with the least compute share:")
    lines += [line(str(r["rank"]), r) for r in shown]
    lanes = rows[0]["lanes"]
    lines.append(
        f"  compute: ops on {lanes} outside collectives; comm: collectives on any thread or "
        "stream; overlap: both at once; idle: neither"
        + (" (on CPU: Python, the loader, waits between ops)" if "CPU" in lanes else "")
    )
    return "\n".join(lines)
