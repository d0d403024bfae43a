"""Optimizer, learning-rate schedule and gradient-norm clipping over the whole mesh."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hybrid2d.config import TrainConfig


def build_optimizer(model: nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (weight decay on matrices only, not on norms) or plain SGD, over the trainable
    parameters only: a frozen base (LoRA) has no optimizer state."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if t.optimizer == "sgd":
        return torch.optim.SGD(trainable, lr=t.lr)
    matrices = [p for p in trainable if p.ndim >= 2]
    rest = [p for p in trainable if p.ndim < 2]
    groups = [
        {"params": params, "weight_decay": decay}
        for params, decay in zip((matrices, rest), _weight_decays(t), strict=True)
    ]
    # fused: the whole update is one _fused_adamw_ call per parameter group, on CPU and CUDA
    # (2x2: 3 ms per rank per step against 5.5-9 ms for foreach over DTensors; torch's default
    # falls back to a per-tensor loop for DTensor parameters).
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=True)


def _weight_decays(t: TrainConfig) -> tuple[float, float]:
    """AdamW's groups' weight decay: matrices, then norms (never decayed)."""
    return t.weight_decay, 0.0


def lr_multiplier(step: int, t: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine decay to min_lr_ratio at the last step.

    `step` counts optimizer steps already taken (0 for the first update).
    """
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, t: TrainConfig):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_multiplier(step, t))


def follow_settings(opt: torch.optim.Optimizer, scheduler, t: TrainConfig) -> None:
    """After a resume loaded a checkpoint's optimizer and scheduler state: its param groups hold
    the saved run's lr, betas and weight decay, and the scheduler its base lr. A resumed run
    follows this launch's settings (train.lr and the schedule may change on resume), so they
    are set again, the lr to this schedule's value for the next update."""
    step = scheduler.last_epoch  # optimizer steps taken
    scheduler.base_lrs = [t.lr] * len(opt.param_groups)
    decay = _weight_decays(t)  # build_optimizer's groups
    for i, group in enumerate(opt.param_groups):
        group["initial_lr"] = t.lr
        group["lr"] = t.lr * lr_multiplier(step, t)
        if t.optimizer != "sgd":
            group["betas"] = (t.beta1, t.beta2)
            group["weight_decay"] = decay[i]


def _replication_weight(p: torch.Tensor, world_size: int) -> float:
    """1 / (number of ranks in the world holding the same piece of p)."""
    if not isinstance(p, DTensor):
        return 1.0 / world_size
    sharded_ways = 1
    for size, placement in zip(p.device_mesh.shape, p.placements, strict=True):
        # FSDP over a TP-sharded dim uses _StridedShard, which is not a Shard subclass.
        if not (placement.is_replicate() or placement.is_partial()):
            sharded_ways *= size
    return sharded_ways / world_size


@torch.no_grad()
def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients across every rank, and clip them to max_norm.

    One all-reduce over the world: each rank adds up the squared norms of its local shards
    (torch._foreach_norm, one call per group of shards of equal replication, device and dtype),
    weighted so that a shard replicated on k ranks counts once. Same rule as
    torch.nn.utils.clip_grad_norm_ (coefficient max_norm / (norm + 1e-6), capped at 1), applied
    with one _foreach_mul_ per group. max_norm <= 0 only measures.

    Measured against torch.nn.utils.get_total_norm + clip_grads_with_norm_ on the DTensor
    gradients of a 2x2 TP x FSDP2 mesh (tests/workers/grad_norm.py): same norm, but torch's
    helpers issue one all-reduce per sharded mesh dim (2 on 2x2) and took 2x as long per call.
    """
    grads = [p.grad for p in params if p.grad is not None]
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = grads[0].device if grads else torch.device("cpu")
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        key = (_replication_weight(g, world), local.device, local.dtype)
        groups.setdefault(key, []).append(local)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (weight, _, _), local in groups.items():
        squares = torch.stack(torch._foreach_norm(local, 2.0)).double().pow(2).sum()
        total += squares.to(device) * weight
    if world > 1:
        dist.all_reduce(total)
    norm = total.sqrt().float()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for (_, dev, dtype), local in groups.items():
            torch._foreach_mul_(local, coef.to(dev, dtype))
    return norm
