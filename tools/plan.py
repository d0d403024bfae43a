"""Choose the mesh: every configuration of a recipe on a cluster, predicted and ranked.

  python tools/plan.py --recipe llama3.1-70b --nodes 32 --gpus-per-node 8 --gpu h100 \\
      [--gpu-memory 80GiB] [--global-batch 256] [--seq-len 8192] [--top 10] \\
      [--json plan.json] [--emit-accelerate-config plan.yaml] [--show-rejected]
  python tools/plan.py --recipe llama-debug --nodes 1 --gpus-per-node 4 --hardware cpu.json
  python tools/plan.py --calibrate [--device cpu|cuda] --recipe llama-debug --out cpu.json
  python tools/plan.py --validate [--hardware cpu.json] [--validate-ranks 2,4]
  python tools/plan.py --check-run runs/<run> [--hardware h200.json]

Candidates are every (dp_replicate, dp_shard, tp) whose product is the GPU count, x activation
checkpointing none / selective / full, x micro batch; each gets its per-rank peak memory
(planner/memory.py) and a predicted step time (hybrid2d/planner/model.py). The table lists
the fastest that fit first. --gpu picks a preset (h100, h200, a100-80gb, b200, cpu);
--hardware FILE.json reads a profile (as --calibrate writes it). --validate measures every
candidate of a small model on this machine with alternating runs (as tools/bench.py does) and
writes predicted against measured into docs/planner.md, beside published GPU measurements.
--check-run compares a finished run's step time, MFU and peak memory with the prediction, on
the profile the run was planned with (--gpu / --hardware: another) and its tensor peak.
--set of a setting the planner chooses (parallel.dp_replicate, dp_shard, tp,
activation_checkpoint, train.micro_batch) searches only the plans with that value.

Exit codes: 0 a best plan (or the action done), 2 a bad argument, 5 no valid plan (no mesh
the trainer accepts, or none with the --set values), 6 nothing fits the memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

from hybrid2d import recipes
from hybrid2d.cli import OneLineParser, apply_overrides, positive_size
from hybrid2d.config import JobConfig, ModelConfig
from hybrid2d.errors import ConfigError
from hybrid2d.layout import MESH_DIMS, RunLayout
from hybrid2d.metrics import flops_per_token
from hybrid2d.planner import hardware as hwlib
from hybrid2d.planner.launch import packed_documents
from hybrid2d.planner.model import DEFAULT_HEADROOM, PLANNED, predict
from hybrid2d.planner.search import (
    accelerate_config,
    divisors,
    format_table,
    mesh_label,
    param_count,
    plan,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "planner.md")
# The validation model: tools/bench.py's default shape (llama-debug's), seq 256, global batch 8.
VALIDATION_MODEL = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, vocab_size=4096)
VALIDATION_SEQ, VALIDATION_BATCH = 256, 8
# Exit codes beside 2 (a bad argument), apart from the trainer's 3 (non-finite) and 4 (a
# collective failed), so that a script can tell why there is nothing to launch.
NO_VALID_PLAN, NOTHING_FITS = 5, 6


def parser() -> OneLineParser:
    p = OneLineParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--recipe", default="llama-debug", help="a name from recipes/llama.py --list")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, help="default: the profile's (8 for GPUs)")
    p.add_argument("--gpu", help=f"a preset: {', '.join(hwlib.names())} (default h100)")
    p.add_argument("--hardware", help="a profile JSON file (as --calibrate writes)")
    p.add_argument(
        "--gpu-memory", help="memory per GPU with its unit: 80GiB or 80GB (default: the profile's)"
    )
    p.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM, help="kept free (0.10)")
    p.add_argument("--global-batch", type=int, help="samples per step (default: the recipe's)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default: the recipe's)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="another setting of the recipe, e.g. parallel.reshard_after_forward=false",
    )
    p.add_argument("--top", type=int, default=10, help="rows of the table (10)")
    p.add_argument(
        "--json",
        help="write every candidate as a JSON list here (--validate: every measured row; "
        "--calibrate: the raw measurements, to refit the profile without re-measuring)",
    )
    p.add_argument("--emit-accelerate-config", metavar="FILE", help="write the best plan's config")
    p.add_argument("--show-rejected", action="store_true", help="list rejected meshes and why")
    p.add_argument("--calibrate", action="store_true", help="measure this machine")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="for --calibrate")
    p.add_argument("--procs", type=int, help="--calibrate processes (cpu: 2; cuda: GPUs, <= 2)")
    p.add_argument(
        "--crowd",
        type=int,
        help="--calibrate --device cpu: also measure tp blocks with this many processes, more "
        "than the cores (as when 4 ranks share 2 cores; --validate: its largest world size)",
    )
    p.add_argument("--out", help="where --calibrate (and --validate) write the profile (JSON)")
    p.add_argument("--validate", action="store_true", help="predicted vs measured on this CPU")
    p.add_argument("--validate-ranks", default="2,4", help="world sizes to measure (2,4)")
    # 5 steps, 2 left out, 2 repeats: the full matrix (30 candidates on 2 and 4 ranks, 60 runs)
    # in about 20 min on an idle 2-core host.
    p.add_argument("--steps", type=int, default=5, help="--validate: steps per run (5)")
    p.add_argument("--warmup", type=int, default=2, help="--validate: steps left out (2)")
    p.add_argument("--repeats", type=int, default=2, help="--validate: alternating repeats (2)")
    p.add_argument(
        "--validate-only",
        default="",
        help="--validate: only these candidates, e.g. '1x2 selective mb1,2x1 none mb2' (a smoke "
        "run; the statistics need the whole matrix)",
    )
    p.add_argument("--note", default="", help="--validate: a line about the conditions")
    p.add_argument("--doc", default=DOC, help="--validate: the page to write (docs/planner.md)")
    p.add_argument(
        "--published-only",
        action="store_true",
        help="--validate: only recompute the published-measurement comparison",
    )
    p.add_argument("--check-run", metavar="RUN_DIR", help="compare a finished run with the plan")
    return p


# ---- arguments --------------------------------------------------------------------------------


def positive(args, *names: str) -> None:
    for name in names:
        value = getattr(args, name.replace("-", "_"))
        if value is not None and value < 1:
            raise ConfigError(f"--{name} {value} must be >= 1")


def writable(path: str | None, flag: str) -> None:
    """A ConfigError now, not a traceback after the work, when `path` cannot be written."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a folder; give a file name")
    existed = os.path.exists(path)
    try:
        open(path, "a").close()  # appends nothing: an existing file is left as it is
    except OSError as e:
        raise ConfigError(f"{flag} {path} cannot be written: {e.strerror}") from None
    if not existed:
        os.remove(path)


