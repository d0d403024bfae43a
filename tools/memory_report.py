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
rank 0 of each mesh on this machine over a fake process group (hybrid2d/simulate.py), on
rows packed with several documents where the run packs them (as the estimate prices them);
when the recipe's micro batch would not fit in this machine's memory it simulates the largest
micro batch that does and says so. --run-dir reads the per-rank figures a run made with
--profile.memory and puts them next to the estimate. --device-memory says which meshes fit and,
for one that does not, the largest micro batch that would or, where none would, the planner's
fewest GPUs on which a mesh fits (whole nodes of 8); the HTML charts draw the usable memory
(device memory less --headroom). The report is printed; a Markdown and an
HTML copy (memory_report.md, memory_report.html) are written to --out, or with --run-dir to the
run's memory/ folder, over the report the run wrote there; without either no file is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import psutil

from hybrid2d import recipes
from hybrid2d.cli import OneLineParser, apply_overrides, positive_size
from hybrid2d.config import JobConfig
from hybrid2d.errors import ConfigError
from hybrid2d.layout import MESH_DIMS, RunLayout
from hybrid2d.planner import hardware as hwlib
from hybrid2d.planner.launch import packed_documents
from hybrid2d.planner.memory import estimate, estimates_per_rank
from hybrid2d.planner.search import Plan, fewest_gpus, mesh_label
from hybrid2d.profiling.profiler import load_measured, summary_rows
from hybrid2d.profiling.report import CATEGORIES, LABELS, Entry, Report, fmt_bytes, write
from hybrid2d.simulate import run_subprocess

# A simulated rank needs its tensors plus the Python/torch process (~0.5 GiB) and slack.
SIM_MEMORY_FRACTION = 0.6


def parse(argv: list[str]):
    ap = OneLineParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 1)[1],
    )
    ap.add_argument("--recipe", default="llama-debug")
    ap.add_argument("--mesh", action="append", default=[], help="DPxTP or RxSxT; repeatable")
    ap.add_argument(
        "--device-memory", help="say which meshes fit: 80GiB (80 x 2^30 bytes) or 80GB (80e9)"
    )
    ap.add_argument(
        "--headroom",
        type=float,
        default=0.10,
        help="fraction of device memory kept for the allocator and runtime (0.10)",
    )
    ap.add_argument("--target", choices=("cuda", "cpu"))
    ap.add_argument("--simulate", action="store_true", help="also simulate rank 0 of each mesh")
    ap.add_argument(
        "--no-skip-compute",
        action="store_true",
        help="simulate with real matmuls (slow; same memory)",
    )
    ap.add_argument("--run-dir", help="a run made with --profile.memory")
    ap.add_argument(
        "--out",
        help="write the report here as Markdown and HTML: a folder, or a path ending in "
        ".md/.html (default: the --run-dir's memory/, else no file)",
    )
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    return ap.parse_known_args(argv)


def largest_micro_batch(
    cfg: JobConfig,
    layout: RunLayout,
    target: str,
    limit: int,
    below: int = 0,
    ac: str = "",
    documents: bool = False,
) -> tuple[RunLayout, int] | None:
    """(layout, peak) with the largest micro batch (a divisor of the per-rank batch, smaller than
    `below` when given) whose estimate fits in `limit` bytes, with activation checkpointing `ac`
    when given; None when none fits. `documents`: packed rows (`packed_documents`)."""
    local = layout.local_batch
    ac = ac or layout.activation_checkpoint
    for mb in range(min(below or local + 1, local + 1) - 1, 0, -1):
        if local % mb == 0:
            trial = dataclasses.replace(layout, micro_batch=mb, activation_checkpoint=ac)
            peak = estimate(cfg, trial, 0, target, documents).peak
            if peak <= limit:
                return trial, peak
    return None


def pick_simulation_layout(
    cfg: JobConfig, layout: RunLayout, target: str, budget: int, documents: bool = False
) -> tuple[RunLayout, str | None]:
    """The layout to simulate: `layout`, or it with the largest micro batch whose estimate fits
    in `budget` bytes (with a line saying so). Raises ConfigError when none fits."""
    est = estimate(cfg, layout, 0, target, documents)
    if est.peak <= budget:
        return layout, None
    current = layout.micro_batch
    found = largest_micro_batch(cfg, layout, target, budget, current, documents=documents)
    if found is None:
        smallest = dataclasses.replace(layout, micro_batch=1)
        raise ConfigError(
            f"mesh {layout}: even train.micro_batch=1 needs about "
            f"{fmt_bytes(estimate(cfg, smallest, 0, target, documents).peak)} per rank, more than "
            f"{fmt_bytes(budget)} available here; lower --train.seq_len to simulate"
        )
    trial = found[0]
    return trial, (
        f"simulating mesh {layout} with train.micro_batch={trial.micro_batch} instead of "
        f"{current}: the estimate for {current} is {fmt_bytes(est.peak)} per rank, more than "
        f"this machine can hold for a simulation ({fmt_bytes(budget)}); pass "
        "--train.micro_batch to choose"
    )


