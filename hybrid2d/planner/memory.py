"""Estimated memory of one rank: an analytic model of a training step from the config and mesh.

Parameters, gradients and optimizer state are counted tensor by tensor, sharded the way the
trainer shards them: the TP plans of `parallel/tensor_parallel.py` decide which dimension of
each weight is split over tp (norm weights are replicated over tp), then FSDP2 splits the
TP-local tensor on dim 0 over dp_shard in chunks of ceil(rows / dp_shard), padding the last
chunks (so every rank stores the padded size; the optimizer's moments, made with `zeros_like`
of the unpadded local view, are not padded and differ between ranks when rows do not divide).
Sharded parameters and gradients are fp32 whatever the compute dtype (FSDP2 keeps the fp32
shards and reduces gradients in fp32); with bf16 mixed precision only the gathered copies, the
activations and the logits before `.float()` are bf16.

Activations are the tensors autograd saves, per transformer block (micro batch b, sequence s,
N = b*s tokens; sequence parallelism splits the residual stream and the norms over tp, the
attention and MLP see the gathered sequence with their heads / ffn split over tp):

    2 norms        2 * (N/tp) * dim * (4 + c)     fp32 input (or its fp32 copy) + normed (c)
                   (4 with Gemma 3's sandwich norms, after attention and after the MLP;
                   Gemma's (1 + w) norms keep the normed tensor in fp32: 4 + 4)
    attn/mlp in    2 * N * dim * c                the gathered sequence (tp > 1) or norm output
    q, k, v        N * (heads / tp + 2 max(kv_heads / tp, 1)) * head_dim * c
    q/k norms      N * (heads / tp + max(kv_heads / tp, 1)) * head_dim * (4 + c)   (Qwen3, Gemma 3)
    attention out  N * heads * head_dim / tp * c  (+ the logsumexp, fp32)
    MLP            4 * N * ffn / tp * c           gate, act(gate), up, their product

(each norm also keeps its fp32 rstd, 4 bytes a row). When tp exceeds the kv heads, each rank
holds whole k/v weights (`ParamInfo.max_shards`, from the plan's style) and computes the one kv
head its query heads use: kv_heads / tp above is then 1 (`kv_heads_per_rank`).

with c the compute bytes (4 fp32, 2 bf16). With activation checkpointing a block keeps only its
input, (N/tp) * dim * c, and one block's set is rebuilt during its backward. After the last
block: the final norm, the lm_head input and the logits, N * vocab/tp * 4 bytes in fp32. The
inputs of every block live from the first block's forward to the last block's backward: token
ids and labels, the RoPE tables (cos, sin) of each kind of layer, and (CUDA) the block mask of
each kind that has one (`attention_inputs`). On CPU the dense boolean mask [1, 1, s, s] of such a
kind lives through the forward only: SDPA saves, per layer, its additive copy (s * s * c). The
loss adds transients of the logits' size: the peak of cross entropy's backward holds 3 of them
(log-softmax output, its gradient and nll's gradient), and so does the vocab-parallel loss of
parallel/loss.py (the fp32 logits, exp, and the softmax it turns in place into the gradient).

Communication buffers are FSDP2's: each unit's gathered parameters (padded, in the compute
dtype), their gradients before the reduce-scatter, and the flat reduce-scatter input. The root
unit (embedding, final norm, lm_head) stays gathered from forward to the end of backward, and
so does the last block (the trainer does not reshard it after forward).

LoRA (lora.rank > 0) changes the terms where a frozen weight changes what exists: the base is
stored in lora.base_dtype (a bf16 base also computes in bf16) with no gradient, no reduce-scatter
and no optimizer state; the fp32 adapters (`adapter_params`, split over tp as parallel/lora.py
splits them, FSDP-sharded like any parameter) get all three. Autograd keeps less for a frozen
weight (no input of its matmul, no normed tensor of its norm) and more for the adapters (their
inputs in the adapters' dtype, the rank-r intermediates, dropout's masks):
`lora_block_activations`, and under selective checkpointing the adapters' matmul outputs
(`lora_matmul_outputs`). Measured on CPU without compile (tests/test_memory.py); with
parallel.compile a LoRA block is priced by the eager terms, not measured.

The peak is the largest total over the moments a step passes through: the loss (all
activations saved, logits' transients), the last block's backward, the end of backward (the
embedding's gradient) and the optimizer step. The model was derived from, and is checked
against, `profiling.measure.MemoryTracker` on CPU (tests/test_memory.py).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import re
from dataclasses import dataclass, field

import torch

from hybrid2d.config import JobConfig, LoraConfig, ModelConfig, resolve_mixed_precision
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from hybrid2d.models.llama import Llama
from hybrid2d.parallel.tensor_parallel import tp_plan

GiB = 2**30


# The projections whose split dim holds the key/value heads: when tp exceeds the kv heads, each
# rank keeps them whole (parallel/tensor_parallel.py replicates each kv head over the ranks whose
# query heads use it; their gradients are summed over tp).


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # the dim split over tp; None: replicated over tp
    unit: int  # FSDP unit: block index, or -1 for the root
    max_shards: int | None = None  # past this many tp ranks: replicated (kv heads)


def kv_heads_per_rank(m: ModelConfig, tp: int) -> int:
    """Key/value heads one rank computes: its share, or the one its query heads use when tp
    exceeds them (tensor_parallel.KVHeadLinear)."""
    return max(1, m.n_kv_heads // tp)


def model_params(m: ModelConfig) -> list[ParamInfo]:
    """Every parameter of the model with its tp split and FSDP unit, from a meta-device model
    and the TP plans the trainer applies (tied embeddings appear once)."""
    return list(_model_params(tuple(sorted(dataclasses.asdict(m).items()))))


@functools.lru_cache(maxsize=16)
def _model_params(key: tuple) -> tuple[ParamInfo, ...]:
    m = ModelConfig(**dict(key))
    with torch.device("meta"):
        model = Llama(m)
    plan = tp_plan(m)
    out = []
    for name, p in model.named_parameters():
        module_path = name.rsplit(".", 1)[0]
        # The plan's own patterns (`*` for the block index) decide the split, as at run time.
        styles = [st for pattern, st in plan.items() if _matches(module_path, pattern)]
        tp_dim = styles[0].shard_dim if styles else None
        most = styles[0].max_shards if styles else None
        match = re.match(r"model\.layers\.(\d+)\.", name)
        unit = int(match.group(1)) if match else -1
        out.append(ParamInfo(name, tuple(p.shape), tp_dim, unit, most))
    return tuple(out)


def _matches(path: str, pattern: str) -> bool:
    atoms, parts = pattern.split("."), path.split(".")
    return len(atoms) == len(parts) and all(map(fnmatch.fnmatch, parts, atoms))


def tp_local_shape(p: ParamInfo, tp: int) -> tuple[int, ...]:
    if p.tp_dim is None or tp == 1 or (p.max_shards and tp > p.max_shards):
        return p.shape
    shape = list(p.shape)
    shape[p.tp_dim] = math.ceil(shape[p.tp_dim] / tp)  # the config makes these divide
    return tuple(shape)


def adapter_params(m: ModelConfig, lcfg: LoraConfig) -> list[ParamInfo]:
    """The LoRA adapters of every targeted layer, split as parallel/lora.py splits them: on a
    column-parallel layer A [rank, in] replicated over tp and B [out, rank] split with the
    layer's output features (and its kv-head limit); on a row-parallel one A split with the
    input features, B replicated. [] without adapters (lora.rank 0)."""
    if not lcfg.rank:
        return []
    names = lcfg.target_names()
    out = []
    for p in model_params(m):
        layer, _, leaf = p.name.rpartition(".")
        if leaf != "weight" or p.unit < 0 or layer.rsplit(".", 1)[-1] not in names:
            continue
        rows, cols = p.shape
        column = p.tp_dim == 0
        a_dim, b_dim = (None, 0) if column else (1, None)
        out.append(ParamInfo(f"{layer}.lora_A.weight", (lcfg.rank, cols), a_dim, p.unit))
        b_most = p.max_shards if column else None
        out.append(ParamInfo(f"{layer}.lora_B.weight", (rows, lcfg.rank), b_dim, p.unit, b_most))
    return out


def fsdp_shard(local: tuple[int, ...], dp_shard: int, shard_rank: int) -> tuple[int, int]:
    """(padded numel, real numel) of one rank's FSDP2 dim-0 shard of a TP-local tensor."""
    rows = local[0]
    chunk = math.ceil(rows / dp_shard)
    rest = math.prod(local[1:])
    mine = max(0, min(chunk, rows - shard_rank * chunk))
    return chunk * rest, mine * rest


