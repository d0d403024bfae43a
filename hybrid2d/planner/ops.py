"""How many aten ops one training step dispatches: the count the per-op CPU cost multiplies.

Eager PyTorch pays microseconds of CPU per dispatched op (Python, the dispatcher, autograd,
DTensor / FSDP / checkpoint hooks) whatever the op's size; at small shapes that, not FLOPs or
bytes, sets the step time. The count comes from the model's structure:

- one block's forward + backward, and the head's (embedding, final norm, output projection,
  cross entropy), counted by running them under a dispatch counter at a tiny shape of the same
  structure (heads, kv heads, tying and the family's switches: biases, q/k norms, sandwich
  norms, the activation, the embedding scale), with the trainer's checkpoint call and
  selective policy, so that recompute's ops are counted as they run;
- per tp collective, per FSDP unit's all-gather / reduce-scatter and per parameter in the
  optimizer: the ops the trainer's code issues around each (listed below, counted by hand from
  `parallel/sequence_comm.py`, FSDP2's copy-in / copy-out and `optim.py`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

# Private module, no public home yet (torch 2.13): TorchDispatchMode is what FlopCounterMode and
# CommDebugMode are built on; move when torch exports it publicly.
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from hybrid2d.config import ModelConfig
from hybrid2d.models.llama import Llama, decoder_layer
from hybrid2d.parallel.activation_checkpoint import selective_context
from hybrid2d.parallel.tensor_parallel import block_tp_plan

# A sequence-parallel collective (`sequence_comm._gather` / `_reduce_scatter`): the input's
# contiguous copy, the collective, its wait, and the re-layout of the result (view, movedim /
# chunk and cat): about 5 ops each, forward or backward.
OPS_PER_TP_COLLECTIVE = 5
# One FSDP2 unit's all-gather: the output buffer, copy-in, the collective, its wait, the
# split copy-out; then per parameter a view into the unsharded buffer and its as_strided.
OPS_PER_FSDP_GATHER = 5
OPS_PER_FSDP_GATHER_PARAM = 2
# One unit's reduce-scatter: the input buffer, the chunk-cat copy-in, the collective, its wait,
# the division by the group size; per parameter a view of its shard and its accumulation.
OPS_PER_FSDP_REDUCE = 5
OPS_PER_FSDP_REDUCE_PARAM = 2
# Optimizer step per parameter tensor: clipping's local view and norm list entry, the fused
# AdamW's step-count increment and the zeroing of its gradient (foreach and fused ops
# dispatch once per list, but each tensor's DTensor unwrap and state are per tensor).
OPS_PER_PARAM_OPTIMIZER = 4
OPS_PER_STEP_OPTIMIZER = 20  # norms' stack, pow, sum, sqrt, clip coefficient, lr, ...


def block_params(m: ModelConfig) -> int:
    """Parameter tensors of one block: q, k, v, o, gate, up, down and two norms, the q/k/v
    biases, the per-head q and k norms, the two sandwich norms."""
    return 9 + 3 * m.qkv_bias + 2 * m.qk_norm + 2 * m.sandwich_norms


class OpCounter(TorchDispatchMode):
    """Counts every aten op that reaches the dispatcher while active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def tiny(m: ModelConfig) -> ModelConfig:
    """The same structure (heads, kv heads, weight tying, family switches) at a shape where
    counting is cheap. One full-attention layer: a sliding window changes which mask the block
    is given (built once per batch, outside the blocks), not the ops of the block."""
    return dataclasses.replace(
        m,
        dim=8 * m.n_heads,
        attn_head_dim=8 if m.attn_head_dim else 0,
        ffn_dim=16,
        vocab_size=32,
        n_layers=1,
        max_position_embeddings=64,
        sliding_window=0,
        layer_types="",
    )


# The fields that decide which ops a block and the head dispatch (not their sizes).
_STRUCTURE = (
    "family",
    "n_heads",
    "n_kv_heads",
    "tie_embeddings",
    "qkv_bias",
    "qk_norm",
    "norm_plus_one",
    "sandwich_norms",
    "mlp_activation",
    "scale_embeddings",
    "attn_head_dim",
)