def load_hardware(args) -> hwlib.Hardware:
    if args.gpu and args.hardware:
        raise ConfigError("give --gpu or --hardware, not both")
    hw = hwlib.load(args.hardware) if args.hardware else hwlib.get(args.gpu or "h100")
    if args.gpu_memory:
        hw.memory_bytes = positive_size(args.gpu_memory, "--gpu-memory")
    return hw


def job_config(args) -> tuple[JobConfig, frozenset[str]]:
    """The recipe with the tool's settings, and the names among them that the planner chooses
    (PLANNED): the search keeps their values."""
    cfg = recipes.get(args.recipe)
    if args.global_batch is not None:
        cfg.train.global_batch = args.global_batch
    if args.seq_len is not None:
        cfg.train.seq_len = args.seq_len
    settings = []
    for item in args.set:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"--set {item!r} is not SECTION.FIELD=VALUE")
        settings.append("--" + item)
    return cfg, frozenset(apply_overrides(cfg, settings) & set(PLANNED))


def check(args) -> tuple[JobConfig, hwlib.Hardware, frozenset[str]]:
    """Every mistake, found before any work; resolves defaults."""
    modes = [m for m in ("calibrate", "validate", "check_run") if getattr(args, m)]
    if len(modes) > 1:
        names = " and ".join("--" + m.replace("_", "-") for m in modes)
        raise ConfigError(f"{names} are separate actions; give one")
    positive(args, "nodes", "gpus-per-node", "top", "global-batch", "seq-len", "procs")
    positive(args, "steps", "repeats")
    if args.crowd is not None:
        cores = os.cpu_count() or 1
        if not args.calibrate:
            raise ConfigError("--crowd is for --calibrate (--validate sets it itself)")
        if args.device != "cpu" or args.crowd <= cores:
            raise ConfigError(
                f"--crowd {args.crowd}: give more processes than this host's {cores} cores, "
                "with --device cpu"
            )
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom {args.headroom} must be in [0, 1)")
    if args.calibrate and not args.out:
        raise ConfigError("--calibrate needs --out FILE.json")
    if args.out and not (args.calibrate or args.validate):
        raise ConfigError("--out is for --calibrate and --validate (plans go to --json)")
    if args.validate and not 0 <= args.warmup < args.steps:
        raise ConfigError(f"--warmup {args.warmup} must be at least 0 and below --steps")
    if args.validate:
        args.ranks = parse_ranks(args.validate_ranks)
        labels = [f"{dp}x{tp} {ac} mb{mb}" for dp, tp, ac, mb in validation_candidates(args.ranks)]
        for wanted in filter(None, (w.strip() for w in args.validate_only.split(","))):
            if wanted not in labels:
                raise ConfigError(
                    f"--validate-only {wanted!r} is not a candidate on --validate-ranks "
                    f"{args.validate_ranks} (e.g. {labels[0]!r})"
                )
    for path, flag in ((args.json, "--json"), (args.out, "--out"), (args.doc, "--doc")):
        writable(path, flag)
    writable(args.emit_accelerate_config, "--emit-accelerate-config")
    if args.check_run and not os.path.isfile(os.path.join(args.check_run, "summary.json")):
        raise ConfigError(f"--check-run {args.check_run}: no summary.json (a finished run dir?)")
    if args.calibrate:
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("--device cuda, but no CUDA device is visible; use --device cpu")
        hw = load_hardware(args) if (args.gpu or args.hardware) else None
    elif args.validate:
        hw = hwlib.load(args.hardware) if args.hardware else None
    elif args.check_run and not (args.gpu or args.hardware):
        hw = None  # the run's own profile (run_check)
    else:
        hw = load_hardware(args)
        if args.gpus_per_node is None:
            args.gpus_per_node = hw.gpus_per_node
    cfg, fixed = job_config(args)
    return cfg, hw, fixed


def parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 2:
        raise ConfigError(f"--validate-ranks {text!r} is not a list of world sizes >= 2, e.g. 2,4")
    return ranks


# ---- planning --------------------------------------------------------------------------------


def run_plan(args, cfg: JobConfig, hw: hwlib.Hardware, fixed: frozenset[str]) -> int:
    world = args.nodes * args.gpus_per_node
    started = time.process_time()
    documents = packed_documents(cfg)  # packed rows' masks are priced
    result = plan(
        cfg, world, args.gpus_per_node, hw, args.headroom, fixed=fixed, documents=documents
    )
    took = time.process_time() - started
    fits = sum(c.fits for c in result.candidates)
    kept = f" with {set_values(cfg, fixed)}" if fixed else ""
    print(
        f"{cfg.recipe} ({param_count(cfg.model.num_params())}) on {args.nodes} node(s) x "
        f"{args.gpus_per_node} {hw.name} = {world} devices, {hw.memory_bytes / 2**30:.0f} GiB "
        f"each ({args.headroom:.0%} kept free); global batch {cfg.train.global_batch}, seq "
        f"{cfg.train.seq_len}: {len(result.candidates)} candidates{kept} ({fits} fit), "
        f"{len(result.rejected)} meshes rejected; planned in {took:.2f} s"
    )
    print(format_table(result, args.top, args.show_rejected))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([c.to_dict() for c in result.candidates], f, indent=1)
    best = result.best
    if best is None:
        print(f"\n{no_plan(args, cfg, hw, fixed, result)}", flush=True)
        if args.emit_accelerate_config:
            short = "fits" if result.candidates else "is valid"
            print(f"error: no plan {short}, so no accelerate config was written", file=sys.stderr)
        return NOTHING_FITS if result.candidates else NO_VALID_PLAN
    flags = launch_flags(best, cfg, args)
    print(
        f"\nbest: {mesh_label(best)} (dp_replicate={best.dp_replicate} dp_shard={best.dp_shard} "
        f"tp={best.tp}), {best.activation_checkpoint} checkpointing, micro batch "
        f"{best.micro_batch}: {best.step_s:.3g} s/step, {best.tokens_per_s_per_gpu:,.0f} "
        f"tokens/s per device, MFU {best.mfu:.1%}, {best.peak_gib:.1f} GiB per rank"
    )
    picks = ""
    if cfg.parallel.plan == "auto":  # the trainer plans again at launch: say what it will pick
        picks = f"  (plan auto picks {' '.join(best.flags())} on {world} {hw.name})"
    print("flags: " + " ".join(flags) + picks)
    if args.emit_accelerate_config:
        # Several nodes: each passes its own rank and the first node's address (the file is
        # the same on every node), as recipes/accelerate/gpu_multinode.yaml says.
        per_node = (
            " --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR" if args.nodes > 1 else ""
        )
        command = (
            f"accelerate launch --config_file {args.emit_accelerate_config}{per_node} "
            "recipes/llama.py " + " ".join(flags)
        )
        on_each = f" on each of the {args.nodes} nodes" if args.nodes > 1 else ""
        comment = (
            f"written by tools/plan.py: the best plan for {cfg.recipe} on {args.nodes} node(s) x "
            f"{args.gpus_per_node} {hw.name}\npredicted {best.step_s:.3g} s/step, "
            f"{best.peak_gib:.1f} GiB per rank; launch{on_each} with:\n{command}"
        )
        with open(args.emit_accelerate_config, "w") as f:
            f.write(accelerate_config(best, args.nodes, comment))
        print(f"wrote {args.emit_accelerate_config}; launch{on_each} with:\n  {command}")
    return 0


