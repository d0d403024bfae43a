"""The training loss: mean token cross entropy, on full logits or on vocabulary shards.

With tensor parallelism the output projection returns logits sharded on the vocabulary (a
DTensor, see tensor_parallel.VocabParallelHead); the loss is then computed without ever
gathering them: three all-reduces over [tokens] (max, sum of exp, target logit), and a local
backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from hybrid2d.parallel.sequence_comm import all_reduce


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token loss of [b, s, vocab] logits (plain, or a DTensor sharded on the vocabulary)
    against [b, s] labels; a plain scalar, the same on every tp rank."""
    if isinstance(logits, DTensor):
        placement = logits.placements[-1]
        if not (placement.is_shard() and placement.dim in (-1, logits.ndim - 1)):
            raise ValueError(f"logits placed {logits.placements}: expected sharding on the vocab")
        mesh = logits.device_mesh
        return _VocabParallelCrossEntropy.apply(
            logits.to_local(), labels, mesh.get_group(mesh.ndim - 1)
        )
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of logits split on the vocabulary, without gathering them: three
    all-reduces over [tokens] (max, sum of exp, target logit). Backward is local:
    softmax - one_hot on this rank's vocabulary slice."""

    @staticmethod
    def forward(ctx, logits, labels, group):
        logits = logits.float()
        vocab_local = logits.shape[-1]
        start = dist.get_group_rank(group, dist.get_rank()) * vocab_local
        row_max = all_reduce(logits.max(dim=-1).values, "max", group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = all_reduce(exp.sum(dim=-1), "sum", group)
        local = labels - start
        owned = (local >= 0) & (local < vocab_local)
        safe = local.masked_fill(~owned, 0)
        target = shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        target = all_reduce(target, "sum", group)
        loss = (sum_exp.log() - target).mean()
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, safe, owned)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, safe, owned = ctx.saved_tensors
        g = softmax
        g.scatter_add_(-1, safe.unsqueeze(-1), -owned.unsqueeze(-1).to(g.dtype))
        g.mul_(grad / safe.numel())
        return g, None, None
