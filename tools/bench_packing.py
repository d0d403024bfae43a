"""Packed vs padded instruction rows: loss tokens per second on a mesh, and what a document
mask costs on CPU.

    python tools/bench_packing.py data --data train.jsonl --tokenizer tiny-chat   # walkthrough
    python tools/bench_packing.py data --longtail 4000 --seq-len 512              # long tail
    python tools/bench_packing.py masks --seq-len 1024

`data` launches one 2x2 run (torchrun, 4 CPU ranks) that trains the same model on the same
sample stream packed and padded, alternating (packed, padded, packed, ...) so that drift of a
shared machine hits both alike, and reports loss tokens/s (the loss tokens of each step over its
time: the samples learnt from per second), real tokens/s and samples per row of each layout.

`--longtail N` trains on N samples whose token counts are log-normal (median `--median`, tail
cut at seq_len), the shape of real chat data, instead of a file: at `--seq-len 4096`, median 300;
for a CPU run scale both down by the same factor (`--seq-len 512 --median 38`). A sample's
first 40% is prompt (no loss), the rest completion.

`masks` times one attention layer's forward + backward for rows holding documents of those
log-normal lengths, with each way the CPU can compute it exactly: SDPA with the dense boolean
mask (what models/attention.py takes on CPU), FlexAttention run eagerly, and SDPA is_causal
per document (a loop); plain causal SDPA over the whole row (not exact: it attends across
documents) is the floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from bench import bench_model, torchrun_command  # this script's folder

from hybrid2d.cli import OneLineParser
from hybrid2d.config import JobConfig
from hybrid2d.data.instruct import InstructionDataset, InstructStats
from hybrid2d.models.attention import dense_mask

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - every supported torch has it
    flex_attention = None


def longtail_lengths(n: int, seq_len: int, median: float, seed: int = 0) -> np.ndarray:
    """Token counts of n samples: log-normal with the given median and sigma 1 (a tail of a few
    percent beyond 5x the median), at least 8 tokens, cut at seq_len + 1."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.normal(np.log(median), 1.0, n)).astype(np.int64)
    return np.clip(lengths, 8, seq_len + 1)


def longtail_samples(n: int, seq_len: int, median: float, vocab: int, seed: int = 0):
    """An InstructionDataset of n random-token samples of longtail_lengths, loss on the last 60%
    of each."""
    lengths = longtail_lengths(n, seq_len, median, seed)
    rng = np.random.default_rng(seed + 1)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.integers(1, vocab, int(offsets[-1])).astype(np.int32)
    masks = [np.arange(k) >= int(0.4 * k) for k in lengths]
    targets = np.concatenate(masks)
    loss = np.array([int(m[1:].sum()) for m in masks], np.int32)
    stats = InstructStats(
        samples=n, loss_tokens=int(loss.sum()), tokens=int(lengths.sum()), positions=n * seq_len
    )
    return InstructionDataset(
        tokens, targets, offsets, seq_len, 0, stats, loss, np.zeros(n, dtype=bool)
    )


def job(args) -> JobConfig:
    cfg = JobConfig(recipe="bench-packing")
    cfg.model = dataclasses.replace(
        bench_model(args), max_position_embeddings=max(2048, args.seq_len)
    )
    t = cfg.train
    t.seq_len, t.global_batch, t.micro_batch, t.steps = args.seq_len, args.global_batch, 0, 10**6
    t.lr, t.warmup_steps, t.device = 1e-3, 0, "cpu"
    cfg.parallel.dp_shard, cfg.parallel.tp = args.dp, args.tp
    if args.data:
        cfg.data.path, cfg.data.tokenizer = args.data, args.tokenizer
        cfg.data.cache_dir = args.cache_dir
    return cfg


# ---- the 2x2 run (one process per rank) ------------------------------------------------------


