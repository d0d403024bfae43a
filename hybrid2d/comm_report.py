"""Collectives of one training step: counted with torch's CommDebugMode, sized, and compared
with the analytic minimum of sequence-parallel TP + FSDP.

Payload bytes of a collective are the size of its full (unsharded) buffer: the output of an
all-gather, the input of a reduce-scatter, the tensor of an all-reduce. A ring moves (n-1)/n of
that per rank.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor.debug import CommDebugMode

from hybrid2d import shm_backend
from hybrid2d.config import ModelConfig

# op name (as CommDebugMode reports it) -> (kind, which args hold the full buffer)
_KIND = {
    "c10d_functional.all_gather_into_tensor": "tp_all_gather",
    "c10d_functional.reduce_scatter_tensor": "tp_reduce_scatter",
    "c10d_functional.all_reduce": "tp_all_reduce",
    "c10d._allgather_base_": "fsdp_all_gather",
    "c10d.allgather_into_tensor_coalesced_": "fsdp_all_gather",
    "c10d._reduce_scatter_base_": "fsdp_reduce_scatter",
    "c10d.reduce_scatter_tensor_coalesced_": "fsdp_reduce_scatter",
    "c10d.allreduce_": "scalar_all_reduce",
}
# The shared-memory backend's calls, which dispatch modes see under these names (shm_backend.py).
_KIND.update({str(op): _KIND[c10d_name] for op, c10d_name in shm_backend.DISPATCH_OPS.items()})
_SAME_ARGS = {str(op): name for op, name in shm_backend.DISPATCH_OPS.items()}


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _payload(name: str, args) -> int:
    name = _SAME_ARGS.get(name, name)  # the backend's ops take c10d's arguments
    if name == "c10d_functional.all_gather_into_tensor":
        return _nbytes(args[0]) * int(args[1])  # (input shard, group_size, group)
    if name in ("c10d._allgather_base_", "c10d.allgather_into_tensor_coalesced_"):
        return _nbytes(args[0])  # (output, input, ...)
    if name in ("c10d._reduce_scatter_base_", "c10d.reduce_scatter_tensor_coalesced_"):
        return _nbytes(args[1])
    return _nbytes(args[0])


class CollectiveCounter(CommDebugMode):
    """CommDebugMode that also adds up each collective's payload bytes by kind."""

    def __init__(self):
        super().__init__()
        self.comm_registry.update(shm_backend.DISPATCH_OPS)
        self.counts: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def __enter__(self):
        super().__enter__()
        # Count globally: CommDebugMode's per-module attribution fails when a step runs several
        # forwards (micro batches), so its module hooks are removed right away.
        self.advanced_module_tracker.__exit__()
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).lstrip("_")
        if name in _KIND:
            kind = _KIND[name]
            self.counts[kind] += 1
            self.bytes[kind] += _payload(name, args)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def summary(self) -> dict:
        return {
            "by_op": {str(k): v for k, v in self.get_comm_counts().items()},
            "counts": dict(self.counts),
            "bytes": dict(self.bytes),
        }


def _pad(rows: int, ways: int) -> int:
    """FSDP2 pads dim 0 of each parameter to a multiple of the shard count."""
    return -(-rows // ways) * ways


def analytic_step(
    m: ModelConfig,
    dp: int,
    tp: int,
    local_batch: int,
    seq_len: int,
    micro_batches: int = 1,
    reshard_after_forward: bool = True,
    elt: int = 4,
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
      and one per sequence-parallel norm weight (its gradient is a partial sum over tp);
      scalar_all_reduce = the global grad norm and the logged loss.
    """
    per_micro: dict[str, tuple[int, int]] = {}
    b = local_batch // micro_batches
    if tp > 1:
        n = 4 * m.n_layers + 2
        per_micro["tp_all_gather"] = (n, n * b * seq_len * m.dim * elt)
        per_micro["tp_reduce_scatter"] = per_micro["tp_all_gather"]
        norms = 2 * m.n_layers + 1
        per_micro["tp_all_reduce"] = (3 + norms, (3 * b * seq_len + norms * m.dim) * elt)
    if dp > 1:
        q, kv, ffn = m.n_heads * m.head_dim // tp, m.n_kv_heads * m.head_dim // tp, m.ffn_dim // tp
        rows = [(q, m.dim), (kv, m.dim), (kv, m.dim), (m.dim, q)]
        rows += [(ffn, m.dim), (ffn, m.dim), (m.dim, ffn), (m.dim, 1), (m.dim, 1)]
        block = sum(_pad(r, dp) * c for r, c in rows) * elt
        emb = _pad(m.vocab_size // tp, dp) * m.dim
        root = (emb + (0 if m.tie_embeddings else emb) + _pad(m.dim, dp)) * elt
        regather = (m.n_layers - 1) if reshard_after_forward else 0
        gathers = m.n_layers + regather
        per_micro["fsdp_all_gather"] = (gathers + 1, gathers * block + root)
        per_micro["fsdp_reduce_scatter"] = (m.n_layers + 1, m.n_layers * block + root)
    out = {k: (c * micro_batches, size * micro_batches) for k, (c, size) in per_micro.items()}
    if dp * tp > 1:
        out["scalar_all_reduce"] = (2, 12) if dp > 1 else (1, 8)
    return {k: v for k, v in out.items() if v[0]}


MINIMUM_KINDS = ("tp_all_gather", "tp_reduce_scatter", "fsdp_all_gather", "fsdp_reduce_scatter")


def format_comm(measured: dict, analytic: dict | None = None) -> str:
    analytic = analytic or {}
    lines = [
        "| collective | count | payload MiB | analytic count | analytic MiB |",
        "|---|---|---|---|---|",
    ]
    for k in sorted(set(measured["counts"]) | set(analytic)):
        c, b = measured["counts"].get(k, 0), measured["bytes"].get(k, 0)
        ac, ab = analytic.get(k, (0, 0))
        lines.append(f"| {k} | {c} | {b / 2**20:.3f} | {ac} | {ab / 2**20:.3f} |")
    if analytic:
        total = sum(measured["bytes"].values())
        minimum = sum(analytic.get(k, (0, 0))[1] for k in MINIMUM_KINDS)
        lines.append(
            f"\ntotal payload {total / 2**20:.3f} MiB = {total / minimum:.4f} x the "
            f"analytic minimum ({minimum / 2**20:.3f} MiB: activations + FSDP)"
        )
    return "\n".join(lines)
