"""Throughput side by side: hybrid2d vs transformers-native distributed vs one process.

    python tools/bench.py                     # 2x2 and 1x2 meshes, llama-debug-like shape
    python tools/bench.py --mesh 2x2 --repeats 3 --comm
    python tools/bench.py --device cuda --mesh 2x4 --dim 2048 --layers 8 ...   # nccl, MFU
    python tools/bench.py --mesh 2x2 --family all --levers-only   # each family beside Llama
    python tools/bench.py --mesh 2x2 --balance-cost --repeats 3   # the step breakdown on vs off

Runs alternate (hybrid2d, transformers, single, hybrid2d, ...) so that drift of a shared machine
hits every kind alike; each figure is the median over all measured steps of all repeats. All kinds
start from the same weights (a SHA-256 of every parameter tensor after loading, compared
across kinds before any figure is reported) and see the same global batches. Parallel
efficiency = single-process throughput / distributed throughput per unit of hardware: on CPU
every kind shares the host's cores (single step time / distributed step time); on CUDA the
single process has one GPU and a mesh has dp x tp. MFU = model FLOPs per token x tokens/s
over the peak FLOP/s of the hardware used (known GPUs' dense bf16 peak, or --peak-tflops).

--family runs the same shape (--dim, --layers, ...) as each named family builds it (FAMILY_SHAPES:
Qwen3's wider heads and q/k norms, Qwen2's biases, Mistral's and Gemma 3's sliding windows of a
quarter of the sequence, Gemma 3's four norms, GELU and scaled embeddings) and Llama's, and
reports each family's step time per token beside Llama's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from bench_worker import bench_job  # this script's folder

from hybrid2d.cli import OneLineParser
from hybrid2d.config import ModelConfig, interleaved_layer_types
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from hybrid2d.metrics import flops_per_token
from hybrid2d.parallel.lora import is_adapter

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_worker.py")

# Dense bf16 peak FLOP/s per device, for MFU on CUDA.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
BALANCE_OFF = "metrics.balance=false"


def family_shape(family: str, base: ModelConfig, seq_len: int) -> dict:
    """The switches `family` sets on the benchmark's Llama shape, as its published models do:
    head sizes relative to dim / heads as in Qwen3 0.6B (2x), windows shorter than the sequence
    (a quarter of it) as Gemma 3's 512 of 32k and Mistral v0.1's 4k of 32k, Gemma 3's five
    sliding layers to one global (at least one global)."""
    window = max(1, seq_len // 4)
    wide = 2 * (base.dim // base.n_heads)
    if family == "llama":
        return {}
    if family == "mistral":
        return dict(family=family, sliding_window=window)
    if family == "qwen2":
        return dict(family=family, qkv_bias=True, norm_eps=1e-6, rope_theta=1e6)
    if family == "qwen3":
        return dict(family=family, attn_head_dim=wide, qk_norm=True, norm_eps=1e-6, rope_theta=1e6)
    layers = interleaved_layer_types(base.n_layers, 6)
    layers = layers if "F" in layers else layers[:-1] + "F"  # fewer than 6: the last is global
    return dict(  # gemma3
        family=family,
        qk_norm=True,
        norm_plus_one=True,
        sandwich_norms=True,
        mlp_activation="gelu_tanh",
        scale_embeddings=True,
        attn_scale_base=float(base.head_dim),
        sliding_window=window,
        layer_types=layers,
        rope_theta=1e6,
        rope_local_theta=1e4,
        tie_embeddings=True,
        norm_eps=1e-6,
    )


def bench_model(args, family: str = "llama") -> ModelConfig:
    base = ModelConfig(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_dim=args.ffn,
        vocab_size=args.vocab,
    )
    return dataclasses.replace(base, **family_shape(family, base, args.seq_len))


def write_model_dir(model: ModelConfig, path: str) -> None:
    """One set of random weights as a HF directory of the family's class that every kind starts
    from (the config.json hybrid2d's export writes, read back by transformers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybrid2d.checkpoint.hf import hf_config_from_model
    from hybrid2d.models.llama import Llama

    ours = Llama(model)
    ours.init_weights(0)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_from_model(model), f)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    hf.load_state_dict(ours.state_dict())
    hf.save_pretrained(path)
    with open(os.path.join(path, "hybrid2d_model.json"), "w") as f:
        json.dump(dataclasses.asdict(model), f)