def worker(args) -> None:
    import torch.distributed as dist

    from hybrid2d.data import build_run_data
    from hybrid2d.data.loader import GlobalBatchLoader
    from hybrid2d.layout import RunLayout
    from hybrid2d.mesh import build_mesh, init_distributed, set_cpu_threads, shutdown_distributed
    from hybrid2d.trainer import Trainer

    set_cpu_threads()
    init_distributed("cpu", 600)
    cfg = job(args)
    layout = RunLayout.build(cfg, dist.get_world_size())
    mesh = build_mesh("cpu", layout)
    loaders = {}
    for mode in ("packed", "padded"):
        if args.data:
            cfg.data.packing = mode
            main = dist.get_rank() == 0
            loaders[mode] = build_run_data(cfg, layout, mesh.dp_rank, main, dist.barrier).loader
        else:
            ds = longtail_samples(args.longtail, args.seq_len, args.median, args.vocab)
            loaders[mode] = GlobalBatchLoader(ds, layout, mesh.dp_rank, 0, mode == "packed")
    trainer = Trainer(cfg, mesh)
    figures = {mode: {"seconds": [], "loss_tokens": [], "tokens": []} for mode in loaders}
    samples = {mode: [] for mode in loaders}
    for _ in range(args.repeats):
        for mode, loader in loaders.items():
            for step in range(args.warmup + args.steps):
                before = loader.samples_consumed
                r = trainer.train_step(loader.next_batch())
                if step >= args.warmup:
                    figures[mode]["seconds"].append(r.seconds)
                    figures[mode]["loss_tokens"].append(r.loss_tokens)
                    figures[mode]["tokens"].append(r.tokens)
                    samples[mode].append(loader.samples_consumed - before)
    if dist.get_rank() == 0:
        out = {}
        for mode, f in figures.items():
            seconds = sum(f["seconds"])
            out[mode] = {
                "loss_tokens_per_s": sum(f["loss_tokens"]) / seconds,
                "tokens_per_s": sum(f["tokens"]) / seconds,
                "step_s": statistics.median(f["seconds"]),
                "samples_per_row": sum(samples[mode]) / (len(samples[mode]) * args.global_batch),
                "padding": 1
                - sum(f["tokens"])
                / (len(f["tokens"]) * args.global_batch * args.seq_len),  # fmt: skip
            }
        with open(args.out, "w") as fh:
            json.dump(out, fh)
    shutdown_distributed()


def run_data(args) -> dict:
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    argv = [os.path.abspath(__file__), "worker", "--out", out]
    for key, value in vars(args).items():
        if key not in ("mode", "out") and value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    proc = subprocess.run(torchrun_command(args.dp * args.tp, argv), capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"the {args.dp}x{args.tp} run failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    packed, padded = result["packed"], result["padded"]
    what = args.data or (f"long tail: {args.longtail} samples, log-normal median {args.median}")
    print(f"{what}, seq_len {args.seq_len}, global batch {args.global_batch}, mesh "
          f"{args.dp}x{args.tp}, {args.repeats}x{args.steps} steps per layout")  # fmt: skip
    print("| layout | samples/row | padding | step s | tokens/s (real) | loss tokens/s |")
    print("|---|---|---|---|---|---|")
    for mode, r in result.items():
        print(f"| {mode} | {r['samples_per_row']:.2f} | {r['padding']:.0%} | {r['step_s']:.3f} | "
              f"{r['tokens_per_s']:,.0f} | {r['loss_tokens_per_s']:,.0f} |")  # fmt: skip
    ratio = packed["loss_tokens_per_s"] / padded["loss_tokens_per_s"]
    print(f"packed / padded loss tokens/s: {ratio:.2f}x")
    return result


# ---- the mask options on CPU -----------------------------------------------------------------


def _documents(seq_len: int, median: float, seed: int = 0) -> torch.Tensor:
    """One row of documents with longtail_lengths, the last cut at the row's end: [1, s]."""
    lengths = longtail_lengths(4 * seq_len, seq_len, median, seed) - 1
    ends = np.cumsum(lengths)
    docs = np.searchsorted(ends, np.arange(seq_len), side="right")
    return torch.from_numpy(docs)[None]


def _per_document(q, k, v, documents):
    """SDPA is_causal over each document's slice of the row (one row)."""
    bounds = torch.nonzero(torch.diff(documents[0], prepend=documents[0, :1] - 1)).flatten()
    ends = [*bounds[1:].tolist(), documents.shape[1]]
    parts = [
        F.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, enable_gqa=True
        )
        for a, b in zip(bounds.tolist(), ends, strict=True)
    ]
    return torch.cat(parts, dim=2)


