"""Collectives of one training step, predicted: how many each rank issues and their payload
bytes, for sequence-parallel TP + FSDP2. The planner prices these; `comm_report.py` counts the
same kinds in a real step and compares (tests/test_comm_report.py checks both against a formula
written from the model's shape).

Payload bytes of a collective are the size of its full (unsharded) buffer: the output of an
all-gather, the input of a reduce-scatter, the tensor of an all-reduce. A ring moves (n-1)/n of
that per rank.
"""

from __future__ import annotations

import dataclasses
import functools

from hybrid2d.config import LoraConfig, ModelConfig
from hybrid2d.planner.memory import adapter_params, fsdp_shard, model_params, tp_local_shape

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# The int64 counts of a global batch the trainer sums over dp in one all-reduce: loss tokens,
# real tokens, attended (query, key) pairs.
SCALAR_COUNTS = 3


def unit_bytes(m: ModelConfig, dp_shard: int, tp: int, elt: int) -> tuple[int, int]:
    """(one block's, the root's) gathered FSDP payload in bytes: each unit's TP-local
    parameters, padded on dim 0 to a multiple of dp_shard as FSDP2 pads them (the memory
    estimate counts the same shards). (0, 0) when FSDP does not shard (dp_shard 1)."""
    if dp_shard <= 1:
        return 0, 0
    block, root = _unit_numel(tuple(sorted(dataclasses.asdict(m).items())), dp_shard, tp)
    return block * elt, root * elt


@functools.lru_cache(maxsize=256)
def _unit_numel(key: tuple, dp_shard: int, tp: int) -> tuple[int, int]:
    """(block 0's, the root's) gathered elements of the model `key` names (cached: the search
    prices every candidate with them)."""
    gathered = {0: 0, -1: 0}
    for p in model_params(ModelConfig(**dict(key))):
        if p.unit in gathered:
            padded, _ = fsdp_shard(tp_local_shape(p, tp), dp_shard, 0)
            gathered[p.unit] += padded * dp_shard
    return gathered[0], gathered[-1]


def tp_replicated_grads(m: ModelConfig, tp: int) -> tuple[int, int]:
    """(count, elements) of the gradient all-reduces over tp of one backward: one per weight
    the TP plan replicates over tp while each rank uses it on its share of the work. Those are
    the sequence-parallel norms (2 per block, 4 with sandwich norms, and the final norm), the
    per-head q/k norms, and past the kv heads (tp > n_kv_heads) the k and v weights and
    biases, whole on every rank, each rank computing one kv head."""
    norms = 4 if m.sandwich_norms else 2
    count, numel = norms, norms * m.dim
    if m.qk_norm:
        count, numel = count + 2, numel + 2 * m.head_dim
    if tp > m.n_kv_heads:
        kv_rows = m.n_kv_heads * m.head_dim
        count, numel = count + 2, numel + 2 * kv_rows * m.dim
        if m.qkv_bias:
            count, numel = count + 2, numel + 2 * kv_rows
    return count * m.n_layers + 1, numel * m.n_layers + m.dim


def lora_terms(m: ModelConfig, lcfg: LoraConfig, dp_shard: int, tp: int) -> dict:
    """What LoRA (lora.rank > 0) changes in a step's collectives, rank 0's view: the adapters'
    gathered elements per block (FSDP all-gathers them with the base) and the elements of the
    adapters replicated over tp (their dp shards, summed over tp in one all-reduce,
    parallel/lora.sum_replicated_grads); the sequence collectives backward skips because the
    first block's input (the frozen embedding's output) needs no gradient."""
    per_block = replicated = 0
    for p in adapter_params(m, lcfg):
        if p.unit != 0:
            continue
        local = tp_local_shape(p, tp)
        padded, mine = fsdp_shard(local, dp_shard, 0)
        per_block += padded * dp_shard
        past_kv_heads = p.max_shards is not None and tp > p.max_shards  # k/v's B: replicated
        if p.tp_dim is None or past_kv_heads:
            replicated += mine
    # Backward stops at the first block's input: the embedding's gather (the backward of its
    # reduce-scatter) and the first attention input's reduce-scatter (the backward of its
    # gather) do not run; without an adapter in the first attention, neither do the backward
    # of its o projection's reduce-scatter nor that of the MLP input's gather.
    skipped = 1 if set(lcfg.target_names()) & set(ATTENTION_TARGETS) else 2
    return {
        "adapters_per_block": per_block,
        "replicated": replicated * m.n_layers,
        "skipped": skipped,
    }