def launch(kind: str, dp: int, tp: int, args, model_dir: str, extra: list[str]) -> dict:
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    worker, env = WORKER, dict(os.environ, TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    if kind == "hybrid2d" and args.tensor_peak:
        extra = [*extra, "--tensor-peak"]
    if kind == "baseline":  # hybrid2d as another checkout has it (--baseline)
        worker = os.path.join(args.baseline, "tools", "bench_worker.py")
        env["PYTHONPATH"] = args.baseline + os.pathsep + env.get("PYTHONPATH", "")
        kind = "hybrid2d"
    common = [
        worker,
        "--impl",
        kind,
        "--model-dir",
        model_dir,
        "--dp",
        str(dp),
        "--tp",
        str(tp),
        "--global-batch",
        str(args.global_batch),
        "--seq-len",
        str(args.seq_len),
        "--steps",
        str(args.steps),
        "--device",
        args.device,
        "--out",
        out,
        *extra,
    ]
    cmd = [sys.executable, *common] if kind == "single" else torchrun_command(dp * tp, common)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"bench: {kind} {dp}x{tp} failed:\n{proc.stderr[-4000:]}")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def torchrun_command(nproc: int, worker_args: list[str]) -> list[str]:
    """torchrun on this host with --standalone: its agent binds port 0 for the rendezvous and
    the ranks' store, so two benchmarks (or a test run) side by side never race for a port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        *worker_args,
    ]


def kinds_to_run(args) -> dict[str, tuple[str, list[str]]]:
    """label -> (worker kind, extra worker args); levers are hybrid2d runs with one setting."""
    base = [a for s in args.set for a in ("--set", s)]
    kinds = {"hybrid2d": ("hybrid2d", base)}
    if not args.levers_only:
        kinds["transformers"] = ("transformers", [])
        kinds["single"] = ("single", [])
    for lever in args.lever:  # "a=1,b=2": several settings in one run
        settings = [a for s in lever.split(",") for a in ("--set", s.strip())]
        kinds[f"hybrid2d + {lever}"] = ("hybrid2d", base + settings)
    if args.baseline:  # the same runs with another checkout's code, alternating with ours
        for label, (kind, extra) in list(kinds.items()):
            if kind == "hybrid2d":
                kinds[label.replace("hybrid2d", "baseline", 1)] = ("baseline", extra)
    return kinds


def measure(dp: int, tp: int, args, model_dir: str) -> dict:
    kinds = kinds_to_run(args)
    runs = {label: [] for label in kinds}
    for _ in range(args.repeats):  # alternate, so drift hits every kind alike
        for label, (kind, extra) in kinds.items():
            runs[label].append(launch(kind, dp, tp, args, model_dir, extra))
    if args.comm:
        base = kinds["hybrid2d"][1]
        runs["comm"] = launch("hybrid2d", dp, tp, args, model_dir, base + ["--comm"])
    check_same_weights(runs, f"{dp}x{tp}", kinds)
    return runs


def check_same_weights(runs: dict, mesh: str, kinds: dict | None = None) -> None:
    """Every run of every kind started from the weights of hybrid2d's first run, tensor for
    tensor (runs of a --baseline checkout whose worker reports no checksums are not compared).
    A LoRA run against a full fine-tuning one (`--lever lora.rank=16`, or the other way round):
    the adapters, which only one of them has, are left out; a base frozen in bf16 is the other's
    weights rounded, so it is compared by name only (said in a note)."""
    ref = runs["hybrid2d"][0]["checksums"]
    lora_ref = any(is_adapter(name) for name in ref)
    kinds = kinds or {}

    def bf16(label: str) -> bool:
        return "lora.base_dtype=bf16" in kinds.get(label, ("", []))[1]

    for label, kind_runs in runs.items():
        for i, run in enumerate(kind_runs if isinstance(kind_runs, list) else [kind_runs]):
            got, want = run.get("checksums"), ref
            if got is None:
                continue
            if any(is_adapter(name) for name in got) != lora_ref:
                got = {n: v for n, v in got.items() if not is_adapter(n)}
                want = {n: v for n, v in ref.items() if not is_adapter(n)}
                if (bf16(label) or bf16("hybrid2d")) and set(got) == set(want):
                    if i == 0:  # once per kind
                        print(
                            f"note: {label} {mesh}: its base is frozen in bf16, the other's "
                            "weights rounded; compared by name only",
                            file=sys.stderr,
                        )
                    continue
            if set(got) != set(want):
                raise SystemExit(
                    f"bench: {label} {mesh} has parameters {sorted(set(got) ^ set(want))} that "
                    "the hybrid2d run has not (or the other way round)"
                )
            differ = [name for name in want if got[name] != want[name]]
            if differ:
                raise SystemExit(
                    f"bench: {label} {mesh} starts from other weights than hybrid2d "
                    f"({len(differ)} tensors differ, first {differ[0]}); its figures would not "
                    "compare like with like"
                )


def devices_used(label: str, args) -> int:
    """Units of hardware a kind runs on: GPUs on CUDA; on CPU every kind has the whole host."""
    if args.device != "cuda":
        return 1
    return 1 if label == "single" else args.world


def summarize(runs: dict, args, model: ModelConfig) -> dict:
    tokens = args.global_batch * args.seq_len
    row = {"kinds": {}}
    for label, kind_runs in runs.items():
        if label == "comm":
            continue
        steady = [t for r in kind_runs for t in r["times"][args.warmup :]]
        step = statistics.median(steady)
        row["kinds"][label] = {
            "step_s": step,
            "tokens_per_s": tokens / step,
            "first_loss": kind_runs[0]["losses"][0],
            "weights_sha256": _digest(kind_runs[0].get("checksums")),
            "weight_tensors": len(kind_runs[0].get("checksums") or {}),
            "peak_mem_mib": max(max(r["peak_mem"]) for r in kind_runs) / 2**20,
            "tensor_peak_mib": _tensor_peak_mib(kind_runs),
            "devices": devices_used(label, args),
        }
        monitor = [t for r in kind_runs for t in r.get("monitor_s", [])[args.warmup :]]
        if monitor:  # metrics.balance's gather and bookkeeping on the logged steps: wall, CPU
            row["kinds"][label]["monitor_s"] = statistics.median(wall for wall, _ in monitor)
            row["kinds"][label]["monitor_cpu_s"] = statistics.median(cpu for _, cpu in monitor)
    k = row["kinds"]
    if "single" in k:
        per_device = k["single"]["tokens_per_s"] / k["single"]["devices"]
        for label in k:
            k[label]["efficiency"] = k[label]["tokens_per_s"] / k[label]["devices"] / per_device
    if "transformers" in k:
        row["speedup_vs_transformers"] = k["transformers"]["step_s"] / k["hybrid2d"]["step_s"]
    for label in k:
        k[label]["vs_hybrid2d_default"] = k["hybrid2d"]["step_s"] / k[label]["step_s"]
    if args.peak_flops:
        fpt = flops_per_token(model, args.seq_len)
        for r in k.values():
            r["mfu"] = fpt * r["tokens_per_s"] / (args.peak_flops * r["devices"])
    return row


def _tensor_peak_mib(kind_runs: list[dict]) -> float | None:
    """The largest tracked tensor peak of any rank of any run (--tensor-peak), or None."""
    peaks = [p for r in kind_runs for p in r.get("tensor_peak") or [] if p is not None]
    return max(peaks) / 2**20 if peaks else None


def _digest(checksums: dict | None) -> str | None:
    """One SHA-256 over every tensor's, in name order (None when the run reported none)."""
    if checksums is None:
        return None
    import hashlib

    joined = "".join(f"{name}={checksums[name]};" for name in sorted(checksums))
    return hashlib.sha256(joined.encode()).hexdigest()


