"""Predicted step time and memory of one configuration: the project's exact pieces, priced.

The pieces are the project's own, called as they are, never re-derived:
- memory: `memory.estimate` for the same job and mesh (rank 0, the largest shard);
- collectives: `comm.analytic_step` (counts and payload bytes of one step), all-gathers
  and tp collectives in the compute dtype, FSDP's reduce-scatters in fp32 (its reduce dtype);
- FLOPs: `metrics.flops_per_token` (the MFU numerator); its attention part is
  `flops_per_token(m, S) - flops_per_token(m, 0)`.

Priced per rank and per optimizer step (b = micro batch, S = sequence, N = b*S tokens):

    compute   = matmul FLOPs (model + recompute + the k/v projections of kv heads that tp
                ranks share when tp > kv heads) / achieved matmul rate at (N, tp)
              + attention FLOPs (model + recompute) / achieved attention rate
              + elementwise bytes / achieved memory bandwidth
              + checkpointing's calibrated overhead per block and micro batch (CPU: the
                per-op Python of its dispatch modes, which FLOPs and bytes do not see)
              + the calibrated block residual per block and micro batch: what a whole block
                measured beyond these pieces (fixed + per token / tp)
    tp comm   = sum over tp collectives of latency + ring factor x bytes / intra-node bandwidth
                + the calibrated wait for the other ranks (`tp_sync_s`, CPU), all on the
                critical path (no async TP); full checkpointing repeats each
                block's two sequence gathers and its attention reduce-scatter
                + the calibrated cost of a tp-sharded block's parallel forward beyond all
                that, per block and micro batch (`tp_block_overhead_s`; on a CPU host with
                more ranks than cores, `crowded_tp_block_overhead_s`, measured so crowded)
    FSDP comm = the all-gathers (forward, backward re-gather) and reduce-scatters of
                `analytic_step`, plus HSDP's all-reduce of the gradient shards across replicas,
                each over the link its group spans (NVLink when the group lies inside a node,
                else the network); exposed is what compute does not hide: the root's and first
                block's gathers and the root's reduce-scatter, and per block whatever exceeds
                that block's compute (all of it on CPU, where copies take the cores compute uses)
                + the calibrated cost of a block as an FSDP2 unit beyond its priced collectives,
                per block and micro batch (`fsdp_block_overhead_s`; the host runs it)
    optimizer = AdamW (or SGD) over the rank's parameter shard plus clipping, memory-bound

With LoRA (lora.rank > 0) the FLOPs are those a frozen base executes (`lora_flops`: no weight
gradients of the base, the adapters' own matmuls), FSDP reduce-scatters and the optimizer
steps the adapters only.

Recompute, as counted in a real step (a dispatch counter on 1x2 and 2x1, docs/planner.md): full
checkpointing reruns each block's forward up to the last tensor backward needs (matmuls but the
down projection, attention, elementwise ops, and on tp > 1 both sequence gathers and the
attention's reduce-scatter: non-reentrant checkpointing stops recomputing once every saved
tensor is back, and down's output and the MLP's reduce-scatter feed no saved tensor);
selective reruns the elementwise ops and, on tp > 1, the o projection (row-parallel outputs
are not kept, `parallel/activation_checkpoint.py`; down is past the last needed tensor). With
tp = 1 selective reruns no matmul. Neither reruns any other collective.

Elementwise traffic is counted per element of each unfused eager op (bytes read + written):
RMSNorm (fp32 upcast, square, mean, scale, cast back, weight) on the sequence-parallel [N/tp, dim]
residual stream (four with sandwich norms), two residual adds, RoPE on q and k (and their
per-head norms), the attention output's re-layout, the activation (SiLU or GELU) and the gate x
up product; backward is counted as twice the forward; the logits' fp32 cast and cross
entropy over [N, vocab/tp]; FSDP's copy-in / copy-out of every gathered or reduced buffer.
This is an approximation (the only one here not checked against a measurement of its own); a
calibrated profile measures the bandwidth these same ops reach at the model's shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from hybrid2d.config import JobConfig, LoraConfig, ModelConfig
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from hybrid2d.metrics import flops_per_token
from hybrid2d.planner import ops
from hybrid2d.planner.comm import analytic_step, lora_terms, unit_bytes
from hybrid2d.planner.hardware import KINDS, Hardware, Link
from hybrid2d.planner.lora_flops import lora_flops
from hybrid2d.planner.memory import (
    adapter_params,
    compute_dtype_bytes,
    estimate,
    fsdp_shard,
    kv_heads_per_rank,
    model_params,
    tp_local_shape,
)

GiB = 2**30
DEFAULT_HEADROOM = 0.10
# The trainer settings a candidate fixes (what parallel.plan=auto chooses).
PLANNED = (
    "parallel.dp_replicate",
    "parallel.dp_shard",
    "parallel.tp",
    "parallel.activation_checkpoint",
    "train.micro_batch",
)


@dataclass
class Candidate:
    """One configuration with its prediction; the JSON fields of `tools/plan.py --json`."""

    dp_replicate: int
    dp_shard: int
    tp: int
    activation_checkpoint: str
    micro_batch: int  # samples per forward/backward on a dp rank (the per-rank batch: none)
    fits: bool
    peak_gib: float  # memory.py's per-rank peak
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    compute_s: float
    tp_comm_s: float
    fsdp_comm_s: float  # exposed FSDP / HSDP communication
    optimizer_s: float
    memory_limit_gib: float
    reason: str
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def flags(self) -> list[str]:
        """The trainer's settings for this candidate (PLANNED, each named as its field here)."""
        values = [getattr(self, name.split(".")[1]) for name in PLANNED]
        return [
            arg for name, v in zip(PLANNED, values, strict=True) for arg in (f"--{name}", str(v))
        ]