def analytic_step(
    m: ModelConfig,
    dp: int,
    tp: int,
    local_batch: int,
    seq_len: int,
    micro_batches: int = 1,
    reshard_after_forward: bool = True,
    elt: int = 4,
    lora: LoraConfig | None = None,
) -> dict:
    """Collectives per rank per optimizer step: {kind: (count, payload bytes)}.

    Minimum for Megatron-SP TP + FSDP, plus the small extras our loop needs (listed apart):
    - tp_all_gather / tp_reduce_scatter: activations [b, s, d] at every SP <-> TP boundary:
      per block 2 gathers + 2 reduce-scatters forward and the mirror image backward; the
      vocab-parallel embedding (reduce-scatter fwd, gather bwd) and the output projection
      (gather fwd, reduce-scatter bwd).
    - fsdp_all_gather: each unit's parameters forward, again in backward for resharded units
      (the last block and the root stay gathered); fsdp_reduce_scatter: each unit's gradients.
    - extras: tp_all_reduce = 3 for loss parallel (max, sum of exp, target logit over [b*s])
      and one per weight replicated over tp, whose gradient is a partial sum over tp
      (`tp_replicated_grads`); scalar_all_reduce = the squared global grad norm (fp64) over
      the world and, with dp > 1, over dp the global batch's token counts (`SCALAR_COUNTS`
      int64: loss tokens, real tokens, attended pairs; one all-reduce) and the logged loss
      (fp32).
    - LoRA (`lora.rank` > 0, `lora_terms`): the frozen norms need no all-reduce; the adapters
      replicated over tp need one per step (fp32, their dp shards); FSDP gathers the adapters
      with the base (in `elt`) and reduce-scatters the adapters' gradients only (fp32, the
      root has none); backward skips one or two sequence collectives of each kind.
    """
    per_micro: dict[str, tuple[int, int]] = {}
    per_step: dict[str, tuple[int, int]] = {}
    b = local_batch // micro_batches
    lo = lora_terms(m, lora, dp, tp) if lora is not None and lora.rank else None
    if tp > 1:
        n = 4 * m.n_layers + 2
        per_micro["tp_all_gather"] = (n, n * b * seq_len * m.dim * elt)
        per_micro["tp_reduce_scatter"] = per_micro["tp_all_gather"]
        count, numel = tp_replicated_grads(m, tp)
        per_micro["tp_all_reduce"] = (3 + count, (3 * b * seq_len + numel) * elt)
        if lo:
            n -= lo["skipped"]
            per_micro["tp_all_gather"] = (n, n * b * seq_len * m.dim * elt)
            per_micro["tp_reduce_scatter"] = per_micro["tp_all_gather"]
            per_micro["tp_all_reduce"] = (3, 3 * b * seq_len * elt)
            per_step["tp_all_reduce"] = (1, lo["replicated"] * 4) if lo["replicated"] else (0, 0)
    if dp > 1:
        block, root = unit_bytes(m, dp, tp, elt)
        regather = (m.n_layers - 1) if reshard_after_forward else 0
        gathers = m.n_layers + regather
        if lo:
            block += lo["adapters_per_block"] * elt
        per_micro["fsdp_all_gather"] = (gathers + 1, gathers * block + root)
        per_micro["fsdp_reduce_scatter"] = (m.n_layers + 1, m.n_layers * block + root)
        if lo:
            adapters = lo["adapters_per_block"] * 4
            per_micro["fsdp_reduce_scatter"] = (m.n_layers, m.n_layers * adapters)
    out = {k: (c * micro_batches, size * micro_batches) for k, (c, size) in per_micro.items()}
    for k, (c, size) in per_step.items():
        before = out.get(k, (0, 0))
        out[k] = (before[0] + c, before[1] + size)
    if dp * tp > 1:
        grad_norm = 8
        counts_and_loss = 8 * SCALAR_COUNTS + 4
        out["scalar_all_reduce"] = (3, grad_norm + counts_and_loss) if dp > 1 else (1, grad_norm)
    return {k: v for k, v in out.items() if v[0]}