def print_table(title: str, e: Entry) -> None:
    cols = {s: e.values(s) for s in e.sources()}
    print(title)
    print("  " + f"{'':24s}" + "".join(f"{k:>14s}" for k in cols))
    for cat in CATEGORIES:
        figures = "".join(f"{fmt_bytes(v[cat]):>14s}" for v in cols.values())
        print(f"  {LABELS[cat]:24s}{figures}")
    for line in e.notes():
        print("  " + line)
    if e.measured:
        print("  measured peak per rank: " + ", ".join(fmt_bytes(m["peak"]) for m in e.measured))
    print()


def main(argv: list[str] | None = None) -> int:
    args, rest = parse(sys.argv[1:] if argv is None else argv)
    try:
        return run(args, rest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args, rest: list[str]) -> int:
    device_memory = (
        positive_size(args.device_memory, "--device-memory") if args.device_memory else None
    )
    measured: list[dict] = []
    run_mesh = None
    if args.run_dir:
        if not os.path.exists(args.run_dir):
            raise ConfigError(
                f"--run-dir {args.run_dir} does not exist: give a run directory that "
                "recipes/llama.py wrote"
            )
        if not os.path.isfile(os.path.join(args.run_dir, "config.json")):
            raise ConfigError(
                f"--run-dir {args.run_dir} has no config.json: give a run directory that "
                "recipes/llama.py wrote"
            )
        with open(os.path.join(args.run_dir, "config.json")) as f:
            cfg = JobConfig.from_dict(json.load(f))
        measured = load_measured(args.run_dir)
        if not measured:
            raise ConfigError(
                f"--run-dir {args.run_dir} has no memory/rank*.json; train with --profile.memory"
            )
        with open(os.path.join(args.run_dir, "memory", "rank0.json")) as f:
            info = json.load(f)
        run_mesh = tuple(info["mesh"][k] for k in MESH_DIMS)
        target = args.target or info["device"]
    else:
        cfg = recipes.get(args.recipe)
        target = args.target or "cuda"
        if not args.mesh:
            raise ConfigError("give at least one --mesh DPxTP, e.g. --mesh 8x8")
    apply_overrides(cfg, rest)
    layouts = [RunLayout.on_mesh(cfg, m) for m in args.mesh or [run_mesh]]
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom {args.headroom} must be in [0, 1)")
    fit = {"device_memory": device_memory, "headroom": args.headroom}
    # Packed rows (instruction data, text with document masks) hold per-row masks: priced.
    documents = packed_documents(cfg)

    entries: list[tuple[Entry, RunLayout]] = []
    notes: list[str] = []
    if cfg.parallel.compile:
        notes.append(
            "parallel.compile is on: estimate and simulation describe eager execution; "
            "compiled blocks usually keep fewer activations"
        )
        print("note: " + notes[-1])
    for mesh in layouts:
        per_rank = estimates_per_rank(cfg, mesh, target, documents)
        ran = mesh.mesh_shape == run_mesh
        entry = Entry(str(mesh), per_rank[0], per_rank, measured=measured if ran else [], **fit)
        mine = [entry]
        if args.simulate:
            budget = int(psutil.virtual_memory().available * SIM_MEMORY_FRACTION)
            sim_layout, why = pick_simulation_layout(cfg, mesh, target, budget, documents)
            if why:
                print(why, flush=True)
                notes.append(why)
            print(f"simulating rank 0 of mesh {mesh} ({mesh.world} ranks) ...", flush=True)
            start = time.perf_counter()
            sim = run_subprocess(
                cfg,
                sim_layout,
                0,
                target,
                skip_compute=not args.no_skip_compute,
                documents=documents,  # packed rows, as the estimate prices them
            )
            sim["outer_wall_s"] = time.perf_counter() - start
            sim.pop("config", None)
            if why:  # compare like with like: the estimate at the simulated micro batch
                est = estimate(cfg, sim_layout, 0, target, documents).to_dict()
                name = f"{mesh} (micro batch {sim['micro_batch']}, simulated)"
                mine.append(Entry(name, est, simulated=sim, **fit))
            else:
                entry.simulated = sim
        for e in mine:
            print_table(
                f"{cfg.recipe} on mesh {e.mesh}: dp_replicate={mesh.dp_replicate} x dp_shard="
                f"{mesh.dp_shard} x tp={mesh.tp} ({mesh.world} ranks), {target}, activation "
                f"checkpointing {mesh.activation_checkpoint}; rank 0",
                e,
            )
            entries.append((e, mesh))

    if device_memory is not None:
        limit = int(device_memory * (1 - args.headroom))
        found: dict[int, Plan | None] = {}  # the planner's answer per GPU count, asked once
        print(f"fits in {fmt_bytes(device_memory)} per device (keeping {args.headroom:.0%}):")
        for e, mesh in entries:
            line = f"  {e.mesh:36s} {fmt_bytes(e.best()['peak']):>12s}  "
            line += "yes" if e.fits() else "NO "
            if not e.fits() and e.simulated is None:
                e.remedy = micro_batch_advice(cfg, mesh, target, limit, documents)
                if e.remedy == NO_MICRO_BATCH:
                    e.remedy += "; " + fewest_gpus_advice(
                        cfg, mesh, target, device_memory, args.headroom, found
                    )
                line += "  " + e.remedy
            print(line)
        print()

    title = f"Memory per rank of {cfg.recipe} ({target})"
    rep = Report(title, summary_rows(cfg, layouts[0], target), [e for e, _ in entries], notes)
    out = args.out or (args.run_dir and os.path.join(args.run_dir, "memory"))
    if out:
        md, page = write(rep, out)
        print(f"report: {md}\n        {page}")
    else:
        print("(no report file written: --out DIR writes it as Markdown and HTML)")
    if args.json:
        keys = ("mesh", "estimate", "simulated", "measured")
        results = [{k: getattr(e, k) for k in keys} | {"fits": e.fits()} for e, _ in entries]
        print(json.dumps(results, indent=1))
    return 0