# ---- the pieces ------------------------------------------------------------------------------


def flops(
    m: ModelConfig,
    seq_len: int,
    activation_checkpoint: str,
    tp: int = 1,
    lora: LoraConfig | None = None,
) -> dict[str, float]:
    """FLOPs per training token: the model's (flops_per_token, split into matmuls and attention),
    forward alone, what checkpointing recomputes (selective: the o projection when tp > 1, else
    none) and what tp ranks compute twice: when tp exceeds the kv heads, each rank projects the
    one kv head its query heads use, so the k and v projections run tp / kv_heads times over
    (per token of the rank's share, 12 x dim x head_dim per block and head beyond the model's kv
    heads). With LoRA (lora.rank > 0) what the step executes instead: `lora_flops`."""
    if lora is not None and lora.rank:
        return lora_flops(m, lora, seq_len, activation_checkpoint, tp)
    total = flops_per_token(m, seq_len)
    matmul = flops_per_token(m, 0)  # the attention term is proportional to the sequence
    attention = total - matmul
    head = 6 * m.vocab_size * m.dim  # the output projection (no recompute: outside the blocks)
    if activation_checkpoint == "full":  # the block's forward but its last matmul (down)
        down = 2 * m.n_layers * m.dim * m.ffn_dim
        recompute_mm, recompute_attn = (matmul - head) / 3 - down, attention / 3
    elif activation_checkpoint == "selective":
        recompute_mm = 2 * m.n_layers * m.dim * m.n_heads * m.head_dim if tp > 1 else 0.0
        recompute_attn = 0.0
    else:
        recompute_mm = recompute_attn = 0.0
    extra_kv = max(0, tp - m.n_kv_heads)
    return {
        "model": total,
        "matmul": matmul,
        "attention": attention,
        "forward_matmul": matmul / 3,
        "forward_attention": attention / 3,
        "recompute_matmul": recompute_mm,
        "recompute_attention": recompute_attn,
        "replicated_matmul": 12.0 * m.n_layers * m.dim * m.head_dim * extra_kv,
    }


def norm_bytes_per_element(c: int) -> int:
    """Eager RMSNorm: upcast (when not fp32), square, mean, scale, cast back, weight."""
    cast = (c + 4) if c != 4 else 0
    return 2 * cast + 8 + 4 + 8 + 2 * c


