"""Megatron-style tensor parallelism with sequence parallelism for Llama: one plan, as data.

`llama_tp_plan()` maps module paths to styles, and the styles are all the tensor-parallel
communication there is. Per block, forward:

- between blocks the residual stream is this rank's slice of the sequence, [b, s/tp, dim];
  norms run on that slice (`SequenceParallelRMSNorm`, weight replicated, gradient summed over tp);
- attention and MLP all-gather the sequence on entry (`GatherSequence`; backward
  reduce-scatters the input gradient);
- q/k/v and gate/up are column-parallel (`ColumnParallelLinear`: this rank's heads / ffn slice,
  a local matmul, no communication);
- o and down are row-parallel (`RowParallelLinear`: a local matmul gives partial sums, a
  reduce-scatter sums them and splits the sequence again; backward all-gathers).

Around the blocks the embedding is vocab-parallel (`VocabParallelEmbedding`: each rank looks up
the tokens it owns, one reduce-scatter combines and splits the sequence), and the output
projection gathers the sequence and returns logits sharded on the vocabulary
(`VocabParallelHead`), which `parallel.loss.cross_entropy` reduces without gathering them. One
block thus issues 2 all-gathers and 2 reduce-scatters forward, and their mirror images backward,
plus one all-reduce per norm weight's gradient.

Weights become DTensors on the tp mesh (so FSDP2 shards them a second time and checkpoints see
global shapes under HF's names), while the matmuls run on their plain local shards: no DTensor
dispatch in the hot path. A style changes a module's class to a subclass with the parallel
forward (as FSDP2 does); parameter names and the model's code stay as they are.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from hybrid2d.models.llama import RMSNorm, rms_norm
from hybrid2d.parallel.activation_checkpoint import mark_output_not_kept
from hybrid2d.parallel.sequence_comm import (
    gather_sequence,
    reduce_scatter_sequence,
    vocab_parallel_embedding,
)


def _tp_group(weight: DTensor):
    """The tp process group, from the weight itself: under FSDP2 the unsharded parameter is a
    DTensor on the tp mesh, before it a DTensor on the same mesh, tp being the last dim."""
    mesh = weight.device_mesh
    return mesh.get_group(mesh.ndim - 1)


@functools.cache
def _parallel_class(forward_cls: type, module_cls: type) -> type:
    """`module_cls` with the forward of `forward_cls` (one class per pair, so compiled code and
    pickled modules see a stable type)."""
    return type(f"{forward_cls.__name__}[{module_cls.__name__}]", (forward_cls, module_cls), {})


def _shard_parameter(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    """Replace a parameter by a DTensor of it; each rank slices its own piece, no collective
    (on the meta device nothing is even allocated)."""
    param = getattr(module, name)
    dt = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=None)
    module.register_parameter(name, nn.Parameter(dt, param.requires_grad))


class _TPStyle(ParallelStyle):
    """Shard the module's weight on `shard_dim` (None: replicate) and give it `forward_cls`'s
    forward. `shard_dim` is also what the memory estimate reads."""

    forward_cls: type
    shard_dim: int | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if getattr(module, "bias", None) is not None:
            raise NotImplementedError(f"{type(self).__name__}: biases are not supported")
        placement = Replicate() if self.shard_dim is None else Shard(self.shard_dim)
        _shard_parameter(module, "weight", device_mesh, placement)
        module.__class__ = _parallel_class(self.forward_cls, type(module))
        return module


# ---- the parallel forwards (mixed into the model's own module classes) ------------------------


class _ColumnParallelForward:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: the whole sequence (gathered on entry to attention / MLP); out: this rank's columns.
        return F.linear(x, self.weight.to_local())


class _RowParallelForward:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Only the reduce-scatter reads the partial sums: selective checkpointing recomputes them.
        partial = F.linear(mark_output_not_kept(x), self.weight.to_local())
        return reduce_scatter_sequence(partial, _tp_group(self.weight))


class _SequenceParallelNormForward:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x is this rank's slice of the sequence, so the weight's gradient is a partial sum
        # over tp ranks: DTensor sums it (one all-reduce) when it reaches the replicated weight.
        weight = self.weight
        weight = weight.to_local(grad_placements=[Partial()] * weight.device_mesh.ndim)
        return rms_norm(x, weight, self.eps)


class _VocabParallelEmbeddingForward:
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(tokens, self.weight.to_local(), _tp_group(self.weight))


class _VocabParallelHeadForward:
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        logits = F.linear(gather_sequence(h, _tp_group(weight)), weight.to_local())
        # Logits say what they are: sharded on the vocabulary over the tp mesh.
        return DTensor.from_local(logits, weight.device_mesh, [Shard(-1)], run_check=False)


# ---- the styles ------------------------------------------------------------------------------


class ColumnParallelLinear(_TPStyle):
    """Weight rows (output features) split over tp; input: the whole sequence; output: this
    rank's features. No communication."""

    forward_cls = _ColumnParallelForward
    shard_dim = 0