def _structure(m: ModelConfig) -> tuple:
    return tuple((name, getattr(m, name)) for name in _STRUCTURE)


def block_ops(m: ModelConfig, mode: str) -> int:
    """Aten ops of one block's forward + backward (tp 1) under checkpointing `mode`."""
    return _block_ops(_structure(m), mode)


def head_ops(m: ModelConfig) -> int:
    """Aten ops of the embedding, final norm, output projection and loss, forward + backward."""
    return _head_ops(_structure(m))


def _tiny_from(structure: tuple) -> ModelConfig:
    return tiny(ModelConfig(**dict(structure)))


@functools.lru_cache(maxsize=64)
def _block_ops(structure: tuple, mode: str) -> int:
    with torch.random.fork_rng():
        run = block_step(_tiny_from(structure), 1, 8, mode, torch.float32, torch.device("cpu"))
    with OpCounter() as counter:
        run()
    return counter.count


def block_step(
    m: ModelConfig, batch: int, seq: int, mode: str, dtype, device, tp_mesh=None, dp_mesh=None
):
    """One whole block (seeded) and a function running its forward + backward under
    checkpointing `mode` the trainer's way (`torch.utils.checkpoint`, non-reentrant, selective
    with the trainer's policy): what calibration times and what the op count counts. With a
    `tp_mesh` of more than one rank the block is sharded by the trainer's tensor-parallel plan
    and takes this rank's sequence shard, as in a step; with a `dp_mesh` it is an FSDP2 unit
    over it, resharded after forward, inside a root without parameters (as every block but the
    last in the trainer)."""
    torch.manual_seed(0)
    layer = decoder_layer(m).to(device=device, dtype=dtype)
    tp = 1
    if tp_mesh is not None and tp_mesh.size() > 1:
        tp = tp_mesh.size()
        parallelize_module(layer, tp_mesh, block_tp_plan())
    if dp_mesh is not None:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=True)
        layer = fully_shard(_Root(layer), mesh=dp_mesh)
    cos, sin = Llama(dataclasses.replace(m, n_layers=0)).to(device).rope(seq, dtype)
    x = torch.randn(batch, seq // tp, m.dim, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn_like(x)

    def run():
        if mode == "none":
            y = layer(x, cos, sin)
        else:
            ctx = {"context_fn": selective_context} if mode == "selective" else {}
            y = checkpoint(layer, x, cos, sin, use_reentrant=False, **ctx)
        y.backward(grad)

    return run


class _Root(nn.Module):
    """A parameterless root, so that the block under it is an inner FSDP unit."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return self.block(*args)


@functools.lru_cache(maxsize=64)
def _head_ops(structure: tuple) -> int:
    m = dataclasses.replace(_tiny_from(structure), n_layers=0)
    seq = 8
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Llama(m)
        tokens = torch.randint(0, m.vocab_size, (1, seq))
    with OpCounter() as counter:
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten(), reduction="sum")
        loss.backward()
    return counter.count


def step_ops(
    m: ModelConfig,
    mode: str,
    n_micro: int,
    tp_collectives: int,
    fsdp_gathers: int,
    fsdp_reduces: int,
    params: int,
) -> dict[str, int]:
    """Ops one rank dispatches in a step, by source. `fsdp_gathers` / `fsdp_reduces` count the
    unit collectives (all units, every micro batch); `params` the rank's parameter tensors."""
    per_unit = block_params(m)
    return {
        "blocks": m.n_layers * n_micro * block_ops(m, mode),
        "head": n_micro * head_ops(m),
        "tp_collectives": tp_collectives * OPS_PER_TP_COLLECTIVE,
        "fsdp": fsdp_gathers * (OPS_PER_FSDP_GATHER + OPS_PER_FSDP_GATHER_PARAM * per_unit)
        + fsdp_reduces * (OPS_PER_FSDP_REDUCE + OPS_PER_FSDP_REDUCE_PARAM * per_unit),
        "optimizer": params * OPS_PER_PARAM_OPTIMIZER + OPS_PER_STEP_OPTIMIZER,
    }
