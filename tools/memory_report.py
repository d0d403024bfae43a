"""Memory per rank of a recipe on one or more meshes: estimated, simulated and measured.

  python tools/memory_report.py --recipe llama3.1-70b --mesh 32x8 --mesh 16x8 --mesh 8x8 \\
      --device-memory 80GiB
  python tools/memory_report.py --recipe llama3.1-8b --mesh 8x8 --simulate
  python tools/memory_report.py --recipe llama-debug --train.micro_batch 2 --mesh 2x2 --target cpu
  python tools/memory_report.py --run-dir runs/llama-debug-2026... [--simulate]

--mesh is DPxTP (FSDP over DP, tensor parallel TP inside a node) or REPLICATExSHARDxTP (HSDP).
Settings of the recipe change as in training (--train.micro_batch 2, --train.seq_len 8192,
--parallel.activation_checkpoint full, ...). --target says what the figures are for: cuda
(default; bf16 mixed precision when the recipe says auto) or cpu (fp32). --simulate also runs
rank 0 of each mesh on this machine over a fake process group (hybrid2d/simulate.py);
when the recipe's micro batch would not fit in this machine's memory it simulates the largest
micro batch that does and says so. --run-dir reads the per-rank figures a run made with
--profile.memory and puts them next to the estimate. A Markdown and an HTML report are written
to --out (default: the run dir, else runs/memory-RECIPE-TIME).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid2d import recipes  # noqa: E402
from hybrid2d.config import ConfigError, JobConfig, apply_overrides  # noqa: E402
from hybrid2d.profiling.estimate import (  # noqa: E402
    Estimate,
    MeshShape,
    estimate,
)
from hybrid2d.profiling.profiler import load_measured, summary_rows
from hybrid2d.profiling.report import CATEGORIES, LABELS, Entry, Report, fmt_bytes, write  # noqa: E402
from hybrid2d.simulate import run_subprocess
from hybrid2d.sizes import parse_size  # noqa: E402

# A simulated rank needs its tensors plus the Python/torch process (~0.5 GiB) and slack.
SIM_MEMORY_FRACTION = 0.6


def parse(argv: list[str]):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 1)[1],
    )
    ap.add_argument("--recipe", default="llama-debug")
    ap.add_argument("--mesh", action="append", default=[], help="DPxTP or RxSxT; repeatable")
    ap.add_argument(
        "--device-memory",
        default=None,
        help="say which meshes fit: 80GiB (80 x 2^30 bytes) or 80GB (80e9)",
    )
    ap.add_argument(
        "--headroom",
        type=float,
        default=0.10,
        help="fraction of device memory kept for the allocator and runtime (0.10)",
    )
    ap.add_argument("--target", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--simulate", action="store_true", help="also simulate rank 0 of each mesh")
    ap.add_argument(
        "--no-skip-compute",
        action="store_true",
        help="simulate with real matmuls (slow; same memory)",
    )
    ap.add_argument("--run-dir", default=None, help="a run made with --profile.memory")
    ap.add_argument("--out", default=None, help="report folder, or a path ending in .md/.html")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    return ap.parse_known_args(argv)


def available_memory() -> int:
    import psutil

    return psutil.virtual_memory().available


def pick_simulation_config(
    cfg: JobConfig, mesh: MeshShape, target: str, budget: int
) -> tuple[JobConfig, str | None]:
    """The config to simulate: `cfg`, or `cfg` with the largest micro batch whose estimate fits
    in `budget` bytes (with a line saying so). Raises ConfigError when none fits."""
    est = estimate(cfg, mesh, 0, target)
    if est.peak <= budget:
        return cfg, None
    local = cfg.train.global_batch // mesh.dp
    current = cfg.train.micro_batch or local
    for mb in sorted((d for d in range(1, current) if local % d == 0), reverse=True):
        trial = JobConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
        trial.train.micro_batch = mb
        smaller = estimate(trial, mesh, 0, target)
        if smaller.peak <= budget:
            return trial, (
                f"simulating mesh {mesh} with train.micro_batch={mb} instead of {current}: the "
                f"estimate for {current} is {fmt_bytes(est.peak)} per rank, more than this "
                f"machine can hold for a simulation ({fmt_bytes(budget)}); pass "
                "--train.micro_batch to choose"
            )
    raise ConfigError(
        f"mesh {mesh}: even train.micro_batch=1 needs about "
        f"{fmt_bytes(estimate(_with_micro(cfg, 1), mesh, 0, target).peak)} per rank, more than "
        f"{fmt_bytes(budget)} available here; lower --train.seq_len to simulate"
    )


def _with_micro(cfg: JobConfig, mb: int) -> JobConfig:
    out = JobConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    out.train.micro_batch = mb
    return out


def print_table(title: str, columns: dict[str, dict | None], extra: list[str]) -> None:
    cols = {k: v for k, v in columns.items() if v}
    print(title)
    print("  " + f"{'':24s}" + "".join(f"{k:>14s}" for k in cols))
    for cat in CATEGORIES:
        print(
            "  "
            + f"{LABELS[cat]:24s}"
            + "".join(f"{fmt_bytes(v[cat]):>14s}" for v in cols.values())
        )
    for line in extra:
        print("  " + line)
    print()


def main(argv: list[str] | None = None) -> int:
    args, rest = parse(sys.argv[1:] if argv is None else argv)
    try:
        return run(args, rest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args, rest: list[str]) -> int:

    measured: list[dict] = []
    if args.run_dir:
        with open(os.path.join(args.run_dir, "config.json")) as f:
            cfg = JobConfig.from_dict(json.load(f))
        measured = load_measured(args.run_dir)
        if not measured:
            raise ConfigError(
                f"--run-dir {args.run_dir} has no memory/rank*.json; train with --profile.memory"
            )
        with open(os.path.join(args.run_dir, "memory", "rank0.json")) as f:
            info = json.load(f)
        mm = info["mesh"]
        run_mesh = MeshShape(mm["dp_replicate"], mm["dp_shard"], mm["tp"])
        target = args.target or info["device"]
        meshes = [MeshShape.parse(m) for m in args.mesh] or [run_mesh]
    else:
        cfg = recipes.get(args.recipe)
        target = args.target or "cuda"
        if not args.mesh:
            raise ConfigError("give at least one --mesh DPxTP, e.g. --mesh 8x8")
        meshes = [MeshShape.parse(m) for m in args.mesh]
        run_mesh = None
    apply_overrides(cfg, rest)
    device_memory = (
        parse_size(args.device_memory, "--device-memory") if args.device_memory else None
    )
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom {args.headroom} must be in [0, 1)")

    entries: list[Entry] = []
    entry_meshes: list[MeshShape] = []
    notes: list[str] = []
    if cfg.parallel.compile:
        notes.append(
            "parallel.compile is on: estimate and simulation describe eager execution; "
            "compiled blocks usually keep fewer activations"
        )
        print("note: " + notes[-1])
    results = []
    for mesh in meshes:
        est = estimate(cfg, mesh, 0, target)
        per_rank = estimates_per_rank(cfg, mesh, target)
        entry = Entry(
            mesh=str(mesh),
            estimate=est.to_dict(),
            estimate_per_rank=per_rank,
            measured=measured if mesh == run_mesh else [],
            device_memory=device_memory,
            headroom=args.headroom,
        )
        entries.append(entry)
        entry_meshes.append(mesh)
        sim_entry = None
        if args.simulate:
            budget = int(available_memory() * SIM_MEMORY_FRACTION)
            sim_cfg, why = pick_simulation_config(cfg, mesh, target, budget)
            if why:
                print(why, flush=True)
                notes.append(why)
            print(f"simulating rank 0 of mesh {mesh} ({mesh.world} ranks) ...", flush=True)
            start = time.perf_counter()
            sim = run_subprocess(
                sim_cfg,
                (mesh.dp_replicate, mesh.dp_shard, mesh.tp),
                0,
                target,
                skip_compute=not args.no_skip_compute,
            )
            sim["outer_wall_s"] = time.perf_counter() - start
            sim.pop("config", None)
            if why:  # compare like with like: the estimate at the simulated micro batch
                sim_entry = Entry(
                    mesh=f"{mesh} (micro batch {sim['micro_batch']}, simulated)",
                    estimate=estimate(sim_cfg, mesh, 0, target).to_dict(),
                    simulated=sim,
                    device_memory=device_memory,
                    headroom=args.headroom,
                )
                entries.append(sim_entry)
                entry_meshes.append(mesh)
            else:
                entry.simulated = sim
        for e in [entry] + ([sim_entry] if sim_entry else []):
            report_entry(e, cfg, mesh, target)
            results.append(
                {
                    "mesh": e.mesh,
                    "estimate": e.estimate,
                    "simulated": e.simulated,
                    "measured": e.measured,
                    "fits": e.fits(),
                }
            )

    if device_memory is not None:
        limit = int(device_memory * (1 - args.headroom))
        print(f"fits in {fmt_bytes(device_memory)} per device (keeping {args.headroom:.0%}):")
        for e, mesh in zip(entries, entry_meshes, strict=True):
            best = e.values("simulated") or e.values("estimated")
            line = f"  {e.mesh:36s} {fmt_bytes(best['peak']):>12s}  {'yes' if e.fits() else 'NO '}"
            if not e.fits() and e.simulated is None:
                e.remedy = micro_batch_advice(cfg, mesh, target, limit)
                line += "  " + e.remedy
            print(line)
        print()

    title = f"Memory per rank of {cfg.recipe} ({target})"
    rep = Report(title=title, summary=summary_rows(cfg, target), entries=entries, notes=notes)
    out = args.out or args.run_dir or time.strftime(f"runs/memory-{cfg.recipe}-%Y%m%d-%H%M%S")
    md, page = write(rep, out)
    print(f"report: {md}\n        {page}")
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


def micro_batch_advice(cfg: JobConfig, mesh: MeshShape, target: str, limit: int) -> str:
    """The largest micro batch that fits in `limit`, without and with activation checkpointing."""
    local = cfg.train.global_batch // mesh.dp
    found = []
    for ac in ("none", "full"):
        trial = _with_micro(cfg, 1)
        trial.parallel.activation_checkpoint = ac
        best = None
        for mb in (d for d in range(1, local + 1) if local % d == 0):
            trial.train.micro_batch = mb
            peak = estimate(trial, mesh, 0, target).peak
            if peak > limit:
                break
            best = (mb, peak)
        found.append(best)
    plain, ac_full = found
    parts = []
    if plain:
        parts.append(f"fits with --train.micro_batch {plain[0]} ({fmt_bytes(plain[1])})")
    if ac_full and (not plain or ac_full[0] > plain[0]):
        parts.append(
            f"with --parallel.activation_checkpoint full: --train.micro_batch {ac_full[0]} "
            f"({fmt_bytes(ac_full[1])})"
        )
    return "; ".join(parts) or "does not fit at micro batch 1, even with activation checkpointing"


def estimates_per_rank(cfg: JobConfig, mesh: MeshShape, target: str) -> list[dict]:
    """Every rank's estimate; ranks differ only by their dp_shard index (uneven FSDP shards)."""
    by_shard: dict[int, Estimate] = {}
    out = []
    for r in range(mesh.world):
        shard = mesh.coords(r)[1]
        if shard not in by_shard:
            by_shard[shard] = estimate(cfg, mesh, r, target)
        d = by_shard[shard].to_dict()
        d["rank"] = r
        out.append(d)
    return out