def run_masks(args) -> dict:
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    torch.manual_seed(0)
    s, heads, kv, hd = args.seq_len, args.heads, args.kv_heads, args.dim // args.heads
    documents = _documents(s, args.median)
    q = torch.randn(1, heads, s, hd, requires_grad=True)
    k = torch.randn(1, kv, s, hd, requires_grad=True)
    v = torch.randn(1, kv, s, hd, requires_grad=True)

    # Each mask is built once per batch and kind of layer, and shared by the layers: not timed.
    mask = dense_mask(documents, 0, s, q.device)
    same = documents[0]

    def allowed(b, h, qi, ki):
        return (ki <= qi) & (same[qi] == same[ki])

    block = create_block_mask(allowed, None, None, s, s, device="cpu") if flex_attention else None

    def dense():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def flex():
        # inputs that require grad are refused on CPU even under no_grad
        return flex_attention(q.detach(), k.detach(), v.detach(), block_mask=block, enable_gqa=True)

    options = {
        "dense mask + SDPA": dense,
        "per-document SDPA loop": lambda: _per_document(q, k, v, documents),
        "causal SDPA (not exact)": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        ),
    }
    if flex_attention is not None:
        options["FlexAttention, eager"] = flex
    with torch.no_grad():
        reference = dense()
        for name, fn in options.items():
            if "not exact" not in name:
                torch.testing.assert_close(fn(), reference, rtol=1e-4, atol=1e-4)
    # Round-robin over the options, medians: drift of a shared machine hits every option alike.
    runs = {name: ([], []) for name in options}
    for _ in range(args.warmup + args.steps):
        for name, fn in options.items():
            runs[name][0].append(_timed(fn, backward=False))
            if not name.startswith("Flex"):  # FlexAttention has no CPU backward (torch 2.13)
                runs[name][1].append(_timed(fn, backward=True))
    times = {
        name: tuple(statistics.median(r[args.warmup :]) if r else None for r in pair)
        for name, pair in runs.items()
    }
    docs = int(documents.max()) + 1
    print(f"one attention layer, 1 x {heads} heads ({kv} kv) x {s} tokens x head dim {hd}, "
          f"{docs} documents (log-normal, median {args.median}); dense bool mask "
          f"{s * s / 2**20:.2f} MiB per row and kind of layer")  # fmt: skip
    base = times["dense mask + SDPA"]
    print("| kernel | forward ms | vs dense | forward + backward ms | vs dense |")
    print("|---|---|---|---|---|")
    for name, (fwd, both) in times.items():
        tail = f"{both * 1e3:.1f} | {both / base[1]:.2f}x" if both else "no CPU backward | -"
        print(f"| {name} | {fwd * 1e3:.1f} | {fwd / base[0]:.2f}x | {tail} |")
    return times


def _timed(fn, backward: bool) -> float:
    start = time.perf_counter()
    if backward:
        fn().sum().backward()
    else:
        with torch.no_grad():
            fn()
    return time.perf_counter() - start


def main(argv=None) -> None:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["data", "masks", "worker"])
    p.add_argument("--data", help="an instruction .jsonl (the walkthrough's train.jsonl)")
    p.add_argument("--tokenizer", help="the tokenizer for --data (the walkthrough's tiny-chat)")
    p.add_argument("--cache-dir", default="", help="data cache (default ~/.cache/hybrid2d)")
    p.add_argument("--longtail", type=int, help="samples of the log-normal set instead of --data")
    p.add_argument("--median", type=float, default=38.0, help="median tokens of the long tail")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=96)
    p.add_argument("--vocab", type=int, default=384)
    p.add_argument("--steps", type=int, default=6, help="measured steps per layout and repeat")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mode == "data" and not args.data and not args.longtail:
        p.error("data needs --data FILE (with --tokenizer) or --longtail N")
    if args.data and not args.tokenizer:
        p.error("--data needs --tokenizer (the walkthrough's: the tiny-chat directory)")
    if args.mode == "worker":
        worker(args)
    elif args.mode == "data":
        run_data(args)
    else:
        run_masks(args)


if __name__ == "__main__":
    main()