def no_plan(args, cfg: JobConfig, hw: hwlib.Hardware, fixed: frozenset[str], result) -> str:
    """The line that says why there is no best plan; with --set values of planned settings,
    which of them rule every plan out and the values that would not."""
    if result.candidates:  # valid plans, none of which fits
        said, hint = "nothing fits", "use more GPUs, a smaller --seq-len, or more memory"
    else:
        said, hint = "no valid plan", "every mesh: --show-rejected"
    others = other_values(args, cfg, hw, fixed, result)
    if others:
        return f"{said} with {set_values(cfg, fixed)}: {others} ({hint})"
    if result.candidates:
        return f"{said}: {hint}"
    # no mesh is valid at all: say why (the first reason), not that memory ran out
    if result.rejected:
        why = result.rejected[0].reason
    else:  # the set values leave no mesh of this world
        why = f"no mesh of {result.world} devices has {set_values(cfg, fixed)}"
    return f"{said}: {why} ({hint})"


def other_values(args, cfg: JobConfig, hw: hwlib.Hardware, fixed: frozenset[str], result) -> str:
    """For each set planned setting, the values that give a valid plan (one that fits, when
    `result` has valid ones) with the other set values kept: 'parallel.tp 1, 2 or 4 would be
    valid'; "" when freeing no single one of them helps."""
    fitting = bool(result.candidates)
    said = []
    for name in sorted(fixed):
        field = name.split(".")[1]
        wider = plan(
            cfg, result.world, args.gpus_per_node, hw, args.headroom, fixed=fixed - {name},
            documents=packed_documents(cfg),
        )  # fmt: skip
        values = sorted({getattr(c, field) for c in wider.candidates if c.fits or not fitting})
        if values:
            listed = ", ".join(map(str, values[:-1])) + " or " * (len(values) > 1) + str(values[-1])
            said.append(f"{name} {listed} would {'fit' if fitting else 'be valid'}")
    return "; ".join(said)


def set_values(cfg: JobConfig, fixed: frozenset[str]) -> str:
    """The planned settings the search kept, as set: 'parallel.tp=4 train.micro_batch=2'."""
    values = []
    for name in sorted(fixed):
        section, field = name.split(".")
        values.append(f"{name}={getattr(getattr(cfg, section), field)}")
    return " ".join(values)


def launch_flags(best, cfg: JobConfig, args) -> list[str]:
    """recipes/llama.py arguments that run the best plan as planned, each setting once: the
    plan's choices, then the recipe's changes (a --set of a planned setting was searched with,
    so the plan's value is the one set). With parallel.plan auto the trainer makes the choices
    itself: only the changes, --set planned settings included (they bound its search too)."""
    changed = {}
    if args.global_batch is not None:
        changed["train.global_batch"] = str(cfg.train.global_batch)
    if args.seq_len is not None:
        changed["train.seq_len"] = str(cfg.train.seq_len)
    for item in args.set:  # a later one wins, as in the settings
        key, value = item.split("=", 1)
        changed[key.replace("-", "_")] = value
    auto = cfg.parallel.plan == "auto"
    flags = ["--recipe", cfg.recipe, *([] if auto else best.flags())]
    for key, value in changed.items():
        if auto or key not in PLANNED:
            flags += [f"--{key}", value]
    return flags


# ---- calibration -----------------------------------------------------------------------------


