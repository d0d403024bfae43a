"""The training loss: token cross entropy, on full logits or on vocabulary shards.

With tensor parallelism the output projection returns logits sharded on the vocabulary (a
DTensor, see tensor_parallel.VocabParallelHead); the loss is then computed without ever
gathering them: three all-reduces over [tokens] (max, sum of exp, target logit), and a local
backward.

Labels equal to IGNORE_INDEX (-100, as in PyTorch and HF) are not loss tokens: instruction data
marks prompts and padding with it. The loss is the sum over loss tokens divided by `divide_by`
(by default this batch's number of loss tokens, i.e. the mean); the trainer passes the number of
loss tokens of the whole global batch, so every loss token weighs the same whatever the dp size
and micro batching.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from hybrid2d.parallel.sequence_comm import all_reduce

IGNORE_INDEX = -100


def loss_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of loss tokens (labels other than IGNORE_INDEX), an int64 scalar."""
    return (labels != IGNORE_INDEX).sum()


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, divide_by: float | None = None
) -> torch.Tensor:
    """Token loss of [b, s, vocab] logits (plain, or a DTensor sharded on the vocabulary)
    against [b, s] labels, summed over loss tokens and divided by `divide_by` (None: their
    number here, the mean); a plain scalar, the same on every tp rank."""
    if divide_by is None:
        divide_by = max(int(loss_tokens(labels)), 1)
    if isinstance(logits, DTensor):
        placement = logits.placements[-1]
        if not (placement.is_shard() and placement.dim in (-1, logits.ndim - 1)):
            raise ValueError(f"logits placed {logits.placements}: expected sharding on the vocab")
        mesh = logits.device_mesh
        return _VocabParallelCrossEntropy.apply(
            logits.to_local(), labels, mesh.get_group(mesh.ndim - 1), float(divide_by)
        )
    total = F.cross_entropy(
        logits.flatten(0, 1).float(),
        labels.flatten(0, 1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return total / divide_by


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy of logits split on the vocabulary, summed over loss tokens and divided by
    `divide_by`, without gathering them: three all-reduces over [tokens] (max, sum of exp,
    target logit). Backward is local: softmax - one_hot on this rank's vocabulary slice, zero
    on ignored tokens."""

    @staticmethod
    def forward(ctx, logits, labels, group, divide_by):
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
        valid = labels != IGNORE_INDEX
        loss = (sum_exp.log() - target).masked_fill(~valid, 0.0).sum() / divide_by
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, safe, owned, valid)
        ctx.divide_by = divide_by
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, safe, owned, valid = ctx.saved_tensors
        g = softmax
        g.scatter_add_(-1, safe.unsqueeze(-1), -owned.unsqueeze(-1).to(g.dtype))
        g.mul_(valid.unsqueeze(-1).to(g.dtype) * (grad / ctx.divide_by))
        return g, None, None, None