def compute_dtype_bytes(cfg: JobConfig, target: str) -> int:
    """Bytes per element of gathered parameters and activations on `target` (cuda or cpu). A
    LoRA base frozen in bf16 computes in bf16 whatever the mixed precision (its embedding's
    output is bf16)."""
    if cfg.lora.rank and cfg.lora.base_dtype == "bf16":
        return 2
    return 2 if resolve_mixed_precision(cfg.parallel.mixed_precision, target) == "bf16" else 4


def adapter_dtype_bytes(cfg: JobConfig, target: str) -> int:
    """Bytes per element of the adapters' compute: fp32, or bf16 under bf16 mixed precision
    (FSDP2 casts every parameter it gathers)."""
    return 2 if resolve_mixed_precision(cfg.parallel.mixed_precision, target) == "bf16" else 4


@dataclass
class Estimate:
    """Bytes per rank. `phases` holds each moment's total by category; the peak is the largest."""

    mesh: str
    rank: int
    target: str
    parameters: int
    gradients: int
    optimizer: int
    activations: int  # the activation category's own peak
    communication: int  # the communication category's own peak
    peak: int
    peak_phase: str
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    micro_batch: int = 0
    micro_batches: int = 1
    seq_len: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def estimate(
    cfg: JobConfig,
    layout: RunLayout,
    rank: int = 0,
    target: str = "cuda",
    documents: bool = False,
) -> Estimate:
    """Per-rank memory of one training step of `cfg` laid out as `layout` (the model, mesh,
    batch split and checkpointing are the layout's; the rest of the settings cfg's).
    `documents`: rows packed with several documents, each attending only to itself (masks on
    every layer, RoPE tables per row: `attention_inputs`)."""
    if target not in ("cuda", "cpu"):
        raise ConfigError(f"target {target!r} is not one of cuda, cpu")
    m, t, p = layout.model, cfg.train, cfg.parallel
    _, shard_rank, _ = layout.coords(rank)
    tp, dps = layout.tp, layout.dp_shard
    c = compute_dtype_bytes(cfg, target)

    # ---- parameters, gradients, optimizer state (exact) -------------------------------------
    # LoRA (lora.rank > 0): the base is frozen in lora.base_dtype (no gradient, no optimizer
    # state); only the fp32 adapters are trained. Full fine-tuning trains every parameter.
    lora = bool(cfg.lora.rank)
    adapters = adapter_params(m, cfg.lora)
    base_bytes = 2 if lora and cfg.lora.base_dtype == "bf16" else 4
    a = adapter_dtype_bytes(cfg, target)  # bytes of the adapters' compute (and gathered copy)
    trained = adapters if lora else model_params(m)
    stored = 0  # bytes of this rank's shards
    padded = real = biggest_local = tp_local_numel = lm_head_gathered = 0
    unit_gathered: dict[int, int] = {}
    unit_grads: dict[int, int] = {}  # a unit's gathered numel that gets a gradient
    adapter_set = set(adapters)
    for info in model_params(m) + adapters:
        local = tp_local_shape(info, tp)
        pad, mine = fsdp_shard(local, dps, shard_rank)
        is_adapter = info in adapter_set
        nbytes = 4 if is_adapter or not lora else base_bytes
        stored += pad * nbytes
        gathered_c = a if is_adapter else c  # a frozen base's gathered copy: its compute dtype
        unit_gathered[info.unit] = unit_gathered.get(info.unit, 0) + pad * dps * gathered_c
        if info.name == "lm_head.weight" or (m.tie_embeddings and "embed_tokens" in info.name):
            lm_head_gathered = pad * dps * gathered_c
        if is_adapter or not lora:
            padded += pad
            real += mine
            biggest_local = max(biggest_local, mine)
            tp_local_numel += math.prod(local)
            unit_grads[info.unit] = unit_grads.get(info.unit, 0) + pad * dps
    # inv_freq (fp32, every rank), and inv_freq_local for the sliding layers' own RoPE base
    buffers = (m.head_dim // 2) * 4 * (2 if m.rope_local_theta else 1)
    parameters = stored + buffers
    gradients = padded * 4
    optimizer = 0
    if t.optimizer == "adamw":
        # exp_avg and exp_avg_sq per parameter; the step counters are 0-d fp32 tensors on the
        # CPU unless the optimizer is fused/capturable, so they count on the CPU only.
        optimizer = 2 * real * 4 + (len(trained) * 4 if target == "cpu" else 0)

    # ---- activations ------------------------------------------------------------------------
    b, n_micro = layout.micro_batch, layout.n_micro
    S, D, hd = t.seq_len, m.dim, m.head_dim
    N = b * S
    Nl = N // tp
    heads, kv, ffn, vocab = m.n_heads // tp, kv_heads_per_rank(m, tp), m.ffn_dim // tp, m.vocab_size
    n_norms = 4 if m.sandwich_norms else 2
    # A norm saves its fp32 input (or fp32 copy), the normed tensor and its rstd; Gemma's
    # (1 + w) norm scales in fp32, so its normed tensor is fp32 and it saves the (1 + w) too.
    nb = 4 + (4 if m.norm_plus_one else c)
    offset = 4 if m.norm_plus_one else 0
    norms = n_norms * (Nl * D * nb + Nl * 4 + D * offset)
    gathered = 2 * N * D * c  # the attention's and the MLP's inputs
    qkv = N * (heads + 2 * kv) * hd * c
    # Per-head q and k norms: the projection's output (fp32) or its fp32 copy, the normed heads
    # and a rstd per head and token.
    qk_norms = N * (heads + kv) * (hd * nb + 4) + 2 * hd * offset if m.qk_norm else 0
    attn_out = N * heads * hd * c + b * heads * S * 4
    mlp = 4 * N * ffn * c
    block = norms + gathered + qkv + qk_norms + attn_out + mlp
    first_block_less = 0  # what the first block keeps less than the others
    if lora:
        block, first_block_less = lora_block_activations(m, cfg.lora, tp, N, c, a, target)
    ckpt = Nl * D * c
    if p.compile:
        # torch.compile's partitioner keeps what backward needs and recomputes the rest: the
        # block input, the norms' rstd, the attention's and the MLP's inputs, q/k/v, the
        # attention output, the o projection's output (tp > 1: its reduce-scatter's), gate, up
        # and their product; no fp32 copies and no silu(gate). Counted with saved-tensor hooks
        # on CPU (tests/test_memory.py); on one H200 it gave the compiled peak to 0.1%.
        block = ckpt + 2 * Nl * 4 + gathered + qkv + attn_out + Nl * D * c + 3 * N * ffn * c
    ac = layout.activation_checkpoint
    if ac == "full":
        kept = ckpt
    elif ac == "selective" and p.compile:
        # The policy's saved outputs that backward reads: the o output (tp = 1) is kept, the
        # down output is not; on tp > 1 the sequence gathers and one reduce-scatter's output
        # (the o and down products are marked not kept, as in eager).
        rows = ckpt if tp == 1 else gathered + Nl * D * c
        kept = ckpt + qkv + attn_out + mlp // 2 + rows
    elif ac == "selective":
        # The block input plus the outputs of matmuls, attention and collectives: q/k/v, the
        # attention output, gate and up, and two [Nl, D] tensors (tp > 1: the two
        # reduce-scatters, whose o and down matmuls are recomputed, see
        # activation_checkpoint.mark_output_not_kept; tp = 1: the o and down outputs). The
        # attention's and the MLP's inputs are kept only where a collective made them (tp > 1: the
        # sequence gathers); on tp = 1 they are the norms' outputs, recomputed.
        kept = ckpt + (gathered if tp > 1 else 0) + qkv + attn_out + mlp // 2 + 2 * Nl * D * c
        if lora:
            kept += lora_matmul_outputs(m, cfg.lora, tp, N, a)
    else:
        kept = block
    recomputes = kept != block
    # CPU: SDPA turns a layer's boolean mask into an additive one of the compute dtype and saves
    # it for backward, one per masked layer (recomputed, not kept, under checkpointing).
    masked = [documents or bool(m.layer_window(i)) for i in range(m.n_layers)]
    mask_saved = (b if documents else 1) * S * S * c if target == "cpu" else 0
    blocks_saved = m.n_layers * kept + (sum(masked) * mask_saved if not recomputes else 0)
    if not recomputes:
        blocks_saved -= first_block_less
    last_block = block + (mask_saved if masked[-1] else 0)
    head = Nl * D * nb + Nl * 4 + D * offset + N * D * c
    if lora:  # a frozen norm weight and lm_head: the final norm keeps its fp32 input only
        head = Nl * D * 4 + Nl * 4 + D * offset
    logits = N * (vocab // tp) * 4
    # tp > 1: a bf16 base's logits, this rank's vocabulary slice, alive beside their fp32 copy
    # while the vocab-parallel loss runs (measured for LoRA on CPU; full fine-tuning's CPU
    # checks are fp32).
    bf16_logits = N * (vocab // tp) * c if lora and c == 2 and tp > 1 else 0
    inputs, forward_masks = attention_inputs(m, b, S, c, target, documents)
    # tp > 1: the vocab-parallel loss's per-token tensors beside the logits' three (row max and
    # its index, sum of exp, target logit, their all-reduced copies, the label masks and
    # offsets): 40 bytes a token, counted on CPU.
    loss_tokens = 40 * N if tp > 1 else 0
    ffn_grad = 2 * N * ffn * c
    # The final norm's output, gathered over the sequence for the lm_head (tp > 1: the gather's
    # output and its re-layout both exist for a moment).
    head_gather = Nl * D * c + (2 * N * D * c if tp > 1 else 0)
    act = {
        "end of forward": blocks_saved
        + Nl * D * nb
        + D * offset
        + Nl * 4
        + head_gather
        + inputs
        + forward_masks,
        "loss": blocks_saved + head + 3 * logits + loss_tokens + inputs + bf16_logits,
        "last block backward": blocks_saved
        + (last_block - kept + ckpt if recomputes else 0)
        + ffn_grad
        + Nl * D * c
        + N * D * c
        + inputs,
        # The embedding's gradient: with tp > 1 the vocab-parallel embedding's backward builds
        # it for the whole vocabulary and keeps this rank's rows as the gathered weight's
        # gradient (counted as communication below); with tp == 1 it is built as activation.
        "end of backward": (vocab * D * c if tp == 1 and not lora else 0) + N * D * c,
        "optimizer": 2 * biggest_local * 4,
    }

    # ---- communication buffers --------------------------------------------------------------
    # A unit's gathered parameters (compute dtype); FSDP2 holds the flat all-gather output of
    # the latest all-gather until the next one. In a block's backward: its gathered parameters,
    # the next unit's (prefetched), their gradients before the reduce-scatter (compute dtype)
    # and the reduce-scatter input (fp32); the lm_head's gradient waits for the root's
    # reduce-scatter at the end of backward.
    root = unit_gathered.get(-1, 0)
    if lora:  # a frozen lm_head gets no gradient
        lm_head_gathered = 0
    blocks_units = [unit_gathered[i] for i in range(m.n_layers)] or [0]
    unit, last = max(blocks_units), blocks_units[-1]
    held = sum(blocks_units[:-1]) if not p.reshard_after_forward else 0
    comm = {
        "end of forward": root + held + 2 * last,
        "loss": root + held + last,
        "last block backward": root + held + lm_head_gathered + 2 * unit,
        "end of backward": root
        + lm_head_gathered
        + unit
        + (vocab * D * c if tp > 1 and not lora else 0),
        "optimizer": 0,
    }
    comm_peak = root + held + lm_head_gathered + 3 * unit + unit * 4 // c
    if lora:  # only the adapters get gradients (compute dtype) and a reduce-scatter (fp32)
        comm_peak = root + held + 2 * unit + max(unit_grads.values(), default=0) * (a + 4)
    defer = p.defer_grad_sync
    if defer and n_micro > 1:
        # Gradients stay unsharded (fp32) from one micro batch to the next.
        unsharded_grads = tp_local_numel * 4
        for name in ("end of forward", "loss", "last block backward"):
            comm[name] += unsharded_grads
        comm_peak += unsharded_grads

    # ---- the moments of a step --------------------------------------------------------------
    # Sharded gradients accumulated by earlier micro batches (none when their sync is deferred).
    grads_before = gradients if n_micro > 1 and not defer else 0
    phases = {
        name: {
            "parameters": parameters,
            "gradients": gradients if name in ("end of backward", "optimizer") else grads_before,
            "optimizer": optimizer,
            "communication": comm[name],
            "activations": act[name],
        }
        for name in act
    }
    totals = {name: sum(v.values()) for name, v in phases.items()}
    peak_phase = max(totals, key=totals.get)
    return Estimate(
        mesh=str(layout),
        rank=rank,
        target=target,
        parameters=parameters,
        gradients=gradients,
        optimizer=optimizer,
        activations=max(act.values()),
        communication=max(comm_peak, *comm.values()),
        peak=totals[peak_phase],
        peak_phase=peak_phase,
        phases=phases,
        micro_batch=b,
        micro_batches=n_micro,
        seq_len=S,
    )


def lora_block_activations(
    m: ModelConfig, lcfg: LoraConfig, tp: int, N: int, c: int, a: int, target: str
) -> tuple[int, int]:
    """(bytes one block keeps for backward, what the first block keeps less) in a LoRA run,
    the RoPE tables and masks left out (`attention_inputs`). Counted with saved-tensor hooks on
    CPU: autograd keeps a tensor only for an op with an input that needs a gradient, and a
    frozen weight needs none, so

    - a norm keeps its fp32 input and rstd (not the normed tensor, which only the frozen
      weight's gradient reads), and only once its input needs a gradient: the first block's
      input norm reads the embedding and keeps nothing, and what comes before the first block's
      first adapter keeps nothing either;
    - a layer's input is kept only for its adapter's A, in the adapter's dtype: one tensor
      shared by the layers reading it when no cast or dropout makes a copy (fp32 adapters on an
      fp32 base), else one copy per targeted layer; dropout adds its mask (CPU: a float mask of
      the input's size, CUDA: one byte an element);
    - each adapter keeps its rank-r intermediate (x A^T, B's input);
    - attention keeps rotated q, k, v and its output, the MLP gate, act(gate) and up, as in full
      fine-tuning, wherever their inputs need a gradient."""
    block = _lora_block(m, lcfg, tp, N, c, a, target, True)
    return block, block - _lora_block(m, lcfg, tp, N, c, a, target, False)


def lora_matmul_outputs(m: ModelConfig, lcfg: LoraConfig, tp: int, N: int, a: int) -> int:
    """Bytes of the adapters' matmul outputs in one block, which selective checkpointing keeps
    (activation_checkpoint.selective_context saves every matmul's output): per targeted layer
    x A^T [N, rank] and its product with B, [N, this rank's output features] on a
    column-parallel layer, [N, dim] (a partial sum) on a row-parallel one."""
    heads, kv, ffn = m.n_heads // tp, kv_heads_per_rank(m, tp), m.ffn_dim // tp
    out = {
        "q_proj": heads * m.head_dim,
        "k_proj": kv * m.head_dim,
        "v_proj": kv * m.head_dim,
        "o_proj": m.dim,
        "gate_proj": ffn,
        "up_proj": ffn,
        "down_proj": m.dim,
    }
    return sum(N * (lcfg.rank + out[name]) * a for name in lcfg.target_names())


def _lora_block(
    m: ModelConfig, lcfg: LoraConfig, tp: int, N: int, c: int, a: int, target: str, grad_in: bool
) -> int:
    """What one LoRA block keeps; grad_in: whether its input needs a gradient (every block's
    but the first's)."""
    T = set(lcfg.target_names())
    Nl, D, hd = N // tp, m.dim, m.head_dim
    heads, kv, ffn = m.n_heads // tp, kv_heads_per_rank(m, tp), m.ffn_dim // tp
    offset = 4 if m.norm_plus_one else 0
    norm = Nl * D * 4 + Nl * 4 + D * offset
    shared = a == c and not lcfg.dropout
    mask = (a if target == "cpu" else 1) if lcfg.dropout else 0

    def inputs(layers: list[str], features: int, kept_elsewhere: bool, grad: bool) -> int:
        """What the adapters of `layers`, which read one [N, features] tensor, keep of it
        (dropout keeps its mask only where that tensor needs a gradient)."""
        layers = [name for name in layers if name in T]
        if not layers:
            return 0
        if shared:
            return 0 if kept_elsewhere else N * features * a
        return len(layers) * N * features * (a + (mask if grad else 0))

    kept = len(T) * N * lcfg.rank * a  # the rank-r intermediates
    # attention
    kept += norm if grad_in else 0
    q_g, k_g, v_g = (grad_in or name in T for name in ("q_proj", "k_proj", "v_proj"))
    kept += inputs(["q_proj", "k_proj", "v_proj"], D, False, grad_in)
    if m.qk_norm:
        kept += N * (heads * q_g + kv * k_g) * (hd * 4 + 4) + hd * offset * (q_g + k_g)
    attn_g = q_g or k_g or v_g
    if attn_g:
        # q, k, v, the output and its logsumexp (fp32)
        kept += N * (heads + 2 * kv) * hd * c + N * heads * hd * c + N * heads * 4
    kept += inputs(["o_proj"], heads * hd, attn_g, attn_g)
    o_g = attn_g or "o_proj" in T
    kept += norm if m.sandwich_norms and o_g else 0  # the attention output's norm
    # MLP
    h_g = grad_in or o_g
    kept += norm if h_g else 0
    gate_g, up_g = h_g or "gate_proj" in T, h_g or "up_proj" in T
    kept += inputs(["gate_proj", "up_proj"], D, False, h_g)
    # silu keeps gate, the product keeps act(gate) for up's gradient and up for gate's
    kept += N * ffn * c * (2 * gate_g + up_g)
    kept += inputs(["down_proj"], ffn, False, gate_g or up_g)
    down_g = gate_g or up_g or "down_proj" in T
    kept += norm if m.sandwich_norms and down_g else 0  # the MLP output's norm
    return kept


def attention_inputs(
    m: ModelConfig, b: int, S: int, c: int, target: str, documents: bool = False
) -> tuple[int, int]:
    """(bytes held from the first forward to the last backward, bytes held during the forward
    only) of what every block reads: token ids and labels (int64), and per kind of layer
    (`Llama.layer_inputs`: its window and RoPE base) the RoPE tables cos and sin [s, head_dim]
    and its mask (models/attention.py: none for plain causal layers; on CPU a dense bool
    [1, 1, s, s], which only the forward holds; on CUDA a FlexAttention block mask, int32 block
    counts and indices over 128-token blocks, for the rows and for the columns).

    `documents`: packed rows (several documents a row, issue 35): the document index of each
    position (int64) is an input too, every kind of layer has a mask, one per row ([b, 1, s, s]
    on CPU, b block masks on CUDA), and RoPE tables per row ([b, 1, s, head_dim]: positions
    restart at each document)."""
    kinds = {(w := m.layer_window(i), bool(w and m.rope_local_theta)) for i in range(m.n_layers)}
    blocks = -(-S // 128)
    rows = b if documents else 1
    total = (3 if documents else 2) * b * S * 8
    forward = 0
    for window, _ in kinds:
        total += 2 * rows * S * m.head_dim * c
        if (window or documents) and target == "cpu":
            forward += rows * S * S
        elif window or documents:
            total += rows * 2 * 2 * blocks * (blocks + 1) * 4
    return total, forward


def estimates_per_rank(
    cfg: JobConfig, layout: RunLayout, target: str = "cuda", documents: bool = False
) -> list[dict]:
    """Every rank's `estimate(...).to_dict()`; ranks differ only by their dp_shard index (uneven
    FSDP shards), so one estimate per index serves them all."""
    by_shard: dict[int, Estimate] = {}
    out = []
    for r in range(layout.world):
        shard = layout.coords(r)[1]
        if shard not in by_shard:
            by_shard[shard] = estimate(cfg, layout, r, target, documents)
        out.append(by_shard[shard].to_dict() | {"rank": r})
    return out
