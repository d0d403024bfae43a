"""Sequence-parallel collectives on plain tensors, with their autograd mirror images.

The tensor-parallel styles (tensor_parallel.py) call these: gather the sequence before attention
/ MLP (backward reduce-scatters the gradient), reduce-scatter the row-parallel output back to
sequence shards (backward all-gathers), and the vocab-parallel embedding. On plain tensors they
cost one collective each, without DTensor's dispatch. Functional collectives are used so that
CommDebugMode sees them as TP traffic; which transport carries them is the process group's
business (mesh.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

# torch 2.13 names these collectives *_single and warns on every call of the older *_tensor
# names; torch 2.11 (the CUDA image the GPU check runs on) has only the older names. Same ops.
_all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter_single = (
    getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
)


def all_gather_dim0(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The group's tensors stacked along dim 0 (not differentiable)."""
    return _all_gather_single(x.contiguous(), 0, group).wait()


def _gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    out = all_gather_dim0(x, group)  # [n*b, s/n, ...]
    return out.unflatten(0, (n, x.shape[0])).movedim(0, 1).flatten(1, 2)  # [b, s, ...]


def _reduce_scatter(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    chunks = y.unflatten(1, (n, y.shape[1] // n)).movedim(1, 0).flatten(0, 1)  # [n*b, s/n, ...]
    return _reduce_scatter_single(chunks.contiguous(), "sum", 0, group).wait()


def all_reduce(x: torch.Tensor, op: str, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum or max over the group (not differentiable)."""
    return funcol.all_reduce(x, op, group).wait()


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _reduce_scatter(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, s/tp, ...] sequence shard -> [b, s, ...] on every tp rank."""
    return _GatherSequence.apply(x, group)


def reduce_scatter_sequence(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, s, ...] partial sums -> this rank's [b, s/tp, ...] slice of their total."""
    return _ReduceScatterSequence.apply(y, group)


def vocab_parallel_embedding(
    tokens: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """Embedding with the vocabulary split over tp (weight: this rank's rows), returned as this
    rank's sequence shard: each rank looks up the tokens it owns, the reduce-scatter sums the
    rank contributions and splits the sequence in one collective."""
    rows = weight.shape[0]
    start = dist.get_group_rank(group, dist.get_rank()) * rows
    local = tokens - start
    outside = (local < 0) | (local >= rows)
    emb = F.embedding(local.masked_fill(outside, 0), weight)
    emb = emb.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_scatter_sequence(emb, group)
