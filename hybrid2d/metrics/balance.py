"""Load balance over the mesh: every rank's step breakdown (a `StepClock`), gathered on logged
steps with one all-gather of a small float tensor, read on rank 0 into the figures of a line of
`<run_dir>/balance.jsonl` (docs/monitoring.md), TensorBoard scalars, straggler warnings, and
the summary's aggregate.

A tp group waits for its slowest rank in every collective, and a dp group for its slowest tp
group, so one slow device or host slows the whole mesh and shows on the others only as waiting.
Compute (the breakdown's part that excludes waiting) is what names it: the slowest rank's
against the median rank's, and per mesh dim the index whose ranks are slowest.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

from hybrid2d.config import JobConfig
from hybrid2d.mesh import Mesh, print0
from hybrid2d.metrics.step_clock import PHASES, StepClock
from hybrid2d.metrics.writer import MetricsWriter

DIMS = ("dp_replicate", "dp_shard", "tp")
FILE = "balance.jsonl"
# Per-rank TensorBoard scalars up to this many ranks; beyond, the aggregate figures only (six
# scalars per rank on every log would make rank 0, which the others wait for, the slow one).
PER_RANK_SCALARS = 64
# The floats each rank contributes, in this order; -1 stands for null (no such figure).
_FIELDS = (
    "step_s",
    *(f"{p}_s" for p in PHASES),
    "other_s",
    "cpu_s",
    "device_util",
    "device_mem_bytes",
)


def mesh_coords(mesh: Mesh) -> list[list[int]]:
    """[dp_replicate, dp_shard, tp] index of every global rank, by rank."""
    ranks = mesh.mesh.mesh  # the DeviceMesh's tensor of global ranks, shaped like the mesh
    coords: list[list[int]] = [[] for _ in range(ranks.numel())]
    for r in range(ranks.shape[0]):
        for s in range(ranks.shape[1]):
            for t in range(ranks.shape[2]):
                coords[int(ranks[r, s, t])] = [r, s, t]
    return coords


def _ratio(value: float, median: float) -> float:
    return value / median if median > 0 else 1.0


def balance_figures(ranks: list[dict]) -> dict:
    """The slowest rank's compute over the median rank's, which rank and host that is, and per
    mesh dim the index whose ranks are slowest: each index's group counts as slow as its slowest
    rank (its peers wait for it), against the median group. `ranks`: one dict per rank with
    `rank`, `host`, `coords`, `compute_s`."""
    computes = [r["compute_s"] for r in ranks]
    median = statistics.median(computes)
    slowest = max(ranks, key=lambda r: r["compute_s"])
    per_dim = {}
    for d, name in enumerate(DIMS):
        groups: dict[int, float] = {}
        for r in ranks:
            index = r["coords"][d]
            groups[index] = max(groups.get(index, 0.0), r["compute_s"])
        index = max(groups, key=groups.get)
        per_dim[name] = {
            "index": index,
            "max_over_median": _ratio(groups[index], statistics.median(groups.values())),
        }
    hosts: dict[str, float] = {}
    for r in ranks:
        hosts[r["host"]] = max(hosts.get(r["host"], 0.0), r["compute_s"])
    host = max(hosts, key=hosts.get)
    return {
        "compute_max_over_median": _ratio(slowest["compute_s"], median),
        "compute_median_s": median,
        "slowest_rank": slowest["rank"],
        "slowest_host": slowest["host"],
        "per_dim": per_dim,
        "per_host": {
            "host": host,
            "max_over_median": _ratio(hosts[host], statistics.median(hosts.values())),
        },
    }


class StragglerWatch:
    """Names a rank whose compute stays more than `margin` above the median rank's for `logs`
    consecutive logged steps: once, and again only when its compute over the median grew by
    the margin again (x 1.2 for 0.2) since it was last named."""

    def __init__(self, margin: float, logs: int):
        self.margin = margin
        self.logs = logs
        self.excess: dict[int, list[float]] = {}  # rank -> its last `logs` excesses
        self.named: dict[int, float] = {}  # rank -> the excess it was last named with

    def update(self, ranks: list[dict], median: float) -> tuple[list[dict], list[dict]]:
        """(stragglers now, the ones to warn about now), each {rank, host, coords, excess}:
        excess = the least compute / median - 1 over the window."""
        now, warn = [], []
        for r in ranks:
            seen = self.excess.setdefault(r["rank"], [])
            seen.append(_ratio(r["compute_s"], median) - 1)
            del seen[: -self.logs]
            if len(seen) < self.logs or min(seen) <= self.margin:
                continue
            entry = {k: r[k] for k in ("rank", "host", "coords")} | {"excess": min(seen)}
            now.append(entry)
            last = self.named.get(r["rank"])
            if last is None or 1 + entry["excess"] > (1 + last) * (1 + self.margin):
                self.named[r["rank"]] = entry["excess"]
                warn.append(entry)
        return now, warn


def straggler_line(s: dict, compute: float, median: float, steps: int, margin: float) -> str:
    """The warning: who, where on the mesh, its compute now and the least excess it held."""
    coords = " ".join(f"{d}={i}" for d, i in zip(DIMS, s["coords"], strict=True))
    return (
        f"warning: straggler rank {s['rank']} (host {s['host']}, mesh {coords}): compute "
        f"{compute:.3g} s/step against the median rank's {median:.3g} s, at least "
        f"+{s['excess']:.0%} over the median for the last {steps} steps "
        f"(metrics.straggler_margin {margin:g})"
    )


def _device_util(device: torch.device):
    """(utilisation %, memory bytes) of this rank's device now; (None, None) off CUDA. NVML
    through torch.cuda.utilization (needs nvidia-ml-py; without it utilisation is None)."""
    if device.type != "cuda":
        return None, None
    try:
        util = float(torch.cuda.utilization(device))
    except Exception:  # noqa: BLE001 - no NVML: utilisation unknown, memory still read
        util = None
    return util, torch.cuda.memory_reserved(device)


class BalanceMonitor:
    """Every rank calls `after_step(step)` after each step; on logged steps (every
    metrics.log_every and the last) the breakdowns are gathered and rank 0 writes them."""

    def __init__(
        self, cfg: JobConfig, mesh: Mesh, clock: StepClock, writer: MetricsWriter, run_dir
    ):
        m = cfg.metrics
        self.enabled = m.balance
        self.clock = clock
        self.mesh = mesh
        self.writer = writer
        self.log_every = m.log_every
        self.steps = cfg.train.steps
        self.margin = m.straggler_margin
        self.window = max(m.straggler_window, m.log_every)
        self.watch = StragglerWatch(m.straggler_margin, math.ceil(self.window / m.log_every))
        self.main = dist.get_rank() == 0
        self.path = os.path.join(run_dir, FILE) if run_dir and self.main else None
        self.logs: list[dict] = []  # rank 0: every line written
        self.warned: list[dict] = []  # rank 0: every straggler warning, with its step
        self.covered: list[int] = []  # rank 0: the steps each line averages over
        if not self.enabled:
            return
        self.hosts = [None] * dist.get_world_size()  # once: host names never change
        dist.all_gather_object(self.hosts, socket.gethostname())
        self.coords = mesh_coords(mesh)

    def after_step(self, step: int) -> None:
        if not self.enabled or not (step % self.log_every == 0 or step == self.steps):
            return
        own = self.clock.take()
        util, memory = _device_util(self.mesh.device)
        own |= {"device_util": util, "device_mem_bytes": memory}
        values = [-1.0 if own[k] is None else float(own[k]) for k in _FIELDS]
        mine = torch.tensor(values, dtype=torch.float64, device=self.mesh.device)
        every = torch.empty(
            dist.get_world_size() * len(values), dtype=mine.dtype, device=mine.device
        )
        dist.all_gather_single(every, mine)
        if self.main:
            self.covered.append(own["steps"])
            self._log(step, every.view(-1, len(values)).tolist())

    def _log(self, step: int, rows: list[list[float]]) -> None:
        ranks = []
        for rank, row in enumerate(rows):
            entry = {"rank": rank, "host": self.hosts[rank], "coords": self.coords[rank]}
            for key, value in zip(_FIELDS, row, strict=True):
                entry[key] = None if value < 0 and key.startswith("device") else value
            if entry["device_mem_bytes"] is not None:
                entry["device_mem_bytes"] = int(entry["device_mem_bytes"])
            ranks.append(entry)
        figures = balance_figures(ranks)
        stragglers, warn = [], []
        if self.logs:  # the launch's first log holds its warm-up step: not judged
            stragglers, warn = self.watch.update(ranks, figures["compute_median_s"])
        for s in warn:
            median, compute = figures["compute_median_s"], ranks[s["rank"]]["compute_s"]
            print0(straggler_line(s, compute, median, self.window, self.margin))
            self.warned.append(s | {"step": step})
        line = {
            "step": step,
            "time": time.time(),
            "mesh": {d: getattr(self.mesh, d) for d in DIMS},
            "ranks": ranks,
            "balance": figures,
            "stragglers": stragglers,
        }
        self.logs.append(line)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
        self._scalars(step, ranks, figures)

    def _scalars(self, step: int, ranks: list[dict], figures: dict) -> None:
        values = {
            "balance/compute_max_over_median": figures["compute_max_over_median"],
            "balance/slowest_rank": figures["slowest_rank"],
        }
        for d in DIMS:
            values[f"balance/{d}_max_over_median"] = figures["per_dim"][d]["max_over_median"]
        for r in ranks if len(ranks) <= PER_RANK_SCALARS else ():
            for key in ("step_s", "compute_s", "comm_s", "data_s", "cpu_s", "device_util"):
                if r[key] is not None:
                    values[f"ranks/{key}/{r['rank']}"] = r[key]
        self.writer.scalars(step, values)

    def summary(self) -> dict | None:
        """summary.json's `balance` (rank 0; None elsewhere or when off): per rank, its parts
        averaged over the logged steps (weighted by the steps each covers); the mean and worst
        compute max/median; the rank most often slowest; every straggler warning."""
        if not self.enabled or not self.logs:
            return None
        keys = [k for k in _FIELDS if not k.startswith("device")]
        n = self.covered
        ranks = []
        for i, first in enumerate(self.logs[0]["ranks"]):
            entry = {k: first[k] for k in ("rank", "host", "coords")}
            for k in keys:
                weighted = sum(
                    line["ranks"][i][k] * w for line, w in zip(self.logs, n, strict=True)
                )
                entry[k] = weighted / (sum(n) or 1)
            ranks.append(entry)
        ratios = [line["balance"]["compute_max_over_median"] for line in self.logs]
        slowest = [line["balance"]["slowest_rank"] for line in self.logs]
        rank = max(set(slowest), key=slowest.count)
        return {
            "logs": len(self.logs),
            "compute_max_over_median": sum(ratios) / len(ratios),
            "worst_compute_max_over_median": max(ratios),
            "slowest_rank": rank,
            "slowest_host": self.hosts[rank],
            "slowest_coords": self.coords[rank],
            "ranks": ranks,
            "stragglers": self.warned,
        }