def micro_batch_advice(
    cfg: JobConfig, mesh: RunLayout, target: str, limit: int, documents: bool = False
) -> str:
    """The largest micro batch that fits in `limit`, without and with activation checkpointing."""
    plain, ac_full = (
        largest_micro_batch(cfg, mesh, target, limit, ac=ac, documents=documents)
        for ac in ("none", "full")
    )
    parts = []
    if plain:
        mb = plain[0].micro_batch
        parts.append(f"fits with --train.micro_batch {mb} ({fmt_bytes(plain[1])})")
    if ac_full and (not plain or ac_full[0].micro_batch > plain[0].micro_batch):
        parts.append(
            f"with --parallel.activation_checkpoint full: --train.micro_batch "
            f"{ac_full[0].micro_batch} ({fmt_bytes(ac_full[1])})"
        )
    return "; ".join(parts) or NO_MICRO_BATCH


NO_MICRO_BATCH = "does not fit at micro batch 1, even with activation checkpointing"


def fewest_gpus_advice(
    cfg: JobConfig,
    mesh: RunLayout,
    target: str,
    device_memory: int,
    headroom: float,
    found: dict[int, Plan | None],
) -> str:
    """The planner's way out for a mesh on which nothing fits: another mesh of as many GPUs,
    or the fewest GPUs on which some mesh does (planner.search.fewest_gpus). The candidates
    of that count are ranked by the h100 preset's speeds (only memory decides what fits),
    with `--device-memory` as each GPU's memory and 8 GPUs per node."""
    if mesh.world not in found:
        hw = dataclasses.replace(hwlib.get("h100"), memory_bytes=device_memory, target=target)
        found[mesh.world] = fewest_gpus(cfg, hw, headroom, above=mesh.world - 1)
    result = found[mesh.world]
    if result is None:
        return "no mesh fits even on 4,096 GPUs"
    best, per_node = result.best, result.gpus_per_node
    nodes = result.world // per_node
    where = (
        f"on these {mesh.world} GPUs"
        if result.world == mesh.world
        else f"fewest GPUs that fit: {result.world}"
        + (f" ({nodes} nodes of {per_node})" if result.world % per_node == 0 else "")
    )
    return (
        f"{where}, as mesh {mesh_label(best)} (dp_replicate x dp_shard x tp) with "
        f"{best.activation_checkpoint} activation checkpointing and micro batch "
        f"{best.micro_batch}: {best.peak_gib:.1f} GiB per rank (tools/plan.py lists every plan)"
    )


if __name__ == "__main__":
    sys.exit(main())