def block_elementwise_bytes(m: ModelConfig, tokens: int, tp: int, c: int) -> dict[str, float]:
    """Bytes read + written by one block's elementwise ops in forward for `tokens` tokens (Gemma 3's
    sandwich norms double the block's norms; Qwen3's and Gemma 3's q/k norms run per head)."""
    hd = m.head_dim
    local = tokens / tp  # sequence-parallel residual stream
    heads = m.n_heads / tp + kv_heads_per_rank(m, tp)  # the heads RoPE and q/k norms see
    norms = 4 if m.sandwich_norms else 2
    out = {
        "norms": norms * local * m.dim * norm_bytes_per_element(c),
        "residual adds": 2 * local * m.dim * 3 * c,
        "rope": tokens * heads * hd * 10 * c,
        "attention re-layout": tokens * m.n_heads / tp * hd * 2 * c,
        "act x up": tokens * m.ffn_dim / tp * 5 * c,
    }
    if m.qk_norm:
        out["q/k norms"] = tokens * heads * hd * norm_bytes_per_element(c)
    return out


def head_elementwise_bytes(m: ModelConfig, tokens: int, tp: int, c: int) -> float:
    """Final norm, embedding lookup / gradient, fp32 logits and cross entropy (fwd + bwd)."""
    logits = tokens * m.vocab_size / tp
    cast = logits * (c + 4) if c != 4 else 0
    cross_entropy = logits * 4 * 8  # log-softmax (max, exp-sum, write) and its backward
    norm = 3 * tokens / tp * m.dim * norm_bytes_per_element(c)
    embedding = 3 * tokens * m.dim * c + m.vocab_size / tp * m.dim * c
    if m.scale_embeddings:  # Gemma: x sqrt(dim), forward and backward
        embedding += 4 * tokens / tp * m.dim * c
    return cast + cross_entropy + norm + embedding


def _key(m: ModelConfig) -> tuple:
    return tuple(sorted(dataclasses.asdict(m).items()))


def _lora_key(lcfg: LoraConfig) -> tuple | None:
    """The adapters' shape settings (None: full fine-tuning), a cache key."""
    return (lcfg.rank, lcfg.target_names()) if lcfg.rank else None


@functools.lru_cache(maxsize=256)
def _local_params(key: tuple, tp: int, dp_shard: int, lora: tuple | None = None) -> int:
    """Parameters rank 0 updates (its FSDP shard of its TP slice; rank 0 has the largest) of the
    model `_key` gave: every weight, or with LoRA (`_lora_key`) the adapters only (cached: the
    search asks for every candidate)."""
    m = ModelConfig(**dict(key))
    if lora:
        rank, targets = lora
        trained = adapter_params(m, LoraConfig(rank=rank, targets=",".join(targets)))
    else:
        trained = model_params(m)
    return sum(fsdp_shard(tp_local_shape(p, tp), dp_shard, 0)[1] for p in trained)


def group_inside_node(span: int, gpus_per_node: int) -> bool:
    """A group of contiguous ranks `span` wide (or strided within such a block) stays inside a
    node when the block does: ranks are numbered node by node."""
    return span <= gpus_per_node and gpus_per_node % span == 0


@dataclass
class GroupLink:
    """The link a process group's collectives run over. A group that leaves the node uses each
    node's `lanes` NICs at once (one per member of the group on that node): NCCL's rings enter
    and leave a node once per channel, one channel per NIC, and forward what enters over NVLink
    to the node's other members, so a node's share of an all-gather crosses the network once,
    not once per GPU (nccl-tests' inter-node bus bandwidth is the node's NICs together). The
    NVLink hops inside each node still carry the whole ring: the slower of the two sets the
    time."""

    link: Link
    lanes: int = 1
    intra: Link | None = None  # the in-node link a cross-node group also uses
    kind: str = "intra"

    def seconds(self, kind: str, n: int, payload: float, count: int = 1) -> float:
        if self.lanes <= 1 or self.intra is None:
            return self.link.seconds(kind, n, payload, count)
        across = self.link.seconds(kind, n, payload / self.lanes, count)
        return max(across, self.intra.seconds(kind, n, payload, count))


