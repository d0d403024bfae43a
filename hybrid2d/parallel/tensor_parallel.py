"""Megatron-style tensor parallelism with sequence parallelism, as data: module path -> style.

Between blocks the residual stream is sharded on the sequence dimension (Shard(1)); norms run on
their sequence slice. Attention and MLP gather the sequence (PrepareModuleInput), q/k/v and
gate/up are column-parallel (each rank owns whole heads / a slice of the ffn), o and down are
row-parallel and reduce-scatter back to sequence shards. The embedding is vocab-parallel and the
output projection leaves logits sharded on the vocabulary for loss parallelism, so no rank ever
holds full logits.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class LocalSequenceParallel(ParallelStyle):
    """Sequence parallelism without DTensor compute: the weights become Replicate DTensors (so
    FSDP and checkpoints see them as such) and the norm runs on the plain local sequence slice;
    RMSNorm marks its weight gradient as a partial sum over tp. Saves the DTensor dispatch of
    every elementwise op of every norm, forward and backward."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(name, nn.Parameter(replicated, param.requires_grad))
        return module


def _norm_style(local_norms: bool) -> ParallelStyle:
    return LocalSequenceParallel() if local_norms else SequenceParallel()


def llama_root_plan(local_norms: bool = False) -> dict[str, ParallelStyle]:
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": _norm_style(local_norms),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }


def llama_block_plan(local_norms: bool = False, direct_sp_comm: bool = False):
    """direct_sp_comm: the block gathers / reduce-scatters the sequence itself, so attention
    and MLP get no PrepareModuleInput and o/down are only sharded (their forward is not called;
    the block multiplies by the local weight shard)."""
    if direct_sp_comm:
        return {
            "input_layernorm": LocalSequenceParallel(),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "post_attention_layernorm": LocalSequenceParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
    return {
        "input_layernorm": _norm_style(local_norms),
        # (hidden, cos, sin): gather the sequence of the hidden states; RoPE tables are local.
        "self_attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": _norm_style(local_norms),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, local_norms: bool = False, direct_sp_comm: bool = False
) -> None:
    """Shard a `Llama` over the 1-D tp mesh in place (no-op for tp == 1)."""
    if tp_mesh.size() == 1:
        return
    parallelize_module(model, tp_mesh, llama_root_plan(local_norms or direct_sp_comm))
    for block in model.model.layers:
        parallelize_module(block, tp_mesh, llama_block_plan(local_norms, direct_sp_comm))
        if direct_sp_comm:
            block.self_attn.sp_group = block.mlp.sp_group = tp_mesh.get_group()
    if direct_sp_comm:
        model.sp_group, model.sp_mesh = tp_mesh.get_group(), tp_mesh
    # Tied embeddings: both styles shard the [vocab, dim] weight on dim 0, so one DTensor
    # parameter serves both after re-tying.
    model.tie_weights()