def peak_flops(args) -> float | None:
    """Peak FLOP/s of one device: --peak-tflops, else the known dense bf16 peak of the GPU."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if args.device == "cuda":
        name = torch.cuda.get_device_name()
        return next((v for n, v in PEAK_FLOPS.items() if n in name), None)
    return None


def format_table(results: dict, device: str) -> str:
    mfu = any("mfu" in r for row in results.values() for r in row["kinds"].values())
    memory = "peak GPU memory/rank" if device == "cuda" else "peak RSS/rank"
    header = ["mesh", "kind", "step (s)", "tokens/s", "parallel eff."]
    tensors = any(
        r.get("tensor_peak_mib") for row in results.values() for r in row["kinds"].values()
    )
    header += ["MFU"] * mfu + ["speed vs hybrid2d default", f"{memory} (MiB)"]
    header += ["tensor peak/rank (MiB)"] * tensors + ["first loss"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for mesh, row in results.items():
        for label, r in row["kinds"].items():
            eff = f"{r['efficiency']:.0%}" if "efficiency" in r and label != "single" else ""
            cells = [mesh, label, f"{r['step_s']:.3f}", f"{r['tokens_per_s']:,.0f}", eff]
            if mfu:
                cells.append(f"{100 * r['mfu']:.3g}%" if "mfu" in r else "")
            cells += [f"{r['vs_hybrid2d_default']:.2f}x", f"{r['peak_mem_mib']:.0f}"]
            if tensors:
                peak = r.get("tensor_peak_mib")
                cells.append(f"{peak:.1f}" if peak else "")
            cells.append(f"{r['first_loss']:.5f}")
            lines.append("| " + " | ".join(cells) + " |")
        if "speedup_vs_transformers" in row:
            cells = [mesh, "**hybrid2d / transformers tokens/s**"]
            cells += [f"**{row['speedup_vs_transformers']:.2f}x**"] + [""] * (len(header) - 3)
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def balance_cost(results: dict) -> str:
    """--balance-cost's lines: per mesh, the step with the breakdown on against off (the same
    runs alternating), and the time of the monitor's gather and bookkeeping per logged step."""
    lines = ["metrics.balance (step breakdown, gathered every step) on against off:"]
    for mesh, row in results.items():
        on, off = row["kinds"]["hybrid2d"], row["kinds"][f"hybrid2d + {BALANCE_OFF}"]
        wall, cpu = on.get("monitor_s", 0.0), on.get("monitor_cpu_s", 0.0)
        lines.append(
            f"  {mesh}: {on['step_s']:.4f} s/step on, {off['step_s']:.4f} off "
            f"({on['step_s'] / off['step_s'] - 1:+.2%}); the monitor's gather and bookkeeping "
            f"{wall * 1e3:.2f} ms/step wall ({wall / on['step_s']:.2%}, with the wait for the "
            f"slowest rank), {cpu * 1e3:.2f} ms CPU ({cpu / on['step_s']:.2%})"
        )
    return "\n".join(lines)


