"""Measure the machine this runs on, at the model's shapes, into a hardware profile.

What the cost model needs, each measured the way a training step meets it:
- matmul FLOP/s of one block's GEMMs (q, k, v, o, gate, up, down) and the output
  projection, forward and both backward products, for each micro batch's token count and tp;
- attention FLOP/s of SDPA (causal, GQA) forward + backward at the same shapes;
- the bandwidth the block's elementwise ops reach (norms, residual adds, RoPE, the attention
  output's re-layout, SiLU x up, forward + backward), in the bytes `model.block_elementwise_bytes`
  counts, so that the model's count divided by this figure is the measured time;
- the optimizer: fused AdamW plus clipping, seconds per parameter;
- the CPU cost of one dispatched op: a block's forward + backward at a tiny shape of the same
  structure, over its ops counted by a dispatch mode (`ops.block_ops`);
- one whole block's forward + backward under each checkpointing mode: what selective and full
  cost beyond the recompute the model prices, its ops included (the rest is the checkpoint's
  dispatch modes' Python per op);
- one whole block's forward + backward without checkpointing at one and two samples: what it
  takes beyond the pieces above, priced (a fixed part and a part per token);
- the wait a tp collective adds when it follows compute, as in a step (each rank must be
  scheduled and done computing), over the collective back to back plus the compute alone;
- one block sharded by the trainer's tp plan over the measuring processes: what its parallel
  forward costs beyond its share of the work, the residual and its priced collectives; and
  one block as an FSDP2 unit over them: what FSDP costs beyond its priced collectives;
- collectives (all-gather, reduce-scatter, all-reduce) at the sizes a step uses, inside a node
  (CPU: the process group the trainer creates, or the shared-memory transport; CUDA: NCCL between
  two GPUs when there are two) and, on CPU, across nodes (gloo over TCP): latency and bandwidth
  fitted by least squares over the sizes.

CPU: `procs` processes (default 2) measure at the same time, each with cores/procs threads, as
ranks do; rates are stored per core (the model gives each rank cores/ranks of them). CUDA: one
process on one GPU measures the compute figures; links not measured come from the base preset.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard

from hybrid2d.config import JobConfig, ModelConfig
from hybrid2d.errors import ConfigError
from hybrid2d.mesh import init_distributed, shutdown_distributed
from hybrid2d.models.llama import Llama, decoder_layer
from hybrid2d.parallel.sequence_comm import all_gather_dim0
from hybrid2d.planner import hardware as hwlib
from hybrid2d.planner import model as cost
from hybrid2d.planner import ops
from hybrid2d.planner.comm import analytic_step, unit_bytes
from hybrid2d.planner.hardware import KINDS, Hardware, Link, ring_factor

# Keeps a CPU calibration short: token counts above this are measured at this many tokens
# (rates flatten well before), and each figure is timed for about MIN_TIME_S.
CPU_MAX_TOKENS = 2048
MIN_TIME_S = 0.03
CPU_ROUNDS = 3


def tp_choices(m: ModelConfig) -> list[int]:
    """The tp sizes up to a node's 8 that the trainer can shard this model over."""
    sizes = (m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size)
    return [t for t in (1, 2, 4, 8) if not any(s % t for s in sizes)]


def token_counts(cfg: JobConfig, max_tokens: int | None) -> list[int]:
    """Tokens of one micro batch for micro batches 1, 2, 4, ... up to the global batch, at most
    `max_tokens` when given."""
    batches = [2**i for i in range(cfg.train.global_batch.bit_length())]
    return sorted({min(b * cfg.train.seq_len, max_tokens or math.inf) for b in batches})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    fn, device: torch.device, min_time: float = MIN_TIME_S, max_reps: int = 20, reps: int = 0
) -> float:
    """Fastest seconds per call after one warm-up call (the least disturbed on a shared
    machine): `reps` calls when given (collectives: every rank must make the same number), else
    at least 3 and about `min_time` in all."""
    fn()
    _sync(device)
    times = []
    start = time.perf_counter()
    while len(times) < (reps or 3) or (
        not reps and time.perf_counter() - start < min_time and len(times) < max_reps
    ):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def median_seconds(fn, device: torch.device, reps: int) -> float:
    """Median seconds per call of `reps` calls after one warm-up call and a barrier, every rank
    making the same calls: for what includes waits for the other ranks, which the fastest call
    would hide."""
    fn()
    _sync(device)
    dist.barrier()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- compute -------------------------------------------------------------------------------


