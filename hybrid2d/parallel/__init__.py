"""Parallelisation of a meta-device `Llama`, applied in a fixed order.

1. tensor parallelism over tp (DTensor), 2. activation checkpointing, 3. torch.compile per block,
4. FSDP2 over dp (which must see the TP DTensors to shard them a second time).
"""

from __future__ import annotations

from torch import nn

from hybrid2d.config import ParallelConfig
from hybrid2d.mesh import Mesh
from hybrid2d.parallel.activation_checkpoint import apply_ac
from hybrid2d.parallel.fsdp import apply_fsdp, mixed_precision_policy
from hybrid2d.parallel.tensor_parallel import apply_tp


def parallelize(model: nn.Module, mesh: Mesh, pcfg: ParallelConfig) -> nn.Module:
    apply_tp(model, mesh.tp_mesh, pcfg.local_norms, pcfg.direct_sp_comm)
    for block in model.model.layers:
        # Direct SP communication works on local shards, which is what the fused path uses.
        fused = pcfg.fused_projections or pcfg.direct_sp_comm
        block.self_attn.fused = block.mlp.fused = fused
    apply_ac(model, pcfg.activation_checkpoint)
    if pcfg.compile:
        for block in model.model.layers:
            block.compile()
    apply_fsdp(
        model,
        mesh.fsdp_mesh,
        mixed_precision_policy(pcfg.mixed_precision, mesh.device.type),
        pcfg.reshard_after_forward,
        pcfg.fsdp_prefetch,
    )
    return model


__all__ = ["parallelize", "apply_tp", "apply_fsdp", "apply_ac", "mixed_precision_policy"]
