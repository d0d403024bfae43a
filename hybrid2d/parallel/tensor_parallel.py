"""Megatron-style tensor parallelism with sequence parallelism for every family: one plan, as data.

`tp_plan(cfg)` maps module paths to styles, and the styles are all the tensor-parallel
communication there is. Per block, forward:

- between blocks the residual stream is this rank's slice of the sequence, [b, s/tp, dim];
  norms run on that slice (`SequenceParallelRMSNorm`, weight replicated, gradient summed over
  tp): the two of Llama, the four of Gemma 3's sandwich (before and after attention and MLP),
  Gemma's (1 + w) norms alike;
- attention and MLP all-gather the sequence on entry (`GatherSequence`; backward
  reduce-scatters the input gradient);
- q/k/v and gate/up are column-parallel (`ColumnParallelLinear`: this rank's heads / ffn slice,
  a local matmul, no communication; a bias (Qwen2) is split with its weight's rows);
- past the kv heads (tp a multiple of n_kv_heads) k and v are `KVHeadLinear`: whole on every
  rank, each rank computing the one kv head its query heads use, no forward communication;
- per-head q/k norms (Qwen3, Gemma 3) run on this rank's heads (`HeadRMSNorm`, weight
  replicated, gradient summed over tp);
- o and down are row-parallel (`RowParallelLinear`: a local matmul gives partial sums, a
  reduce-scatter sums them and splits the sequence again; backward all-gathers).

Around the blocks the embedding is vocab-parallel (`VocabParallelEmbedding`: each rank looks up
the tokens it owns, one reduce-scatter combines and splits the sequence), and the output
projection gathers the sequence and returns logits sharded on the vocabulary
(`VocabParallelHead`), which `parallel.loss.cross_entropy` reduces without gathering them.

So one block issues 2 all-gathers and 2 reduce-scatters forward, their mirror images backward,
and in backward one all-reduce over tp for each weight replicated over tp: its norms (2, or 4
with sandwich norms), the q and k norms, and past the kv heads the k and v weights and biases
(each rank's gradient fills only its head's rows; the sum adds the ranks sharing a head, once).
`planner.comm.tp_replicated_grads` counts these.

Weights become DTensors on the tp mesh (so FSDP2 shards them a second time and checkpoints see
global shapes under HF's names: shared kv heads are stored once), while the matmuls run on their
plain local shards: no DTensor dispatch in the hot path. A style changes a module's class to a
subclass with the parallel forward (as FSDP2 does); parameter names and the model's code stay
as they are.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from hybrid2d.config import ModelConfig
from hybrid2d.models.llama import RMSNorm
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
    """Shard the module's weight (and bias, if any) on `shard_dim` (None: replicate) and give
    it `forward_cls`'s forward. `shard_dim` and `max_shards` are also what the memory estimate
    reads: past `max_shards` ranks a sharded weight is replicated instead (kv heads)."""

    forward_cls: type
    shard_dim: int | None = None
    max_shards: int | None = None

    def _placement(self, tp: int):
        return Replicate() if self.shard_dim is None else Shard(self.shard_dim)

    def _forward_cls(self, tp: int) -> type:
        return self.forward_cls

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        placement = self._placement(device_mesh.size())
        _shard_parameter(module, "weight", device_mesh, placement)
        if getattr(module, "bias", None) is not None:
            # A bias is indexed by output features: it splits with a weight split on its rows
            # and is replicated with a replicated weight; a split on input features (row
            # parallel) would need it added once after the sum, which no family has.
            if placement == Shard(1):
                raise NotImplementedError(f"{type(self).__name__}: a bias after the sum over tp")
            _shard_parameter(module, "bias", device_mesh, placement)
        module.__class__ = _parallel_class(self._forward_cls(device_mesh.size()), type(module))
        return module


# ---- the parallel forwards (mixed into the model's own module classes) ------------------------


def _summed_local(param: DTensor) -> torch.Tensor:
    """The local tensor of a weight replicated over tp, used on this rank's share of the work
    (its sequence slice, its heads): the gradient is a partial sum over tp ranks, which DTensor
    sums (one all-reduce) when it reaches the replicated weight."""
    return param.to_local(grad_placements=[Partial()] * param.device_mesh.ndim)


class _ColumnParallelForward:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: the whole sequence (gathered on entry to attention / MLP); out: this rank's columns.
        bias = None if self.bias is None else self.bias.to_local()
        return F.linear(x, self.weight.to_local(), bias)


class _KVHeadForward:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The k/v weight is whole on every tp rank; this rank computes the rows of the one kv
        # head its query heads use. Its gradient fills only those rows, and the sum over tp
        # adds the ranks that share the head.
        start, rows = self.kv_rows
        weight = _summed_local(self.weight).narrow(0, start, rows)
        bias = None if self.bias is None else _summed_local(self.bias).narrow(0, start, rows)
        return F.linear(x, weight, bias)


class _RowParallelForward:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Only the reduce-scatter reads the partial sums: selective checkpointing recomputes them.
        partial = F.linear(mark_output_not_kept(x), self.weight.to_local())
        return reduce_scatter_sequence(partial, _tp_group(self.weight))


class _ReplicatedNormForward:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x is this rank's share (sequence slice or heads): the weight's gradient is partial.
        # The norm's own arithmetic (Llama's w * x, Gemma's (1 + w) * x) on the local weight.
        return self.normalize(x, _summed_local(self.weight))


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


class KVHeadLinear(_TPStyle):
    """k or v projection over `n_kv_heads` heads. Column parallel while tp divides the heads;
    past them (tp a multiple of n_kv_heads) the weight stays whole on every rank (HF's shape in
    checkpoints, no duplicated heads), each rank computes the one kv head its query heads use,
    and the weight's gradient is all-reduced over tp: the sum over the ranks sharing a head."""

    shard_dim = 0

    def __init__(self, n_kv_heads: int):
        super().__init__()
        self.max_shards = n_kv_heads

    def _placement(self, tp: int):
        return Shard(0) if tp <= self.max_shards else Replicate()

    def _forward_cls(self, tp: int) -> type:
        return _ColumnParallelForward if tp <= self.max_shards else _KVHeadForward

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, heads = device_mesh.size(), self.max_shards
        if (tp % heads if tp > heads else heads % tp) or module.out_features % heads:
            raise ValueError(f"KVHeadLinear: tp={tp} neither divides nor is a multiple of {heads}")
        if tp > heads:
            # Query heads are split evenly, so ranks r*tp/heads .. (r+1)*tp/heads - 1 hold the
            # queries of kv head r.
            rows = module.out_features // heads
            module.kv_rows = (device_mesh.get_local_rank() // (tp // heads) * rows, rows)
        return super()._apply(module, device_mesh)


class _ReplicatedNorm(_TPStyle):
    forward_cls = _ReplicatedNormForward

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, RMSNorm):
            raise TypeError(f"{type(self).__name__} applies to RMSNorm, not {type(module)}")
        return super()._apply(module, device_mesh)