def run_calibrate(args, cfg: JobConfig, base) -> int:
    from hybrid2d.planner.calibrate import calibrate

    started = time.time()
    hw, raw = calibrate(cfg, args.device, base, args.procs, crowd=args.crowd)
    hw.save(args.out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    print(
        f"calibrated in {time.time() - started:.0f} s for {cfg.recipe}'s shapes; wrote {args.out}"
    )
    print(describe_profile(hw, raw))
    return 0


def describe_profile(hw: hwlib.Hardware, raw: dict | None = None) -> str:
    lines = [f"{hw.name}: {hw.description}"]
    unit = "per core" if hw.host_cores else "per device"
    if hw.matmul_table:
        rates = ", ".join(f"{r[0]} tok tp{r[1]}: {r[2] / 1e9:.1f}" for r in hw.matmul_table)
        lines.append(f"  matmul GFLOP/s {unit}: {rates}")
    if hw.attention_table:
        rates = ", ".join(f"{r[0]} tok tp{r[1]}: {r[2] / 1e9:.1f}" for r in hw.attention_table)
        lines.append(f"  attention GFLOP/s {unit}: {rates}")
    if hw.elementwise_table:
        rates = ", ".join(f"{r[0]} tok: {r[1] / 1e9:.2f}" for r in hw.elementwise_table)
        lines.append(f"  elementwise GB/s {unit}: {rates}")
    if hw.optimizer_s_per_param:
        lines.append(f"  AdamW + clip: {hw.optimizer_s_per_param * 1e9:.2f} ns per parameter")
    for name in ("intra", "inter"):
        link = getattr(hw, name)
        if link.measured:
            parts = ", ".join(
                f"{k} {v[0] * 1e6:.0f} us + {v[1] / 1e9:.2f} GB/s" for k, v in link.measured.items()
            )
            lines.append(f"  {name} ({hw.sources.get(name, '')}): {parts}")
    if hw.checkpoint_overhead_s:
        parts = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in hw.checkpoint_overhead_s.items())
        lines.append(f"  checkpointing beyond its recompute, per block and micro batch: {parts}")
    if hw.block_residual_s:
        r = hw.block_residual_s
        lines.append(
            f"  a block beyond its priced pieces: {r['fixed'] * 1e3:.2f} ms + "
            f"{r['per_token'] * 1e6:.2f} us per token"
        )
    if hw.tp_sync_s:
        lines.append(f"  tp collective after compute: +{hw.tp_sync_s * 1e6:.0f} us wait each")
    if hw.tp_block_overhead_s:
        lines.append(f"  a tp-sharded block beyond that: {hw.tp_block_overhead_s * 1e3:.2f} ms")
    if hw.crowded_tp_block_overhead_s:
        parts = ", ".join(
            f"tp {k} {v * 1e3:.2f} ms" for k, v in hw.crowded_tp_block_overhead_s.items()
        )
        lines.append(f"  ... with {hw.crowded_ranks} processes on this host's cores: {parts}")
    if hw.fsdp_block_overhead_s:
        lines.append(f"  an FSDP unit beyond that: {hw.fsdp_block_overhead_s * 1e3:.2f} ms")
    if hw.op_overhead_s:
        lines.append(f"  per dispatched op: {hw.op_overhead_s * 1e6:.1f} us of CPU")
    return "\n".join(lines)


# ---- a finished run against its prediction ---------------------------------------------------


def run_profile(run_dir: str, cfg: JobConfig, summary: dict) -> hwlib.Hardware:
    """The profile the run was planned with: its parallel.plan_hardware file, else the preset
    summary.json's plan names (`cpu`: this host). A CPU run priced on the h100 preset read as
    98% off."""
    if cfg.parallel.plan_hardware:
        if not os.path.isfile(cfg.parallel.plan_hardware):
            raise ConfigError(
                f"--check-run {run_dir}: its profile parallel.plan_hardware="
                f"{cfg.parallel.plan_hardware} is gone; give a profile with --hardware FILE.json"
            )
        return hwlib.load(cfg.parallel.plan_hardware)
    name = summary.get("plan", {}).get("hardware", "h100")
    try:
        return hwlib.get(name)
    except ConfigError:
        raise ConfigError(
            f"--check-run {run_dir}: it was planned on profile {name!r}, which is no preset; "
            "give its profile with --hardware FILE.json"
        ) from None


