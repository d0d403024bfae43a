"""FSDP2 over the data-parallel axis: one unit per transformer block plus the root.

Runs after tensor parallelism, so it shards the TP DTensors a second time (2-D). With
dp_replicate > 1 the mesh is 2-D and FSDP2 does HSDP: shard inside, replicate across.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hybrid2d.config import resolve_mixed_precision


def mixed_precision_policy(setting: str, device_type: str) -> MixedPrecisionPolicy:
    """bf16: bf16 parameters for compute with fp32 gradient reduction; fp32: FSDP's default.
    What "auto" means is decided in config.resolve_mixed_precision."""
    if resolve_mixed_precision(setting, device_type) == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(
    model: nn.Module,
    fsdp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool = True,
    prefetch: int = 0,
) -> None:
    layers = list(model.model.layers)
    for i, block in enumerate(layers):
        # The last block is needed again right away by backward: keep it gathered.
        fully_shard(
            block,
            mesh=fsdp_mesh,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward and i < len(layers) - 1,
        )
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    set_prefetch(layers, prefetch)


def set_prefetch(layers: list[nn.Module], ahead: int) -> None:
    """Explicit prefetching (parallel.fsdp_prefetch): each block's pre-forward also starts the
    all-gathers of the next `ahead` blocks, and its pre-backward those of the `ahead` blocks
    backward reaches next, so communication can overlap compute where the backend runs
    collectives asynchronously (nccl; gloo's worker threads). 0 keeps FSDP2's implicit one-ahead
    forward prefetch."""
    if ahead <= 0:
        return
    for i, block in enumerate(layers):
        block.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + ahead])
        block.set_modules_to_backward_prefetch(layers[max(0, i - ahead) : i][::-1])