def report_entry(e: Entry, cfg: JobConfig, mesh: MeshShape, target: str) -> None:
    est = e.estimate
    extra = [
        f"estimated peak at: {est['peak_phase']}; micro batch {est['micro_batch']} x "
        f"{est['micro_batches']} per step, sequence {est['seq_len']}"
    ]
    if e.simulated:
        s = e.simulated
        extra.append(
            f"simulated rank 0 of {s['world_size']} ({s['mixed_precision']}, micro batch "
            f"{s['micro_batch']}): peak in {s['memory']['peak_phase']}, {s['wall_s']:.0f} s "
            f"(step {s['step_s']:.0f} s), process peak RSS {fmt_bytes(s['rss_peak'])}"
        )
    if e.measured:
        peaks = ", ".join(fmt_bytes(m["peak"]) for m in e.measured)
        extra.append(f"measured peak per rank: {peaks}")
    p = cfg.parallel
    print_table(
        f"{cfg.recipe} on mesh {e.mesh}: dp_replicate={mesh.dp_replicate} x dp_shard="
        f"{mesh.dp_shard} x tp={mesh.tp} ({mesh.world} ranks), {target}, activation "
        f"checkpointing {p.activation_checkpoint}; rank 0",
        {
            "measured": e.values("measured"),
            "estimated": e.values("estimated"),
            "simulated": e.values("simulated"),
        },
        extra,
    )


if __name__ == "__main__":
    sys.exit(main())