def group_link(hw: Hardware, size: int, stride: int, gpus_per_node: int) -> GroupLink:
    """The link of a group of `size` ranks `stride` apart (ranks are numbered node by node)."""
    if group_inside_node(size * stride, gpus_per_node):
        return GroupLink(hw.intra)
    lanes = max(1, min(size, gpus_per_node // stride)) if hw.target == "cuda" else 1
    return GroupLink(hw.inter, lanes, hw.intra, "inter")


# ---- the prediction --------------------------------------------------------------------------


def predict(
    cfg: JobConfig,
    layout: RunLayout,
    hardware: Hardware,
    gpus_per_node: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
    documents: bool = False,
) -> Candidate:
    """Step time, throughput, MFU and peak memory of `cfg` laid out as `layout` (ConfigError
    when a tp group would cross nodes). `documents`: the rows are packed with several
    documents (`planner.launch.packed_documents`), whose masks the memory estimate prices."""
    G = gpus_per_node or hardware.gpus_per_node
    if not group_inside_node(layout.tp, G):
        raise ConfigError(f"tp={layout.tp} crosses nodes ({G} GPUs per node)")
    return predict_valid(cfg, layout, hardware, G, headroom, documents)


def tp_block_overhead(hw: Hardware, T: int, ranks_on_host: int, comm_scale: float) -> float:
    """Seconds per block and micro batch a tp-sharded block costs beyond its priced pieces: on a
    host with more ranks than cores, the crowded measurement for this tp when there is one
    (beyond the ranks it was measured with, in proportion), else the uncrowded one x ranks /
    cores."""
    crowded = hw.crowded_tp_block_overhead_s.get(str(T))
    if hw.host_cores and ranks_on_host > hw.host_cores and crowded is not None:
        return crowded * max(1.0, ranks_on_host / max(1, hw.crowded_ranks))
    return hw.tp_block_overhead_s * comm_scale


def predict_valid(
    cfg: JobConfig,
    layout: RunLayout,
    hw: Hardware,
    G: int,
    headroom: float = DEFAULT_HEADROOM,
    documents: bool = False,
) -> Candidate:
    """`predict` without the node check (the search checks each mesh once), with G GPUs per
    node. The model, mesh, batch split and checkpointing are the layout's."""
    m, t, p = layout.model, cfg.train, cfg.parallel
    W, T, Sh, R = layout.world, layout.tp, layout.dp_shard, layout.dp_replicate
    ac = layout.activation_checkpoint
    c = compute_dtype_bytes(cfg, hw.target)
    local, b, n_micro = layout.local_batch, layout.micro_batch, layout.n_micro
    S = t.seq_len
    N = b * S
    ranks_on_host = min(W, G)
    share = hw.host_share(ranks_on_host)  # CPU: cores per rank (per calibrated core); GPU: 1
    # The part of a core a rank gets, at most one: what the host runs takes 1 / this as long (a
    # rank with less than a core waits for one).
    core_part = min(1.0, share)
    comm_scale = 1.0 / core_part

    # ---- compute ----------------------------------------------------------------------------
    f = flops(m, S, ac, T, cfg.lora)
    rank_tokens = local * S / T  # tp ranks split the work of their dp group's tokens
    mm_flops = (f["matmul"] + f["recompute_matmul"] + f["replicated_matmul"]) * rank_tokens
    attn_flops = (f["attention"] + f["recompute_attention"]) * rank_tokens
    # Eager PyTorch's kernels reach a fraction of the compiled step's rates (hardware.py).
    eager = 1.0 if p.compile else hw.eager_efficiency
    mm_rate = hw.matmul_rate(N, T) * share * eager
    attn_rate = hw.attention_rate(N, T) * share * eager
    bandwidth = hw.elementwise_bandwidth(N) * share * eager
    block_fwd = sum(block_elementwise_bytes(m, N, T, c).values())
    recompute_passes = 1 if ac in ("full", "selective") else 0
    head_bytes = head_elementwise_bytes(m, N, T, c)
    elem_per_micro = m.n_layers * block_fwd * (3 + recompute_passes) + head_bytes

    # ---- collectives (the comm report's analytic counts) ------------------------------------
    step = analytic_step(m, Sh, T, local, S, n_micro, p.reshard_after_forward, c, cfg.lora)
    step_fp32 = analytic_step(m, Sh, T, local, S, n_micro, p.reshard_after_forward, 4, cfg.lora)
    tp_link = group_link(hw, T, 1, G)
    tp_s = 0.0
    tp_bytes = 0
    tp_count = 0
    for kind in KINDS:
        count, payload = step.get(f"tp_{kind}", (0, 0))
        if ac == "full" and kind != "all_reduce" and count:
            # The recomputed forward repeats each block's two sequence gathers and the
            # attention's reduce-scatter (it stops before the MLP's, the block's last op).
            extra = (2 if kind == "all_gather" else 1) * m.n_layers * n_micro
            count, payload = count + extra, payload + extra * payload / count
        tp_s += tp_link.seconds(kind, T, payload, count) + count * hw.tp_sync_s
        tp_bytes += payload
        tp_count += count
    tp_s *= comm_scale
    if T > 1:  # calibrated: the parallel forward's own cost per block beyond the above
        tp_s += tp_block_overhead(hw, T, ranks_on_host, comm_scale) * m.n_layers * n_micro

    defer = p.defer_grad_sync and n_micro > 1
    syncs = 1 if defer else n_micro  # gradient reduce-scatters (and HSDP all-reduces) per step
    shard_link = group_link(hw, Sh, T, G)
    rep_link = group_link(hw, R, Sh * T, G)
    ag_count, ag_bytes = step.get("fsdp_all_gather", (0, 0))
    rs_count, rs_bytes = step_fp32.get("fsdp_reduce_scatter", (0, 0))
    rs_count, rs_bytes = rs_count * syncs // n_micro, rs_bytes * syncs // n_micro
    block_ag, root_ag = unit_bytes(m, Sh, T, c)
    block_rs, root_rs = unit_bytes(m, Sh, T, 4)
    if cfg.lora.rank:  # FSDP gathers the adapters with the base; only they have gradients
        adapters = lora_terms(m, cfg.lora, Sh, T)["adapters_per_block"]
        block_ag += adapters * c if Sh > 1 else 0
        block_rs, root_rs = adapters * 4, 0
    if R > 1:  # HSDP: each unit's reduced shard is all-reduced across replicas, in fp32
        if Sh > 1 or cfg.lora.rank:
            unit_shard = [block_rs / Sh, root_rs / Sh]
        else:  # replicate only: whole gradients
            full = _local_params(_key(m), T, 1) * 4
            unit_shard = [full / (m.n_layers + 1)] * 2
        ar_count = (m.n_layers + (0 if cfg.lora.rank else 1)) * syncs
        ar_bytes = (m.n_layers * unit_shard[0] + unit_shard[1]) * syncs
    else:
        unit_shard, ar_count, ar_bytes = [0, 0], 0, 0
    ag_s = shard_link.seconds("all_gather", Sh, ag_bytes, ag_count) * comm_scale
    rs_s = shard_link.seconds("reduce_scatter", Sh, rs_bytes, rs_count) * comm_scale
    ar_s = rep_link.seconds("all_reduce", R, ar_bytes, ar_count) * comm_scale
    # Calibrated: what a block as an FSDP2 unit costs beyond its priced collectives; the host
    # runs it, so compute does not hide it.
    fsdp_hooks_s = hw.fsdp_block_overhead_s * m.n_layers * n_micro * comm_scale if Sh > 1 else 0.0
    fsdp_total = ag_s + rs_s + ar_s
    # FSDP's copy-in / copy-out of every gathered and reduced buffer (memory traffic).
    elem_bytes = elem_per_micro * n_micro + 2 * (ag_bytes + rs_bytes)

    matmul_s = mm_flops / mm_rate
    attention_s = attn_flops / attn_rate
    elementwise_s = elem_bytes / bandwidth
    # Calibrated: what checkpointing costs beyond its recompute (one core's seconds per block).
    overhead = hw.checkpoint_overhead_s.get(ac, 0.0)
    checkpoint_s = overhead * m.n_layers * n_micro / core_part
    # Calibrated: what a whole block takes beyond the pieces above (fixed + per token).
    block_residual_s = hw.residual_per_block(N, T) * m.n_layers * n_micro / core_part
    # Per-op CPU cost of eager PyTorch: ops dispatched in the step x seconds per op. CPU: the
    # rank's thread runs it between kernels; GPU: the host runs ahead, so only what exceeds the
    # kernels' time is exposed.
    trained = adapter_params(m, cfg.lora) if cfg.lora.rank else model_params(m)
    op_counts = ops.step_ops(m, ac, n_micro, tp_count, ag_count, rs_count, len(trained))
    n_ops = sum(op_counts.values())
    dispatch_total = n_ops * hw.op_overhead_s / core_part
    kernels_s = matmul_s + attention_s + elementwise_s + checkpoint_s + block_residual_s
    dispatch_s = dispatch_total if hw.host_cores else max(0.0, dispatch_total - kernels_s)
    compute_s = kernels_s + dispatch_s
    forward_s = (
        f["forward_matmul"] * rank_tokens / mm_rate
        + f["forward_attention"] * rank_tokens / attn_rate
        + m.n_layers * block_fwd * n_micro / bandwidth
    )
    recompute_s = (
        f["recompute_matmul"] * rank_tokens / mm_rate
        + f["recompute_attention"] * rank_tokens / attn_rate
        + m.n_layers * block_fwd * recompute_passes * n_micro / bandwidth
        + checkpoint_s
    )

    # ---- what compute hides -------------------------------------------------------------------
    if fsdp_total == 0:
        fsdp_exposed = 0.0
    elif not hw.comm_overlap:
        fsdp_exposed = fsdp_total
    else:
        L = m.n_layers

        def one(kind, link, n, payload):
            return link.seconds(kind, n, payload) * comm_scale

        g_block = one("all_gather", shard_link, Sh, block_ag)
        g_root = one("all_gather", shard_link, Sh, root_ag)
        r_block = one("reduce_scatter", shard_link, Sh, block_rs)
        r_root = one("reduce_scatter", shard_link, Sh, root_rs)
        a_block = one("all_reduce", rep_link, R, unit_shard[0])
        a_root = one("all_reduce", rep_link, R, unit_shard[1])
        f_block = forward_s / n_micro / L
        b_block = (compute_s - forward_s) / n_micro / L
        regather = g_block if p.reshard_after_forward else 0.0
        forward = g_root + g_block + (L - 1) * max(0.0, g_block - f_block)
        exposed = 0.0
        for i in range(n_micro):
            sync = (not defer) or i == n_micro - 1
            grad = (r_block + a_block) if sync else 0.0
            backward = L * max(0.0, regather + grad - b_block)
            exposed += forward + backward + ((r_root + a_root) if sync else 0.0)
        fsdp_exposed = min(exposed, fsdp_total)
    fsdp_exposed += fsdp_hooks_s

    # ---- optimizer ----------------------------------------------------------------------------
    n_params = _local_params(_key(m), T, Sh, _lora_key(cfg.lora))  # what the optimizer steps
    # AdamW: read p, g, m, v and write p, m, v (fp32); SGD: read p, g, write p; clipping reads
    # the gradients for the norm and scales them in place.
    per_param = (28 if t.optimizer == "adamw" else 12) + 12
    if hw.optimizer_s_per_param:
        optimizer_s = n_params * hw.optimizer_s_per_param * per_param / 40 / share
    else:
        optimizer_s = n_params * per_param / (hw.memory_bandwidth * hw.memory_efficiency)
    scalars, _ = step.get("scalar_all_reduce", (0, 0))
    world_link = hw.intra if group_inside_node(W, G) else hw.inter
    optimizer_s += scalars * world_link.latency_s

    step_s = compute_s + tp_s + fsdp_exposed + optimizer_s
    tokens_per_s_per_gpu = t.global_batch * S / step_s / W
    devices = W if not hw.host_cores else math.ceil(W / G)
    mfu = f["model"] * t.global_batch * S / step_s / (hw.peak_flops * devices)

    # ---- memory -------------------------------------------------------------------------------
    est = estimate(cfg, layout, 0, hw.target, documents)
    limit = hw.memory_bytes * (1 - headroom) / (ranks_on_host if hw.host_cores else 1)
    fits = est.peak <= limit

    details = {
        "matmul_s": matmul_s,
        "attention_s": attention_s,
        "elementwise_s": elementwise_s,
        "recompute_s": recompute_s,
        "checkpoint_overhead_s": checkpoint_s,
        "block_residual_s": block_residual_s,
        "dispatch_s": dispatch_s,  # exposed per-op CPU cost, part of compute_s
        "dispatch_total_s": dispatch_total,
        "ops_per_step": n_ops,
        "ops_by_source": op_counts,
        "fsdp_all_gather_s": ag_s,
        "fsdp_reduce_scatter_s": rs_s,
        "hsdp_all_reduce_s": ar_s,
        "fsdp_total_s": fsdp_total,
        "fsdp_hooks_s": fsdp_hooks_s,
        "flops_per_token": f["model"],
        "model_flops_per_rank": f["model"] * rank_tokens,
        "recompute_flops_per_rank": (f["recompute_matmul"] + f["recompute_attention"])
        * rank_tokens,
        "replicated_flops_per_rank": f["replicated_matmul"] * rank_tokens,
        "tp_bytes": tp_bytes,
        "fsdp_all_gather_bytes": ag_bytes,
        "fsdp_reduce_scatter_bytes": rs_bytes,
        "hsdp_all_reduce_bytes": ar_bytes,
        "elementwise_bytes": elem_bytes,
        "params_per_rank": n_params,
        "peak_phase": est.peak_phase,
        "peak_bytes": est.peak,
        "micro_batches": n_micro,
        "tp_link": tp_link.kind,
        "fsdp_link": shard_link.kind,
        "replicate_link": rep_link.kind,
        "fsdp_network_lanes": shard_link.lanes,
    }
    cand = Candidate(
        dp_replicate=R,
        dp_shard=Sh,
        tp=T,
        activation_checkpoint=ac,
        micro_batch=b,
        fits=fits,
        peak_gib=est.peak / GiB,
        step_s=step_s,
        tokens_per_s_per_gpu=tokens_per_s_per_gpu,
        mfu=mfu,
        compute_s=compute_s,
        tp_comm_s=tp_s,
        fsdp_comm_s=fsdp_exposed,
        optimizer_s=optimizer_s,
        memory_limit_gib=limit / GiB,
        reason="",
        details=details,
    )
    cand.reason = reason(cand, hw, headroom)
    return cand


def reason(c: Candidate, hw: Hardware, headroom: float) -> str:
    """A short why for the table: what does not fit, or where the step's time goes."""
    if not c.fits:
        return f"{c.peak_gib:.1f} GiB > {c.memory_limit_gib:.1f} GiB ({headroom:.0%} headroom)"
    d = c.details
    link = {"intra": "NVLink" if hw.target == "cuda" else "shm", "inter": "network"}
    shares = {
        f"FSDP comm exposed ({link[d['fsdp_link']]})": c.fsdp_comm_s,
        f"tp comm ({link[d['tp_link']]})": c.tp_comm_s,
        f"recompute ({c.activation_checkpoint})": d["recompute_s"],
        "optimizer step": c.optimizer_s,
        "elementwise ops": d["elementwise_s"],
        "per-op dispatch": d.get("dispatch_s", 0.0),
    }
    name, seconds = max(shares.items(), key=lambda kv: kv[1])
    if seconds / c.step_s < 0.05:
        return f"compute-bound: matmuls {d['matmul_s'] / c.step_s:.0%} of step"
    return f"{name}: {seconds / c.step_s:.0%} of step"