def gemm_shapes(m: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """(in, out) of one block's GEMMs on a tp rank's weight shards (q, k, v, o, gate, up, down),
    plus the output projection."""
    hd = m.head_dim
    q, kv, ffn = m.n_heads * hd // tp, m.n_kv_heads * hd // tp, m.ffn_dim // tp
    return [
        (m.dim, q),
        (m.dim, kv),
        (m.dim, kv),
        (q, m.dim),
        (m.dim, ffn),
        (m.dim, ffn),
        (ffn, m.dim),
        (m.dim, m.vocab_size // tp),
    ]


def matmul_rate(m: ModelConfig, tokens: int, tp: int, dtype, device) -> float:
    mats = []
    flops = 0
    for k, n in gemm_shapes(m, tp):
        x = torch.randn(tokens, k, dtype=dtype, device=device)
        w = torch.randn(n, k, dtype=dtype, device=device)
        dy = torch.randn(tokens, n, dtype=dtype, device=device)
        mats.append((x, w, dy))
        flops += 3 * 2 * tokens * k * n

    def run():
        for x, w, dy in mats:
            x @ w.t()  # forward
            dy @ w  # input gradient
            dy.t() @ x  # weight gradient

    return flops / timed(run, device)


def attention_rate(m: ModelConfig, tokens: int, seq: int, tp: int, dtype, device) -> float:
    b = max(1, tokens // seq)
    h, kv, hd = m.n_heads // tp, m.n_kv_heads // tp, m.head_dim
    q = torch.randn(b, h, seq, hd, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, kv, seq, hd, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(b, kv, seq, hd, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(b, h, seq, hd, dtype=dtype, device=device)

    def run():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != kv)
        out.backward(grad)

    # flops_per_token's attention term for these tokens: 12 h hd per causal (query, key) pair
    flops = b * 6 * h * hd * seq * (seq + 1)
    return flops / timed(run, device)


def block_seconds(m: ModelConfig, tokens: int, seq: int, mode: str, dtype, device) -> float:
    """Forward + backward of one whole block (tp 1) under checkpointing `mode` (ops.block_step)."""
    return timed(ops.block_step(m, max(1, tokens // seq), seq, mode, dtype, device), device)


def sharded_block_seconds(
    m: ModelConfig, seq: int, dtype, device, tp_mesh=None, dp_mesh=None, reps: int = 9
) -> float:
    """Forward + backward of one block sharded over `tp_mesh` by the trainer's plan (one sample,
    this rank's sequence shard) or an FSDP2 unit over `dp_mesh` (one sample per rank), with the
    waits for the other ranks, as in a step."""
    run = ops.block_step(m, 1, seq, "none", dtype, device, tp_mesh, dp_mesh)
    return median_seconds(run, device, reps)


def seconds_per_op(m: ModelConfig, device, mesh=None) -> float:
    """CPU seconds per dispatched op: one block's forward + backward at a tiny shape of the
    model's structure (`ops.tiny`: every op is dispatch-bound there), over the ops dispatched in
    that same call (a dispatch counter). With `mesh` (a one-rank mesh) the block is wrapped by
    FSDP2 as the trainer wraps every block, so its hooks' Python per op is in the figure. On
    CUDA the timing includes the final synchronisation; the kernels are far shorter than their
    launches at this shape."""
    t = ops.tiny(m)
    seq = 8
    torch.manual_seed(0)
    layer = decoder_layer(t).to(device)
    if mesh is not None:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    cos, sin = Llama(dataclasses.replace(t, n_layers=0)).to(device).rope(seq, torch.float32)
    x = torch.randn(1, seq, t.dim, device=device, requires_grad=True)
    grad = torch.randn_like(x)

    def run():
        layer(x, cos, sin).backward(grad)

    run()
    with ops.OpCounter() as counter:
        run()
    return timed(run, device, min_time=0.1, max_reps=50) / counter.count


def _elt(hw: Hardware) -> int:
    """Bytes per element of what calibration measures: fp32 on CPU, bf16 on GPUs."""
    return 4 if hw.target == "cpu" else 2


def cores_measured(raw: dict, hw: Hardware) -> int:
    """How many of a profile's rate units one measuring process had: its threads on CPU, where
    rates are per core; 1 on a GPU, where rates are per device (the host's threads only feed
    it). The residuals below are stored in those units."""
    return raw["threads"] if hw.host_cores else 1


def checkpoint_overhead(raw: dict, m: ModelConfig, hw: Hardware) -> dict[str, float]:
    """Seconds per block and micro batch that a checkpointing mode costs beyond the recompute the
    model prices (`model.flops` and the block's elementwise bytes at this profile's own rates):
    on CPU mostly the per-op Python of torch.utils.checkpoint's dispatch modes. From the
    calibration's block timings, at one thread (`raw['threads']`, scaled to one core)."""
    if "block_s" not in raw:
        return {}
    tokens, threads, S = raw["block_tokens"], cores_measured(raw, hw), raw["seq_len"]
    mm = hw.matmul_rate(tokens, 1) * threads
    attn = hw.attention_rate(tokens, 1) * threads
    bw = hw.elementwise_bandwidth(tokens) * threads
    one = dataclasses.replace(m, n_layers=1)
    elementwise = sum(cost.block_elementwise_bytes(m, tokens, 1, _elt(hw)).values()) / bw
    out = {}
    for mode in ("selective", "full"):
        f = cost.flops(one, S, mode, 1)
        priced = (f["recompute_matmul"] / mm + f["recompute_attention"] / attn) * tokens
        # the recompute's own ops are priced per op (`op_overhead_s`, `ops.block_ops`)
        priced += (ops.block_ops(m, mode) - ops.block_ops(m, "none")) * hw.op_overhead_s
        extra = raw["block_s"][mode] - raw["block_s"]["none"] - priced - elementwise
        out[mode] = max(0.0, extra) * threads
    return out


def priced_block(m: ModelConfig, hw: Hardware, tokens: int, seq: int, tp: int, threads: int):
    """Seconds the model prices for one block's forward + backward without checkpointing, at
    `tokens` tokens on `tp` ranks, with `threads` cores of this profile: matmuls, attention,
    elementwise traffic and dispatched ops; no tp communication."""
    one = dataclasses.replace(m, n_layers=1)
    f = cost.flops(one, seq, "none", tp)
    block_mm = f["matmul"] - 6 * m.vocab_size * m.dim  # flops_per_token counts the head too
    kernels = (
        block_mm * tokens / tp / (hw.matmul_rate(tokens, tp) * threads)
        + f["attention"] * tokens / tp / (hw.attention_rate(tokens, tp) * threads)
        + 3
        * sum(cost.block_elementwise_bytes(m, tokens, tp, _elt(hw)).values())
        / (hw.elementwise_bandwidth(tokens) * threads)
    )
    dispatch = ops.block_ops(m, "none") * hw.op_overhead_s
    return kernels + dispatch if hw.host_cores else max(kernels, dispatch)


def block_residual(raw: dict, m: ModelConfig, hw: Hardware) -> dict[str, float]:
    """What one whole block's measured forward + backward (tp 1, no checkpointing) takes beyond
    what the model prices for it, as a fixed part and a part per token (from one and two
    samples), per core: the pieces are measured alone, and a block runs them back to back with
    autograd between, its backward's transposed operands and its allocations."""
    if "block_none_s" not in raw:
        return {}
    threads, S = cores_measured(raw, hw), raw["seq_len"]
    (n1, r1), (n2, r2) = sorted(
        (n, t - priced_block(m, hw, n, S, 1, threads)) for n, t in raw["block_none_s"]
    )
    per_token = max(0.0, (r2 - r1) / (n2 - n1))
    fixed = max(0.0, r1 - per_token * n1)
    return {"fixed": fixed * threads, "per_token": per_token * threads}


def tp_block_overhead(raw: dict, m: ModelConfig, hw: Hardware) -> float:
    """What one block sharded by the trainer's tp plan takes beyond what the model prices for
    it (its share of the work, the tp-1 residual, and its sequence-parallel collectives with
    their waits), per core: the parallel forward's wrappers, autograd functions and DTensor
    conversions."""
    if "tp_block_s" not in raw:
        return 0.0
    T, S, threads = raw["tp_block_tp"], raw["seq_len"], cores_measured(raw, hw)
    priced = priced_block(m, hw, S, S, T, threads)
    priced += hw.residual_per_block(S, T) / threads
    priced += block_tp_collectives(m, hw, T, S)
    return max(0.0, raw["tp_block_s"] - priced) * threads


def block_tp_collectives(m: ModelConfig, hw: Hardware, T: int, seq: int) -> float:
    """Seconds the model prices for one block's tp collectives at one sample (the comm
    report's counts and bytes of one layer over the intra-node link, plus `tp_sync_s` each)."""
    one, two = (
        analytic_step(dataclasses.replace(m, n_layers=n), 1, T, 1, seq, 1, elt=_elt(hw))
        for n in (1, 2)
    )
    seconds = 0.0
    for kind in KINDS:
        (count1, payload1), (count2, payload2) = (s.get(f"tp_{kind}", (0, 0)) for s in (one, two))
        count, payload = count2 - count1, payload2 - payload1
        if count:
            seconds += hw.intra.seconds(kind, T, payload, count) + count * hw.tp_sync_s
    return seconds


def crowded_tp_block_overhead(raw: dict, m: ModelConfig, hw: Hardware) -> dict[str, float]:
    """Per tp, what one tp-sharded block took with `raw['crowded']['procs']` processes on this
    host beyond what the model prices for it at that crowding (the block, its residual and
    `tp_sync_s` waits at cores / processes of a core each, its collectives x processes / cores,
    as `model.predict` prices them): seconds as measured, not per core."""
    crowded = raw.get("crowded")
    if not crowded:
        return {}
    W, S = crowded["procs"], crowded["seq_len"]
    share = hw.host_share(W)
    out = {}
    for T, measured in crowded["crowded_tp_block_s"]:
        priced = priced_block(m, hw, S, S, T, 1) / share
        priced += hw.residual_per_block(S, T) / share
        priced += block_tp_collectives(m, hw, T, S) / share
        out[str(int(T))] = max(0.0, measured - priced)
    return out


def fsdp_block_overhead(raw: dict, m: ModelConfig, hw: Hardware) -> float:
    """What one block as an FSDP2 unit over the measuring processes takes beyond what the model
    prices for it (the block, its residual, its two all-gathers and its reduce-scatter over the
    link, their copies and ops), per core: FSDP2's hooks, waits and allocations."""
    if "fsdp_block_s" not in raw:
        return 0.0
    W, S, threads = raw["fsdp_block_dp"], raw["seq_len"], cores_measured(raw, hw)
    priced = priced_block(m, hw, S, S, 1, threads)
    priced += hw.residual_per_block(S, 1) / threads
    gathered, _ = unit_bytes(m, W, 1, _elt(hw))
    reduced, _ = unit_bytes(m, W, 1, 4)
    priced += hw.intra.seconds("all_gather", W, 2 * gathered, 2)
    priced += hw.intra.seconds("reduce_scatter", W, reduced, 1)
    priced += 2 * (2 * gathered + reduced) / (hw.elementwise_bandwidth(S) * threads)
    fsdp_ops = ops.step_ops(m, "none", 1, 0, 2, 1, 0)["fsdp"]
    priced += fsdp_ops * hw.op_overhead_s
    return max(0.0, raw["fsdp_block_s"] - priced) * threads


def _rms(x, w, eps=1e-5):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def elementwise_bandwidth(m: ModelConfig, tokens: int, seq: int, dtype, device) -> float:
    """Bytes/s of one block's elementwise ops (forward + backward) at tp=1, in the bytes the
    cost model counts for them (backward as twice the forward)."""
    b = max(1, tokens // seq)
    n = b * seq
    hd = m.head_dim

    def t(*shape):
        return torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)

    x, z = t(n, m.dim), t(n, m.dim)
    w1, w2 = t(m.dim), t(m.dim)
    q, k = t(b, m.n_heads, seq, hd), t(b, m.n_kv_heads, seq, hd)
    attn = t(b, m.n_heads, seq, hd)
    gate, up = t(n, m.ffn_dim), t(n, m.ffn_dim)
    cos = torch.randn(seq, hd, dtype=dtype, device=device)
    sin = torch.randn(seq, hd, dtype=dtype, device=device)

    def run():
        h1 = _rms(x, w1)
        qr = q * cos + _rotate_half(q) * sin
        kr = k * cos + _rotate_half(k) * sin
        o = attn.transpose(1, 2).reshape(n, -1)
        x2 = x + o
        h2 = _rms(x2, w2)
        a = F.silu(gate) * up
        x3 = x2 + z
        loss = h1.sum() + qr.sum() + kr.sum() + h2.sum() + a.sum() + x3.sum()
        loss.backward()

    c = torch.tensor([], dtype=dtype).element_size()
    counted = 3 * sum(cost.block_elementwise_bytes(m, n, 1, c).values())
    return counted / timed(run, device)


def optimizer_seconds_per_param(n_params: int, device) -> float:
    """Fused AdamW step plus a global-norm clip over `n_params` fp32 parameters."""
    sizes = [n_params // 4] * 4
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def run():
        grads = [p.grad for p in params]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        torch._foreach_mul_(grads, (1.0 / (norm + 1e-6)).clamp(max=1.0))
        opt.step()

    return timed(run, device) / sum(sizes)


# ---- collectives ----------------------------------------------------------------------------


def _pg_ops(group):
    def all_gather(x):
        out = torch.empty(x.numel() * dist.get_world_size(group), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)

    def reduce_scatter(y):
        out = torch.empty(y.numel() // dist.get_world_size(group), dtype=y.dtype, device=y.device)
        dist.reduce_scatter_tensor(out, y, group=group)

    def all_reduce(x):
        dist.all_reduce(x, group=group)

    return {"all_gather": all_gather, "reduce_scatter": reduce_scatter, "all_reduce": all_reduce}


def measure_link(ops, sizes: list[int], n: int, device, rounds: int = 1) -> dict[str, list[float]]:
    """{kind: [latency_s, bytes/s]} fitted to time = latency + ring_factor x payload / bw; each
    (kind, size) is the median over `rounds` interleaved rounds of its fastest call."""
    seconds: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for kind in KINDS:
            for payload in sizes:
                numel = max(n, payload // 4 // n * n)
                x = torch.randn(numel // n if kind == "all_gather" else numel, device=device)
                dist.barrier()
                t = timed(lambda x=x, op=ops[kind]: op(x), device, reps=5)
                seconds.setdefault((kind, numel), []).append(t)
    out = {}
    for kind in KINDS:
        points = sorted(
            (numel, statistics.median(ts)) for (k, numel), ts in seconds.items() if k == kind
        )
        xs = [ring_factor(kind, n) * numel * 4 for numel, _ in points]
        out[kind] = fit_latency_bandwidth(xs, [t for _, t in points])
    return out


def tp_sync_seconds(m: ModelConfig, tokens: int, world: int, dtype, device, reps: int = 15):
    """Extra seconds a tp-sized all-gather costs when it follows compute, as in a step, over the
    same all-gather back to back (where both ranks are already in step) plus the compute alone:
    each rank must be scheduled and done computing before the collective completes. Medians of
    `reps` calls."""
    group = dist.group.WORLD
    x = torch.randn(tokens // world, m.dim, dtype=dtype, device=device)  # a sequence shard
    h = torch.randn(tokens, m.dim, dtype=dtype, device=device)
    w = torch.randn(m.dim, max(1, m.ffn_dim // world), dtype=dtype, device=device)

    def compute():
        h @ w  # one column-parallel GEMM: what a rank does between two tp collectives

    def gather():
        all_gather_dim0(x, group)

    def both():
        compute()
        gather()

    alone, gathered, interleaved = (
        median_seconds(f, device, reps) for f in (compute, gather, both)
    )
    return max(0.0, interleaved - alone - gathered)


def fit_latency_bandwidth(xs: list[float], ys: list[float]) -> list[float]:
    """Least squares of y = a + x / bw over the points; a >= 0 and bw > 0."""
    k = len(xs)
    mx, my = sum(xs) / k, sum(ys) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0
    if slope <= 0:  # flat: the largest point's average rate
        slope = max(ys) / max(xs)
    latency = max(0.0, my - slope * mx)
    return [latency, 1.0 / slope]


# ---- the whole calibration --------------------------------------------------------------------


@record  # torchrun's failure summary then ends with the failing rank's traceback
def _worker_main(args_path: str) -> None:
    """One calibration process, started by torchrun (`_launch`) with its arguments in a file;
    its process group is the trainer's (`mesh.init_distributed`: on CPU the shared-memory
    backend where it is available)."""
    with open(args_path) as f:
        args = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = JobConfig.from_dict(args["job"])
    cores = os.cpu_count() or 1
    threads = max(1, cores // world)
    torch.set_num_threads(threads)
    if args["device"] == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    init_distributed(args["device"], 300)
    try:
        if args.get("crowded"):
            result = _measure_crowded(cfg, device, world, threads)
        else:
            result = _measure(cfg, device, world, threads)
    finally:
        shutdown_distributed()
    if rank == 0:
        with open(args["out"], "w") as f:
            json.dump(result, f)


def _measure(cfg: JobConfig, device: torch.device, world: int, threads: int) -> dict:
    m, S = cfg.model, cfg.train.seq_len
    cpu = device.type == "cpu"
    dtype = torch.float32 if cpu else torch.bfloat16
    c = 4 if cpu else 2
    tokens = token_counts(cfg, CPU_MAX_TOKENS if cpu else None)
    tps = tp_choices(m)
    per = threads if cpu else 1  # rates per core on CPU
    rounds = CPU_ROUNDS if cpu else 1
    started = time.perf_counter()
    res: dict = {"tokens": tokens, "tps": tps, "threads": threads, "procs": world}

    def together():
        if world > 1:
            dist.barrier()

    # Every probe once per round, rounds interleaved, so that a shared machine's drift hits
    # each alike; each figure is the median over rounds.
    probes = {}
    for tp in tps:
        for n in tokens:
            probes[("matmul", n, tp)] = lambda n=n, tp=tp: matmul_rate(m, n, tp, dtype, device)
    whole = sorted({max(n, S) for n in tokens[:3]})  # whole sequences: attention needs them
    for tp in tps:
        for n in whole:
            probes[("attention", n, tp)] = lambda n=n, tp=tp: attention_rate(
                m, n, S, tp, dtype, device
            )
    for n in whole:
        probes[("elementwise", n, 1)] = lambda n=n: elementwise_bandwidth(m, n, S, dtype, device)
    # One sample under each checkpointing mode, and two without: the residual's two points.
    for n, mode in ((S, "none"), (S, "selective"), (S, "full"), (2 * S, "none")):
        probes[("block", n, mode)] = lambda n=n, mode=mode: (
            1.0 / block_seconds(m, n, S, mode, dtype, device)
        )
    # A one-rank mesh per process, for FSDP as the trainer applies it.
    solo = init_device_mesh(device.type, (world, 1), mesh_dim_names=("ranks", "solo"))["solo"]
    if world > 1 and m.n_heads % world == 0 and S % world == 0:
        tp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
        probes[("tp_block", S, world)] = lambda: (
            1.0 / sharded_block_seconds(m, S, dtype, device, tp_mesh=tp_mesh)
        )
    if world > 1:
        dp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
        probes[("fsdp_block", S, world)] = lambda: (
            1.0 / sharded_block_seconds(m, S, dtype, device, dp_mesh=dp_mesh)
        )
    probes[("dispatch", 0, 0)] = lambda: 1.0 / seconds_per_op(m, device, solo)
    res["dispatch_under_fsdp"] = True
    n_params = max(4096, min(4_000_000, m.num_params() // max(1, world)))
    probes[("optimizer", 0, 0)] = lambda: 1.0 / optimizer_seconds_per_param(n_params, device)
    found: dict[tuple, list[float]] = {}
    for _ in range(rounds):
        for key, probe in probes.items():
            together()
            per_key = 1 if key[0] in ("block", "tp_block", "fsdp_block", "dispatch") else per
            found.setdefault(key, []).append(probe() / per_key)
    rate = {key: statistics.median(values) for key, values in found.items()}
    res["matmul_table"] = [[n, tp, r] for (k, n, tp), r in rate.items() if k == "matmul"]
    res["attention_table"] = [[n, tp, r] for (k, n, tp), r in rate.items() if k == "attention"]
    res["elementwise_table"] = [[n, r] for (k, n, _), r in rate.items() if k == "elementwise"]
    res["optimizer_s_per_param"] = 1.0 / rate[("optimizer", 0, 0)]
    res["op_overhead_s"] = 1.0 / rate[("dispatch", 0, 0)]
    res["block_s"] = {mode: 1.0 / r for (k, n, mode), r in rate.items() if k == "block" and n == S}
    res["block_none_s"] = [
        [n, 1.0 / r] for (k, n, mode), r in rate.items() if k == "block" and mode == "none"
    ]
    for (k, _, tp), r in rate.items():
        if k == "tp_block":
            res["tp_block_s"], res["tp_block_tp"] = 1.0 / r, tp
        if k == "fsdp_block":
            res["fsdp_block_s"], res["fsdp_block_dp"] = 1.0 / r, tp
    res["block_tokens"], res["seq_len"] = S, S
    res["rounds"] = rounds
    res["compute_s"] = time.perf_counter() - started
    together()

    if world > 1:
        block, root = unit_bytes(m, world, 1, 4)
        acts = [n * m.dim * c for n in tokens]
        sizes = sorted({min(s, 64 << 20) for s in [*acts, block, root, 1 << 16]})
        # The trainer's process group: on CPU the shared-memory backend where it is available
        # (mesh.process_group_backend).
        group = dist.group.WORLD
        res["intra"] = measure_link(_pg_ops(group), sizes, world, device, rounds)
        res["intra_how"] = f"the trainer's process group ({dist.get_backend(group)})"
        tp_tokens = S * max(1, world)  # one sample per micro batch, split over the ranks
        res["tp_sync_s"] = statistics.median(
            tp_sync_seconds(m, tp_tokens, world, dtype, device) for _ in range(rounds)
        )
        if cpu:
            gloo = dist.new_group(backend="gloo")
            res["inter"] = measure_link(_pg_ops(gloo), sizes, world, device, rounds)
            res["inter_how"] = "gloo over TCP (loopback)"
        res["collective_sizes"] = sizes
    res["seconds"] = time.perf_counter() - started
    return res


def crowded_tps(m: ModelConfig, seq: int, world: int) -> list[int]:
    """The tp sizes a crowded calibration of `world` processes measures: each that divides the
    processes, the heads, the kv heads and the sequence."""
    return [
        t
        for t in range(2, world + 1)
        if world % t == 0 and m.n_heads % t == 0 and m.n_kv_heads % t == 0 and seq % t == 0
    ]


def _measure_crowded(cfg: JobConfig, device: torch.device, world: int, threads: int) -> dict:
    """One tp-sharded block (one sample, as `sharded_block_seconds`) in every tp group of
    `world` processes at once, for each tp of `crowded_tps`: what a step's tp collectives wait
    when the ranks outnumber the cores."""
    m, S = cfg.model, cfg.train.seq_len
    res: dict = {"procs": world, "threads": threads, "seq_len": S, "crowded_tp_block_s": []}
    for tp in crowded_tps(m, S, world):
        tp_mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        seconds = [
            sharded_block_seconds(m, S, torch.float32, device, tp_mesh=tp_mesh["tp"])
            for _ in range(CPU_ROUNDS)
        ]
        res["crowded_tp_block_s"].append([tp, statistics.median(seconds)])
    return res


def calibrate(
    cfg: JobConfig,
    device: str = "cpu",
    base: Hardware | None = None,
    procs: int | None = None,
    crowd: int | None = None,
) -> tuple[Hardware, dict]:
    """A profile of this machine for `cfg`'s shapes, and the raw measurements, taken by `procs`
    ranks in the trainer's process group. CPU: with `crowd` (more processes than cores), a
    second launch of that many processes measures tp-sharded blocks as crowded."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but no CUDA device is visible; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r} is not one of cpu, cuda")
    if procs is None:
        procs = 2 if device == "cpu" else min(2, torch.cuda.device_count())
    cores = os.cpu_count() or 1
    if crowd is not None and (device != "cpu" or crowd <= cores):
        raise ConfigError(
            f"crowd={crowd}: a crowded calibration is for CPU with more processes than the "
            f"{cores} cores"
        )
    job = dataclasses.asdict(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "calibration.json")
        # Also one process measures as a rank of a process group, as the trainer runs one GPU:
        # the dispatch probe then wraps its block by FSDP2 like the trainer's blocks (on one
        # H200, a bare block's 9.4 us per op could not explain a step's ~30 us).
        args = {"job": job, "device": device, "out": out}
        _launch(max(1, procs), args, tmp)
        with open(out) as f:
            raw = json.load(f)
        if crowd and crowded_tps(cfg.model, cfg.train.seq_len, crowd):
            _launch(crowd, dict(args, crowded=True), tmp)
            with open(out) as f:
                raw["crowded"] = json.load(f)
    return profile_from(raw, cfg, device, base), raw


def _launch(procs: int, args: dict, tmp: str, timeout: float = 600) -> None:
    """Run `procs` calibration processes as the ranks of one host under torchrun (its standalone
    rendezvous binds a free port itself) and wait for them."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args_path = os.path.join(tmp, "args.json")
    with open(args_path, "w") as f:
        json.dump(args, f)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    worker = ["-m", "hybrid2d.planner.calibrate", args_path]  # _worker_main, below
    command = [*torchrun, f"--nproc-per-node={procs}", *worker]
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.terminate()  # torchrun stops its ranks on SIGTERM
            proc.wait()
    if proc.returncode:
        raise RuntimeError(
            f"calibration failed: torchrun exited {proc.returncode}: {err.strip()[-2000:]}"
        )


def profile_from(raw: dict, cfg: JobConfig, device: str, base: Hardware | None) -> Hardware:
    """The measurements as a Hardware profile (links not measured come from `base`)."""
    cores = os.cpu_count() or 1
    if device == "cpu":
        base = base or hwlib.cpu_guess()
        best = max(r[2] for r in raw["matmul_table"])
        hw = dataclasses.replace(
            base,
            name="cpu-calibrated",
            description=f"this host ({cores} cores), calibrated for {cfg.recipe} with "
            f"{raw['procs']} processes x {raw['threads']} threads",
            peak_flops=best * cores,
            memory_bandwidth=max(r[1] for r in raw["elementwise_table"]) * cores,
            host_cores=cores,
            comm_overlap=False,
            sources={
                "all": f"measured by tools/plan.py --calibrate --device cpu on "
                f"{time.strftime('%Y-%m-%d')} ({raw['seconds']:.0f} s)",
                "peak_flops": "the best measured matmul rate per core x cores",
                "intra": raw.get("intra_how", "not measured"),
                "inter": raw.get("inter_how", "not measured"),
            },
        )
    else:
        if base is None:
            base = hwlib.get(hwlib.preset_for_device(torch.cuda.get_device_name()) or "h100")
        hw = dataclasses.replace(
            base,
            name=f"{base.name}-calibrated",
            description=f"{torch.cuda.get_device_name()} calibrated for {cfg.recipe}; "
            f"vendor figures and unmeasured links from the {base.name} preset",
            eager_efficiency=1.0,
            sources={
                **base.sources,
                "eager_efficiency": "1.0: the rates below were measured eager",
                "matmul_table": "measured (bf16, the model's GEMMs, forward + backward)",
                "attention_table": "measured (SDPA forward + backward)",
                "elementwise_table": "measured (the block's elementwise ops)",
            },
        )
    for name in ("matmul_table", "attention_table", "elementwise_table", "optimizer_s_per_param"):
        setattr(hw, name, raw[name])
    if "intra" in raw:
        hw.intra = Link(bandwidth=max(v[1] for v in raw["intra"].values()), measured=raw["intra"])
        hw.sources["intra"] = f"measured with {raw['procs']} processes: {raw['intra_how']}"
    if "inter" in raw:
        hw.inter = Link(bandwidth=max(v[1] for v in raw["inter"].values()), measured=raw["inter"])
    if "op_overhead_s" in raw:
        hw.op_overhead_s = raw["op_overhead_s"]
        hw.sources["op_overhead_s"] = (
            "measured: one block's forward + backward at a tiny shape of the model's structure "
            "(dispatch-bound), wrapped by FSDP2 on a one-rank mesh as the trainer wraps blocks, "
            "over its aten ops counted by a dispatch mode"
        )
    hw.checkpoint_overhead_s = checkpoint_overhead(raw, cfg.model, hw)
    if hw.checkpoint_overhead_s:
        hw.sources["checkpoint_overhead_s"] = (
            "measured: one block's forward + backward under each checkpointing mode, less none "
            "and less the recompute the model prices at this profile's rates"
        )
    hw.block_residual_s = block_residual(raw, cfg.model, hw)
    if hw.block_residual_s:
        hw.sources["block_residual_s"] = (
            "measured: one block's forward + backward (tp 1, no checkpointing) at one and two "
            "samples, less what the model prices for it at this profile's rates and op cost"
        )
    if "tp_sync_s" in raw:
        hw.tp_sync_s = raw["tp_sync_s"]
        hw.sources["tp_sync_s"] = (
            f"measured with {raw['procs']} processes: an all-gather of a sequence shard after a "
            "GEMM, over the two apart (median of interleaved calls)"
        )
    hw.tp_block_overhead_s = tp_block_overhead(raw, cfg.model, hw)
    if "tp_block_s" in raw:
        hw.sources["tp_block_overhead_s"] = (
            f"measured with {raw['procs']} processes: one block sharded by the trainer's tp plan "
            f"over tp={raw['tp_block_tp']} (median call), less what the model prices for it"
        )
    hw.crowded_tp_block_overhead_s = crowded_tp_block_overhead(raw, cfg.model, hw)
    if hw.crowded_tp_block_overhead_s:
        hw.crowded_ranks = raw["crowded"]["procs"]
        hw.sources["crowded_tp_block_overhead_s"] = (
            f"measured with {hw.crowded_ranks} processes on {cores} cores: one block sharded by "
            "the trainer's tp plan in every tp group at once (median of rounds), less what the "
            "model prices for it at that crowding"
        )
    hw.fsdp_block_overhead_s = fsdp_block_overhead(raw, cfg.model, hw)
    if "fsdp_block_s" in raw:
        hw.sources["fsdp_block_overhead_s"] = (
            f"measured with {raw['procs']} processes: one block as an FSDP2 unit over "
            f"{raw['fsdp_block_dp']} ranks (median call), less what the model prices for it"
        )
    hw.check("calibrated profile")
    return hw


if __name__ == "__main__":
    _worker_main(sys.argv[1])
