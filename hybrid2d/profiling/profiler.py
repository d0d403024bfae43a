"""The training loop's memory profiler: `--profile.memory` and `--profile.snapshot`.

The trainer makes one `MemoryProfiler`, given the mesh, model and optimizer it measures, and
calls it at four places: `step(n)` around step n's `train_step`, `scalars()` for TensorBoard,
`close()` in its `finally`, and `write_report()` once training ended normally. With both
settings off every call is a no-op.

- `--profile.memory`: each rank measures each step (`measure.measure_step`) and writes
  `RUN/memory/rank{r}.json` (every step's figures and this rank's estimate); rank 0 logs
  `memory/*` scalars and, at the end, writes `RUN/memory/memory_report.{md,html}` with the
  measured figures of every rank next to the estimate.
- `--profile.snapshot` (CUDA): records the caching allocator's history from the start and dumps
  `RUN/memory/snapshot_rank{r}.pickle` at the end; open it at https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys

import torch
import torch.distributed as dist

from hybrid2d.config import resolve_mixed_precision
from hybrid2d.layout import RunLayout
from hybrid2d.planner.launch import packed_documents
from hybrid2d.planner.memory import GiB, estimates_per_rank
from hybrid2d.profiling.measure import CATEGORIES, measure_step
from hybrid2d.profiling.report import Entry, Report, write


class MemoryProfiler:
    def __init__(self, cfg, mesh, model, optimizer, run_dir: str):
        self.cfg = cfg
        self.mesh = mesh
        self.model = model
        self.optimizer = optimizer
        self.enabled = bool(cfg.profile.memory)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.dir = os.path.join(run_dir, "memory")
        self.records: list[dict] = []
        self.snapshot = bool(cfg.profile.snapshot) and self.mesh.device.type == "cuda"
        if cfg.profile.snapshot and not self.snapshot and self.rank == 0:
            print(
                "profile.snapshot needs CUDA (it records the caching allocator); on "
                f"{self.mesh.device.type} use profile.memory for per-rank figures",
                file=sys.stderr,
                flush=True,
            )
        if self.enabled or self.snapshot:
            os.makedirs(self.dir, exist_ok=True)
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000)

    @contextlib.contextmanager
    def step(self, number: int):
        """Around `train_step` of step `number`: measure it (when enabled)."""
        if not self.enabled:
            yield
            return

        with measure_step(self.model, self.optimizer, number, self.rank) as result:
            yield
        self.records.append(result[0].to_dict())

    def tensor_peak(self) -> int | None:
        """This rank's largest tensor peak over the measured steps (None when not enabled)."""
        return max((r["peak"] for r in self.records), default=None) if self.enabled else None

    def scalars(self) -> dict[str, float]:
        """memory/* figures of the last measured step of this rank, in GiB."""
        if not self.enabled or not self.records:
            return {}
        r = self.records[-1]
        out = {f"memory/{k}_gib": r[k] / GiB for k in CATEGORIES}
        out["memory/tensors_peak_gib"] = r["peak"] / GiB
        out["memory/rss_gib"] = r["rss"] / GiB
        if r["device_peak"]:
            out["memory/device_allocated_peak_gib"] = r["device_peak"] / GiB
            out["memory/device_reserved_peak_gib"] = r["device_reserved_peak"] / GiB
        return out

    def close(self) -> None:
        """Write this rank's figures (and snapshot); safe in a `finally`, no collectives."""
        if self.snapshot:
            path = os.path.join(self.dir, f"snapshot_rank{self.rank}.pickle")
            torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot = False
        if not self.enabled:
            return
        data = {
            "rank": self.rank,
            "world_size": self.world,
            "mesh": {k: getattr(self.mesh, k) for k in ("dp_replicate", "dp_shard", "tp")},
            "device": self.mesh.device.type,
            "steps": self.records,
        }
        with open(os.path.join(self.dir, f"rank{self.rank}.json"), "w") as f:
            json.dump(data, f, indent=1)

    def write_report(self) -> tuple[str, str] | None:
        """After a normal end: rank 0 writes the report from every rank's JSON (a barrier)."""
        if not self.enabled:
            return None
        self.close()
        if dist.is_initialized():
            dist.barrier()
        if self.rank != 0:
            return None

        m = self.mesh
        try:
            documents = packed_documents(self.cfg)  # packed rows: their masks are priced
            estimates = estimates_per_rank(self.cfg, m.layout, m.device.type, documents)
        except Exception as e:  # the estimate is an extra; never fail a run because of it
            print(f"memory estimate unavailable: {e}", file=sys.stderr, flush=True)
            estimates = []
        measured = load_measured(os.path.dirname(self.dir))
        entry = Entry(str(m.layout), estimates[0] if estimates else None, estimates, None, measured)
        rep = Report(
            title=f"Memory of {self.cfg.recipe} on {m.device.type}, {self.world} ranks",
            summary=summary_rows(self.cfg, m.layout, m.device.type),
            entries=[entry],
            notes=[
                "measured: the last step of each rank, by tensor accounting "
                "(hybrid2d.profiling.measure); CPU RSS is in rank*.json",
            ],
        )
        paths = write(rep, self.dir)
        print(f"memory report: {paths[1]}", flush=True)
        return paths


def load_measured(run_dir: str) -> list[dict]:
    """The last step's StepMemory dict of each rank of the newest launch, from
    RUN/memory/rank*.json. A resume on fewer ranks leaves the earlier launch's higher ranks'
    files behind; rank 0's file, written by every launch, gives the world and mesh that count."""
    files = {}
    for path in glob.glob(os.path.join(run_dir, "memory", "rank*.json")):
        with open(path) as f:
            files[path] = json.load(f)
    newest = files.get(os.path.join(run_dir, "memory", "rank0.json"))
    out = []
    for data in files.values():
        if newest is None or (
            data.get("world_size") == newest.get("world_size")
            and data.get("mesh") == newest.get("mesh")
            and data.get("rank", 0) < newest.get("world_size", 1)
        ):
            out += data["steps"][-1:]
    return sorted(out, key=lambda r: r["rank"])


def summary_rows(cfg, layout: RunLayout, target: str) -> list[tuple[str, str]]:
    m, t, p = layout.model, cfg.train, cfg.parallel
    mp = resolve_mixed_precision(p.mixed_precision, target)
    return [
        ("recipe", cfg.recipe),
        ("parameters", f"{m.num_params() / 1e6:,.1f}M"),
        (
            "model",
            f"dim {m.dim}, {m.n_layers} layers, {m.n_heads}/{m.n_kv_heads} heads, "
            f"ffn {m.ffn_dim}, vocab {m.vocab_size}",
        ),
        (
            "batch",
            f"global {t.global_batch}, micro "
            f"{layout.micro_batch if layout.n_micro > 1 else 'whole per-rank batch'}, "
            f"sequence {t.seq_len}",
        ),
        ("precision", f"{mp} ({target})"),
        ("activation checkpointing", layout.activation_checkpoint),
        ("optimizer", t.optimizer),
    ]