class SequenceParallelRMSNorm(_ReplicatedNorm):
    """Norm on this rank's sequence slice; weight replicated, its gradient all-reduced."""


class HeadRMSNorm(_ReplicatedNorm):
    """Per-head norm (q_norm, k_norm) on this rank's heads; weight replicated, its gradient
    all-reduced."""


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
    max_shards = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def gather_first(_module, args):
            return (gather_sequence(args[0], group), *args[1:])

        module.register_forward_pre_hook(gather_first)
        return module


def tp_plan(cfg: ModelConfig) -> dict[str, ParallelStyle]:
    """Module path (`*` matches any block index) -> style: the whole tensor parallelism of a
    model of any family. The switches only add entries (q/k norms, the second pair of
    sandwich norms) or change what a style does with what it finds (a bias splits with its
    weight, a (1 + w) norm is still a replicated norm)."""
    block = "model.layers.*."
    plan = {
        "model.embed_tokens": VocabParallelEmbedding(),
        block + "input_layernorm": SequenceParallelRMSNorm(),
        block + "self_attn": GatherSequence(),
        block + "self_attn.q_proj": ColumnParallelLinear(),
        block + "self_attn.k_proj": KVHeadLinear(cfg.n_kv_heads),
        block + "self_attn.v_proj": KVHeadLinear(cfg.n_kv_heads),
    }
    if cfg.qk_norm:
        plan[block + "self_attn.q_norm"] = HeadRMSNorm()
        plan[block + "self_attn.k_norm"] = HeadRMSNorm()
    plan[block + "self_attn.o_proj"] = RowParallelLinear()
    # Llama's norm before the MLP; with sandwich norms (Gemma 3) the norm of attention's output.
    plan[block + "post_attention_layernorm"] = SequenceParallelRMSNorm()
    if cfg.sandwich_norms:
        plan[block + "pre_feedforward_layernorm"] = SequenceParallelRMSNorm()
    plan |= {
        block + "mlp": GatherSequence(),
        block + "mlp.gate_proj": ColumnParallelLinear(),
        block + "mlp.up_proj": ColumnParallelLinear(),
        block + "mlp.down_proj": RowParallelLinear(),
    }
    if cfg.sandwich_norms:
        plan[block + "post_feedforward_layernorm"] = SequenceParallelRMSNorm()
    plan |= {"model.norm": SequenceParallelRMSNorm(), "lm_head": VocabParallelHead()}
    return plan


def block_tp_plan(cfg: ModelConfig) -> dict[str, ParallelStyle]:
    """The plan's entries for one block, with paths relative to the block (what the planner's
    calibration times)."""
    prefix = "model.layers.*."
    return {k.removeprefix(prefix): v for k, v in tp_plan(cfg).items() if k.startswith(prefix)}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard a `Llama` (any family) over the 1-D tp mesh in place (no-op for tp == 1)."""
    if tp_mesh.size() == 1:
        return
    parallelize_module(model, tp_mesh, tp_plan(model.cfg))
    # Tied embeddings: both styles shard the [vocab, dim] weight on dim 0, so one DTensor
    # parameter serves both once re-tied.
    model.tie_weights()