def families(args) -> list[str]:
    """The families to run: Llama first (the others are reported beside it), then each named
    one; `all` names every family."""
    named = [f for name in args.family for f in (FAMILIES if name == "all" else [name])]
    return ["llama"] + [f for f in dict.fromkeys(named) if f != "llama"]


def family_table(results: dict, args) -> str:
    """Each family's step time per token beside Llama's on the same mesh (hybrid2d's runs)."""
    lines = [
        "| mesh | family | params | FLOPs/token | step (s) | us/token | time/token vs llama |",
        "|" + "---|" * 7,
    ]
    tokens = args.global_batch * args.seq_len
    for (family, mesh), row in results.items():
        step = row["kinds"]["hybrid2d"]["step_s"]
        llama = results[("llama", mesh)]["kinds"]["hybrid2d"]["step_s"]
        model = bench_model(args, family)
        fpt = flops_per_token(model, args.seq_len)
        cells = [mesh, family, f"{model.num_params() / 1e6:.2f}M", f"{fpt / 1e6:.2f}M"]
        cells += [f"{step:.3f}", f"{1e6 * step / tokens:.1f}", f"{step / llama:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_args(args) -> list[tuple[int, int]]:
    """Every mistake the runs would hit, found before any weights are written or ranks start.

    Resolves --device auto and returns the meshes as (dp, tp)."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but no CUDA device is visible; use --device cpu")
    if not 0 <= args.warmup < args.steps:
        raise ConfigError(
            f"--warmup {args.warmup} must be at least 0 and below --steps {args.steps}, "
            "so that some steps are measured"
        )
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats} must be >= 1")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        raise ConfigError(f"--peak-tflops {args.peak_tflops} must be > 0")
    runs = [args.set] + [args.set + [s.strip() for s in lever.split(",")] for lever in args.lever]
    for setting in (s for run in runs for s in run):
        if "=" not in setting or setting.startswith("="):
            raise ConfigError(
                f"setting {setting!r} (--set / --lever) is not section.field=value, "
                "e.g. parallel.compile=true"
            )
    if args.baseline and not os.path.isfile(
        os.path.join(args.baseline, "tools", "bench_worker.py")
    ):
        raise ConfigError(
            f"--baseline {args.baseline!r} is not a hybrid2d checkout (no tools/bench_worker.py); "
            "make one with `git worktree add DIR COMMIT`"
        )
    meshes = []
    for text in args.mesh or ["2x2", "1x2"]:
        parts = text.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ConfigError(f"--mesh {text!r} is not DPxTP with positive sizes, e.g. 2x2")
        dp, tp = int(parts[0]), int(parts[1])
        if args.device == "cuda" and dp * tp > torch.cuda.device_count():
            raise ConfigError(
                f"--mesh {text} needs {dp * tp} GPUs, {torch.cuda.device_count()} are visible"
            )
        for family in families(args):
            for settings in runs:  # hybrid2d's defaults, then each lever on top of --set
                model = bench_model(args, family)
                job = bench_job(
                    model,
                    args.global_batch,
                    args.seq_len,
                    args.steps,
                    dp,
                    tp,
                    args.device,
                    settings,
                )
                RunLayout.build(job, dp * tp)  # a bad --set is one line before any run
        meshes.append((dp, tp))
    return meshes


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mesh", action="append", help="DPxTP, repeatable (default 2x2 and 1x2)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument(
        "--family",
        action="append",
        default=[],
        choices=[*FAMILIES, "all"],
        help="also run this family's shape (repeatable; all: every family), reported beside "
        "Llama's; --baseline then runs beside Llama only",
    )
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps per run left out of the median")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--comm", action="store_true", help="also count collectives and bytes")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        help="a hybrid2d setting for its runs, e.g. parallel.reshard_after_forward=false",
    )
    p.add_argument(
        "--lever",
        action="append",
        default=[],
        help="also run hybrid2d with this setting (repeatable; a=1,b=2 for several at once)",
    )
    p.add_argument(
        "--balance-cost",
        action="store_true",
        help="what the always-on step breakdown costs: hybrid2d with metrics.balance on "
        "(gathered every step) and off, alternating (--levers-only --lever "
        "metrics.balance=false)",
    )
    p.add_argument(
        "--levers-only",
        action="store_true",
        help="skip transformers and the single process (compare levers only)",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="cuda: nccl, one GPU per rank, bf16 compute; auto: cuda when visible",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="peak TFLOP/s of one GPU (or of the whole CPU host) for MFU; default: the dense "
        f"bf16 peak of {', '.join(PEAK_FLOPS)}",
    )
    p.add_argument(
        "--baseline",
        help="a checkout of another hybrid2d version (e.g. `git worktree add /tmp/old main~5`): "
        "its hybrid2d runs alternate with this tree's, labelled baseline",
    )
    p.add_argument(
        "--tensor-peak",
        action="store_true",
        help="hybrid2d runs also track one more (untimed) step's tensors: their peak per rank "
        "(on CPU the figure that compares settings, e.g. --lever lora.rank=16; RSS holds the "
        "runtime too)",
    )
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.balance_cost:
        args.levers_only = True
        args.lever.append(BALANCE_OFF)
    try:
        meshes = check_args(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.peak_flops = peak_flops(args)
    results, by_family = {}, {}
    started = time.time()
    baseline = args.baseline
    for family in families(args):
        model = bench_model(args, family)
        args.baseline = baseline if family == "llama" else None
        with tempfile.TemporaryDirectory() as model_dir:
            write_model_dir(model, model_dir)
            for dp, tp in meshes:
                mesh = f"{dp}x{tp}"
                label = mesh if family == "llama" else f"{mesh} {family}"
                args.world = dp * tp
                runs = measure(dp, tp, args, model_dir)
                results[label] = summarize(runs, args, model)
                by_family[family, mesh] = results[label]
                if args.comm:
                    from hybrid2d.planner.comm import analytic_step

                    local = args.global_batch // dp
                    results[label]["comm"] = runs["comm"]["comm"]
                    job = bench_job(
                        model, args.global_batch, args.seq_len, 1, dp, tp, "cpu", args.set
                    )
                    results[label]["comm_analytic"] = analytic_step(
                        model, dp, tp, local, args.seq_len, lora=job.lora
                    )
    args.baseline = baseline
    if args.json:  # first, so that the measurements outlive any mistake in printing them
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    hardware = f"{os.cpu_count()} cores"
    if args.device == "cuda":
        hardware = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}, nccl"
    print(
        f"# hybrid2d bench {time.strftime('%Y-%m-%d')} on {platform.node()} "
        f"({hardware}, torch {torch.__version__}); {time.time() - started:.0f} s"
    )
    print(
        f"model dim {args.dim}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, ffn "
        f"{args.ffn}, vocab {args.vocab}; seq {args.seq_len}, global batch {args.global_batch}; "
        f"{args.repeats} alternating repeats x {args.steps - args.warmup} measured steps; "
        f"hybrid2d settings: {args.set or 'defaults'}"
    )
    print(format_table(results, args.device))
    if len(families(args)) > 1:
        table = family_table(by_family, args)
        print(f"\nfamilies (hybrid2d), the same shape as each builds it:\n{table}")
    if args.balance_cost:
        print(f"\n{balance_cost(results)}")
    if args.comm:
        from hybrid2d.comm_report import format_comm

        for mesh, row in results.items():
            table = format_comm(row["comm"], row["comm_analytic"])
            print(f"\ncommunication per rank per step, {mesh}:\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
