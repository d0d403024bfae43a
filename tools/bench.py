"""Throughput side by side: hybrid2d vs transformers-native distributed vs one process.

    python tools/bench.py                     # CPU: 2x2 and 1x2 meshes, llama-debug-like shape
    python tools/bench.py --mesh 2x2 --repeats 3 --comm

Runs alternate (hybrid2d, transformers, single, hybrid2d, ...) so that drift of a shared machine
hits every kind alike; each figure is the median over all measured steps of all repeats. All kinds
start from the same weights and see the same global batches (the first-step losses are printed
and compared). Parallel efficiency = single-process step time / distributed step time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from hybrid2d.config import ModelConfig  # noqa: E402
from hybrid2d.metrics import flops_per_token  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_worker.py")

# Dense bf16 peak FLOP/s per device, for MFU on CUDA.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def bench_model(args) -> ModelConfig:
    return ModelConfig(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_dim=args.ffn,
        vocab_size=args.vocab,
    )


def write_model_dir(model: ModelConfig, path: str) -> None:
    """One set of random weights as a HF directory that every kind starts from."""
    import dataclasses

    from transformers import LlamaConfig, LlamaForCausalLM

    from hybrid2d.models.llama import Llama

    ours = Llama(model)
    ours.init_weights(0)
    hf_cfg = LlamaConfig(
        hidden_size=model.dim,
        intermediate_size=model.ffn_dim,
        num_hidden_layers=model.n_layers,
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads,
        vocab_size=model.vocab_size,
        rms_norm_eps=model.norm_eps,
        max_position_embeddings=model.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},
        tie_word_embeddings=model.tie_embeddings,
    )
    hf = LlamaForCausalLM(hf_cfg)
    hf.load_state_dict(ours.state_dict())
    hf.save_pretrained(path)
    with open(os.path.join(path, "hybrid2d_model.json"), "w") as f:
        json.dump(dataclasses.asdict(model), f)


def launch(kind: str, dp: int, tp: int, args, model_dir: str, extra: list[str]) -> dict:
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    common = [
        WORKER,
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
        "--out",
        out,
        *extra,
    ]
    if kind == "single":
        cmd = [sys.executable, *common]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(dp * tp),
            "--master_port",
            str(_free_port()),
            *common,
        ]
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"bench: {kind} {dp}x{tp} failed:\n{proc.stderr[-4000:]}")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    return runs


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
            "peak_rss_mib": max(max(r["peak_rss"]) for r in kind_runs) / 2**20,
        }
    k = row["kinds"]
    if "single" in k:
        for label in k:
            k[label]["efficiency"] = k["single"]["step_s"] / k[label]["step_s"]
    if "transformers" in k:
        row["speedup_vs_transformers"] = k["transformers"]["step_s"] / k["hybrid2d"]["step_s"]
    for label in k:
        k[label]["vs_hybrid2d_default"] = k["hybrid2d"]["step_s"] / k[label]["step_s"]
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        peak = next((v for n, v in PEAK_FLOPS.items() if n in name), None)
        if peak:
            fpt = flops_per_token(model, args.seq_len)
            row["mfu_hybrid2d"] = fpt * k["hybrid2d"]["tokens_per_s"] / (peak * args.world)
    return row


def format_table(results: dict) -> str:
    lines = [
        "| mesh | kind | step (s) | tokens/s | parallel eff. | speed vs hybrid2d default "
        "| peak RSS/rank (MiB) | first loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mesh, row in results.items():
        for label, r in row["kinds"].items():
            eff = f"{r['efficiency']:.0%}" if "efficiency" in r and label != "single" else ""
            lines.append(
                f"| {mesh} | {label} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {eff} | "
                f"{r['vs_hybrid2d_default']:.2f}x | {r['peak_rss_mib']:.0f} | "
                f"{r['first_loss']:.5f} |"
            )
        if "speedup_vs_transformers" in row:
            lines.append(
                f"| {mesh} | **hybrid2d / transformers tokens/s** | "
                f"**{row['speedup_vs_transformers']:.2f}x** | | | | | |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mesh", action="append", help="DPxTP, repeatable (default 2x2 and 1x2)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--vocab", type=int, default=4096)
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
        "--levers-only",
        action="store_true",
        help="skip transformers and the single process (compare levers only)",
    )
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    meshes = args.mesh or ["2x2", "1x2"]
    model = bench_model(args)
    results = {}
    started = time.time()
    with tempfile.TemporaryDirectory() as model_dir:
        write_model_dir(model, model_dir)
        for mesh in meshes:
            dp, tp = (int(x) for x in mesh.lower().split("x"))
            args.world = dp * tp
            runs = measure(dp, tp, args, model_dir)
            results[mesh] = summarize(runs, args, model)
            if args.comm:
                from hybrid2d.comm_report import analytic_step

                local = args.global_batch // dp
                results[mesh]["comm"] = runs["comm"]["comm"]
                results[mesh]["comm_analytic"] = analytic_step(model, dp, tp, local, args.seq_len)
    print(
        f"# hybrid2d bench {time.strftime('%Y-%m-%d')} on {platform.node()} "
        f"({os.cpu_count()} cores, torch {torch.__version__}); {time.time() - started:.0f} s"
    )
    print(
        f"model dim {args.dim}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, ffn "
        f"{args.ffn}, vocab {args.vocab}; seq {args.seq_len}, global batch {args.global_batch}; "
        f"{args.repeats} alternating repeats x {args.steps - args.warmup} measured steps; "
        f"hybrid2d settings: {args.set or 'defaults'}"
    )
    print(format_table(results))
    if args.comm:
        from hybrid2d.comm_report import format_comm

        for mesh, row in results.items():
            table = format_comm(row["comm"], row["comm_analytic"])
            print(f"\ncommunication per rank per step, {mesh}:\n{table}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
