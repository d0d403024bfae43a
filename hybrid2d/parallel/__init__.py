"""Parallelisation of a meta-device `Llama`, applied from outside in a fixed order.

1. tensor parallelism over tp (`tensor_parallel.tp_plan`: every tp collective), then
LoRA adapters following each layer's style (`lora.apply_lora`, no collective of their own),
2. activation checkpointing per block, 3. torch.compile per block (full checkpointing goes
around the compiled block instead, see below), 4. FSDP2 over dp (which must see the TP DTensors
to shard them a second time).
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid2d.config import LoraConfig, ParallelConfig
from hybrid2d.mesh import Mesh
from hybrid2d.parallel.activation_checkpoint import apply_ac
from hybrid2d.parallel.fsdp import apply_fsdp, mixed_precision_policy
from hybrid2d.parallel.lora import apply_lora
from hybrid2d.parallel.tensor_parallel import apply_tp


def parallelize(
    model: nn.Module, mesh: Mesh, pcfg: ParallelConfig, lora: LoraConfig | None = None
) -> nn.Module:
    """TP (and LoRA adapters when lora.rank > 0), activation checkpointing (the layout's
    choice), compile and FSDP, in this order."""
    apply_tp(model, mesh.tp_mesh)
    if lora is not None:
        apply_lora(model, lora, mesh.tp_mesh)
    ac = mesh.layout.activation_checkpoint
    if pcfg.compile and ac == "full":
        # Full checkpointing goes around the compiled block: compiled with the checkpoint
        # inside, tp > 1 fails in AOTAutograd (torch 2.13: "expected all
        # tensors_saved_with_vc_check to be Tensors", a DeviceMesh among them). Recomputation
        # runs the compiled forward again, so nothing is lost.
        for block in model.model.layers:
            block.forward = torch.compile(block.forward)
        apply_ac(model, "full")
    else:
        apply_ac(model, ac)
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


__all__ = [
    "parallelize",
    "apply_tp",
    "apply_lora",
    "apply_fsdp",
    "apply_ac",
    "mixed_precision_policy",
]