class RowParallelLinear(_TPStyle):
    """Weight columns (input features) split over tp; output: this rank's sequence slice of the
    sum over ranks (reduce-scatter; backward all-gathers)."""

    forward_cls = _RowParallelForward
    shard_dim = 1


class SequenceParallelRMSNorm(_TPStyle):
    """Norm on this rank's sequence slice; weight replicated, its gradient all-reduced."""

    forward_cls = _SequenceParallelNormForward

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, RMSNorm):
            raise TypeError(f"SequenceParallelRMSNorm applies to RMSNorm, not {type(module)}")
        return super()._apply(module, device_mesh)


class VocabParallelEmbedding(_TPStyle):
    """Embedding rows (vocabulary) split over tp; output: this rank's sequence slice."""

    forward_cls = _VocabParallelEmbeddingForward
    shard_dim = 0


class VocabParallelHead(_TPStyle):
    """Output projection rows (vocabulary) split over tp; gathers the sequence first and returns
    [b, s, vocab/tp] logits as a DTensor sharded on the last dim."""

    forward_cls = _VocabParallelHeadForward
    shard_dim = 0


class GatherSequence(ParallelStyle):
    """All-gather the sequence of a module's first input ([b, s/tp, ...] -> [b, s, ...]);
    backward reduce-scatters its gradient. No parameters."""

    shard_dim = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def gather_first(_module, args):
            return (gather_sequence(args[0], group), *args[1:])

        module.register_forward_pre_hook(gather_first)
        return module


def llama_tp_plan() -> dict[str, ParallelStyle]:
    """Module path (`*` matches any block index) -> style: the whole of Llama's tensor
    parallelism."""
    return {
        "model.embed_tokens": VocabParallelEmbedding(),
        "model.layers.*.input_layernorm": SequenceParallelRMSNorm(),
        "model.layers.*.self_attn": GatherSequence(),
        "model.layers.*.self_attn.q_proj": ColumnParallelLinear(),
        "model.layers.*.self_attn.k_proj": ColumnParallelLinear(),
        "model.layers.*.self_attn.v_proj": ColumnParallelLinear(),
        "model.layers.*.self_attn.o_proj": RowParallelLinear(),
        "model.layers.*.post_attention_layernorm": SequenceParallelRMSNorm(),
        "model.layers.*.mlp": GatherSequence(),
        "model.layers.*.mlp.gate_proj": ColumnParallelLinear(),
        "model.layers.*.mlp.up_proj": ColumnParallelLinear(),
        "model.layers.*.mlp.down_proj": RowParallelLinear(),
        "model.norm": SequenceParallelRMSNorm(),
        "lm_head": VocabParallelHead(),
    }


def block_tp_plan() -> dict[str, ParallelStyle]:
    """The plan's entries for one block, with paths relative to the block (what the planner's
    calibration times)."""
    prefix = "model.layers.*."
    return {k.removeprefix(prefix): v for k, v in llama_tp_plan().items() if k.startswith(prefix)}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard a `Llama` over the 1-D tp mesh in place (no-op for tp == 1)."""
    if tp_mesh.size() == 1:
        return
    parallelize_module(model, tp_mesh, llama_tp_plan())
    # Tied embeddings: both styles shard the [vocab, dim] weight on dim 0, so one DTensor
    # parameter serves both once re-tied.
    model.tie_weights()