def run_check(args, hw: hwlib.Hardware | None) -> int:
    """Step time, MFU and peak memory of a finished run beside the planner's prediction, on
    the run's own profile unless --gpu / --hardware names another."""
    with open(os.path.join(args.check_run, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(args.check_run, "config.json")) as f:
        cfg = JobConfig.from_dict(json.load(f))
    try:
        hw = hw or run_profile(args.check_run, cfg, summary)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mesh = RunLayout.on_mesh(cfg, tuple(summary["mesh"][k] for k in MESH_DIMS))
    gpus = min(mesh.world, args.gpus_per_node or hw.gpus_per_node)
    # Packed rows, as the run recorded them (its data files may be elsewhere by now).
    data = summary.get("data", {})
    documents = data.get("layout") == "packed" or data.get("document_mask") == "on"
    cand = predict(cfg, mesh, hw, gpus, args.headroom, documents)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    # positions_per_s counts padding too (tokens_per_s, real tokens only, since packing)
    step = tokens / summary.get("positions_per_s", summary["tokens_per_s"])
    # The run's tensor peak where it measured one (CUDA; --profile.memory elsewhere): the
    # estimate counts tensors. Else the process peak, said to be one (it counts the runtime).
    plan = summary.get("plan", {})
    tensors = "measured_peak_bytes" in plan
    peak = plan["measured_peak_bytes"] if tensors else max(summary["peak_memory_bytes_per_rank"])
    peak /= 2**30
    peak_as = plan.get("peak_measured_as", "tensors") if tensors else "process peak, not tensors"
    devices = mesh.world if not hw.host_cores else math.ceil(mesh.world / gpus)
    mfu = flops_per_token(cfg.model, cfg.train.seq_len) * tokens / step
    mfu /= hw.peak_flops * devices
    out = {
        "run_dir": args.check_run,
        "hardware": hw.name,
        "mesh": str(mesh),
        "compile": cfg.parallel.compile,
        "measured_step_s": step,
        "planned_step_s": cand.step_s,
        "step_error": (cand.step_s - step) / step,
        "measured_mfu": mfu,
        "planned_mfu": cand.mfu,
        "measured_peak_gib": peak,
        "measured_peak_as": peak_as,
        "estimated_peak_gib": cand.peak_gib,
        "memory_error": (cand.peak_gib - peak) / peak if peak else None,
    }
    print(
        f"{args.check_run} ({cfg.recipe}, mesh {mesh}, {hw.name}, compile "
        f"{cfg.parallel.compile}):\n"
        f"  step time  measured {step:.3f} s, planned {cand.step_s:.3f} s "
        f"({out['step_error']:+.0%})\n"
        f"  MFU        measured {mfu:.1%}, planned {cand.mfu:.1%}\n"
        f"  peak/rank  measured {peak:.2f} GiB ({peak_as}), estimated {cand.peak_gib:.2f} GiB"
        + (f" ({out['memory_error']:+.0%})" if peak else "")
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


# ---- validation ------------------------------------------------------------------------------


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b (ties counted as neither concordant nor discordant)."""
    concordant = discordant = ties_x = ties_y = 0
    n = len(xs)
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denom if denom else 0.0


def validation_candidates(ranks: list[int]) -> list[tuple[int, int, str, int]]:
    """(dp, tp, checkpointing, micro batch) for every world size: each dp x tp, x none /
    selective / full, x micro batch 1 and 2."""
    out = []
    for world in ranks:
        for tp in divisors(world):
            for ac in ("none", "selective", "full"):
                for micro in (1, 2):
                    out.append((world // tp, tp, ac, micro))
    return out


def validation_stats(rows: list[dict]) -> dict:
    predicted = [r["predicted_s"] for r in rows]
    measured = [r["measured_s"] for r in rows]
    best = min(range(len(rows)), key=lambda i: measured[i])
    top2 = sorted(range(len(rows)), key=lambda i: predicted[i])[:2]
    return {
        "n": len(rows),
        "kendall_tau": kendall_tau(predicted, measured),
        "mape": statistics.mean(abs(p - m) / m for p, m in zip(predicted, measured, strict=True)),
        "best_in_top2": best in top2,
        "measured_best": rows[best]["label"],
        "predicted_top2": [rows[i]["label"] for i in top2],
    }


def run_validate(args, hw) -> int:
    sections = {"published": published_section()}
    if not args.published_only:
        sections["validation"] = measure_validation(args, hw)
    write_doc(args.doc, sections)
    print(f"wrote {args.doc}")
    return 0


def measure_validation(args, hw) -> str:
    # tools/bench.py, from this script's folder: the same launcher and worker the benchmarks use
    import bench
    from bench_worker import bench_job

    from hybrid2d.planner.calibrate import calibrate

    model = ModelConfig(**VALIDATION_MODEL)
    base = JobConfig(recipe="bench", model=model)
    base.train.global_batch, base.train.seq_len = VALIDATION_BATCH, VALIDATION_SEQ
    started = time.time()
    calibrated_here = hw is None
    if hw is None:
        print("calibrating this machine for the validation model ...", flush=True)
        crowd = max(args.ranks)  # the largest world measured, when it outnumbers the cores
        crowd = crowd if crowd > (os.cpu_count() or 1) else None
        hw, raw = calibrate(base, "cpu", None, None, crowd=crowd)
        print(describe_profile(hw, raw), flush=True)
        if args.out:
            hw.save(args.out)
    cands = validation_candidates(args.ranks)
    if args.validate_only:  # labels checked by `check`
        labels = {f"{dp}x{tp} {ac} mb{mb}": (dp, tp, ac, mb) for dp, tp, ac, mb in cands}
        cands = [labels[w.strip()] for w in args.validate_only.split(",") if w.strip()]
    rows = []
    for dp, tp, ac, micro in cands:
        settings = [f"parallel.activation_checkpoint={ac}", f"train.micro_batch={micro}"]
        job = bench_job(
            model, VALIDATION_BATCH, VALIDATION_SEQ, args.steps, dp, tp, "cpu", settings
        )
        pred = predict(job, RunLayout.on_mesh(job, (1, dp, tp)), hw, gpus_per_node=dp * tp)
        rows.append(
            {
                "label": f"{dp}x{tp} {ac} mb{micro}",
                "dp": dp,
                "tp": tp,
                "activation_checkpoint": ac,
                "micro_batch": micro,
                "settings": settings,
                "predicted_s": pred.step_s,
                "prediction": pred.to_dict(),
                "times": [],
                "run_medians": [],
            }
        )
    ns = argparse.Namespace(
        global_batch=VALIDATION_BATCH, seq_len=VALIDATION_SEQ, steps=args.steps, device="cpu"
    )
    with tempfile.TemporaryDirectory() as model_dir:
        bench.write_model_dir(model, model_dir)
        for repeat in range(args.repeats):  # alternate, so drift hits every candidate alike
            for i, row in enumerate(rows):
                extra = [a for s in row["settings"] for a in ("--set", s)]
                result = bench.launch("hybrid2d", row["dp"], row["tp"], ns, model_dir, extra)
                row["times"] += result["times"][args.warmup :]
                row["run_medians"].append(statistics.median(result["times"][args.warmup :]))
                print(
                    f"repeat {repeat + 1}/{args.repeats} run {i + 1}/{len(rows)} {row['label']}: "
                    f"{statistics.median(result['times'][args.warmup :]):.3f} s/step "
                    f"(predicted {row['predicted_s']:.3f})",
                    flush=True,
                )
    took = time.time() - started
    if args.json:  # the raw rows, to score a changed model against later without re-measuring
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return format_validation(args, hw, rows, took, calibrated_here)


def summarize_validation(rows: list[dict]) -> list[tuple[str, str, dict]]:
    """(estimator, candidates, stats) for each world size and all together, with two measured
    figures per candidate: the median over every measured step of every repeat (as
    tools/bench.py reports) and the fastest run's median (the least disturbed run on a shared
    machine)."""
    out = []
    for estimator, measure in (
        ("median of all steps", lambda r: statistics.median(r["times"])),
        ("fastest run", lambda r: min(r["run_medians"])),
    ):
        scored = [dict(r, measured_s=measure(r)) for r in rows]
        by_world: dict[int, list[dict]] = {}
        for r in scored:
            by_world.setdefault(r["dp"] * r["tp"], []).append(r)
        for world, group in by_world.items():
            out.append((estimator, f"{world}-rank ({len(group)})", validation_stats(group)))
        if len(by_world) > 1:
            out.append((estimator, f"all ({len(scored)})", validation_stats(scored)))
    return out


def format_validation(args, hw, rows, took, calibrated_here) -> str:
    lines = [
        f"Run {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f} at the end), `python tools/plan.py --validate "
        f"--validate-ranks {args.validate_ranks} --steps {args.steps} --warmup {args.warmup} "
        f"--repeats {args.repeats}`: {took / 60:.1f} min. Model: tools/bench.py's default shape "
        f"(dim 256, 4 layers, 8/4 heads, ffn 688, vocab 4096), seq {VALIDATION_SEQ}, global batch "
        f"{VALIDATION_BATCH}, fp32, AdamW, the trainer's defaults otherwise. Measured: each run's "
        f"last {args.steps - args.warmup} steps, {args.repeats} runs per candidate in alternation.",
    ]
    if args.note:
        lines += ["", f"**{args.note}**"]
    lines += [
        "",
        f"Hardware profile: {'calibrated at the start of this run' if calibrated_here else hw.name}"
        f" ({hw.description}):",
        "",
        "```",
        describe_profile(hw),
        "```",
        "",
        "| world | mesh dp x tp | ckpt | micro | predicted s | measured s (median) | error | "
        "runs' medians s | compute s | tp comm s | FSDP comm s | optim s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["prediction"]
        measured = statistics.median(r["times"])
        err = (r["predicted_s"] - measured) / measured
        runs = ", ".join(f"{t:.3f}" for t in r["run_medians"])
        lines.append(
            f"| {r['dp'] * r['tp']} | {r['dp']}x{r['tp']} | {r['activation_checkpoint']} | "
            f"{r['micro_batch']} | {r['predicted_s']:.3f} | {measured:.3f} | {err:+.0%} | "
            f"{runs} | {p['compute_s']:.3f} | {p['tp_comm_s']:.3f} | {p['fsdp_comm_s']:.3f} | "
            f"{p['optimizer_s']:.4f} |"
        )
    lines += [
        "",
        "| measured as | candidates | Kendall's tau | MAPE | measured best | predicted top 2 | "
        "in top 2 |",
        "|---|---|---|---|---|---|---|",
    ]
    for estimator, name, s in summarize_validation(rows):
        lines.append(
            f"| {estimator} | {name} | {s['kendall_tau']:.2f} | {s['mape']:.1%} | "
            f"{s['measured_best']} | {', '.join(s['predicted_top2'])} | "
            f"{'yes' if s['best_in_top2'] else 'no'} |"
        )
    lines += ["", "Targets (issue 13): tau >= 0.8, MAPE <= 15%, the measured best in the top 2."]
    return "\n".join(lines)


def published_section() -> str:
    """Each published row beside the planner's prediction for the same configuration."""
    from hybrid2d.planner.published import ROWS, predict_row, predicted_memory

    lines = [
        "| configuration | hardware | mesh | batch / seq | ckpt | published tokens/s/GPU | "
        "predicted | error | at other peak | published memory | estimated peak (torchtitan's "
        "program) | error | source |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    errors, mem_errors = [], []
    for row in ROWS:
        cand, tps = predict_row(row)
        err = (tps - row.tokens_per_s_per_gpu) / row.tokens_per_s_per_gpu
        errors.append(abs(err))
        others = []
        for peak in row.peak_range:
            _, other = predict_row(row, peak)
            off = (other - row.tokens_per_s_per_gpu) / row.tokens_per_s_per_gpu
            others.append(f"{other:,.0f} ({off:+.0%}) at {peak / 1e12:.0f} TFLOPS")
        if row.memory_gib:
            allocated, compared = predicted_memory(row)
            mem_err = (compared - row.memory_gib) / row.memory_gib
            if row.memory_not_counted:
                shown = f"{mem_err:+.0%} (not counted)"
            else:
                mem_errors.append(abs(mem_err))
                shown = f"{mem_err:+.0%}"
            estimated = f"{allocated:.1f} GiB"
            if compared != allocated:
                ratio = compared / allocated
                estimated += f", as reserved (x {ratio:.3f}) {compared:.1f} GiB"
            memory = f"{row.memory_gib:.1f} GiB ({row.memory_kind}) | {estimated} | {shown}"
        else:
            memory = f"not published | {cand.peak_gib:.1f} GiB | -"
        changes = ", ".join(
            f"{k} {v / 2**30:.0f} GiB" if k == "memory_bytes" else f"{k} {v / 1e12:.1f} TB/s"
            for k, v in row.hardware_changes.items()
        )
        lines.append(
            f"| {row.label} | {row.gpu}{' (' + changes + ')' if changes else ''} | "
            f"{row.nodes} node(s), dp_shard {row.dp_shard} x tp {row.tp} | "
            f"{row.local_batch}/GPU x {row.dp_shard} / {row.seq_len} | "
            f"{row.activation_checkpoint} | {row.tokens_per_s_per_gpu:,.0f} | "
            f"{tps:,.0f} | {err:+.0%} | {', '.join(others) or '-'} | {memory} | {row.source} |"
        )
    signed = [(predict_row(r)[1] - r.tokens_per_s_per_gpu) / r.tokens_per_s_per_gpu for r in ROWS]
    lines += [
        "",
        f"Mean absolute error: tokens/s per GPU {statistics.mean(errors):.0%} over {len(errors)} "
        f"rows (signed: {min(signed):+.0%} to {max(signed):+.0%}, median "
        f"{statistics.median(signed):+.0%}); memory {statistics.mean(mem_errors):.0%} over "
        f"{len(mem_errors)} rows (at most {max(mem_errors):.0%}; "
        f"{sum(1 for r in ROWS if r.memory_not_counted)} not counted, see its note). Targets "
        "(issue 13): tokens/s within 15%, memory within 10%.",
        "",
        "Notes per row:",
        "",
    ]
    lines += [
        f"- {row.label}: {row.notes}"
        + (f"; {row.memory_not_counted}" if row.memory_not_counted else "")
        for row in ROWS
    ]
    return "\n".join(lines)


def write_doc(path: str, sections: dict[str, str]) -> None:
    """Replace the generated sections of the page (between their markers), keep the rest."""
    text = open(path).read() if os.path.exists(path) else DOC_SKELETON
    for name, body in sections.items():
        begin, end = f"<!-- BEGIN {name} (tools/plan.py --validate) -->", f"<!-- END {name} -->"
        if begin not in text:
            text += f"\n{begin}\n{end}\n"
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{body}\n{end}{tail}"
    with open(path, "w") as f:
        f.write(text)


DOC_SKELETON = """# Choosing the mesh: tools/plan.py

## Validation on this machine

<!-- BEGIN validation (tools/plan.py --validate) -->
<!-- END validation -->

## Against published GPU measurements

<!-- BEGIN published (tools/plan.py --validate) -->
<!-- END published -->
"""


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg, hw, fixed = check(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.calibrate:
        return run_calibrate(args, cfg, hw)
    if args.validate:
        return run_validate(args, hw)
    if args.check_run:
        return run_check(args, hw)
    return run_plan(args, cfg, hw, fixed)


if __name__ == "__main__":
    sys.exit(main())
