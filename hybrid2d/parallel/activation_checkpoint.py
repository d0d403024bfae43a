"""Activation checkpointing per transformer block: none, full, or selective.

Applied from outside: each block's `forward` is replaced by torch.utils.checkpoint around the
original one. No wrapper module is inserted, so parameter names stay those of HF
`LlamaForCausalLM`, and FSDP2's hooks (on the block's `__call__`) run outside the checkpoint.

full keeps only each block's input and recomputes the whole block in backward, communication
included. selective keeps the outputs of the expensive ops (matmuls, attention, collectives)
and recomputes the cheap elementwise ones (norms, RoPE, SiLU, residual adds): most of the
activation memory of a block is in those elementwise intermediates, while nearly all of its
compute and all of its communication is in the saved ops, so backward repeats no collective.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

MODES = ("none", "full", "selective")


@functools.cache
def _saved_ops() -> frozenset:
    aten, funcol = torch.ops.aten, torch.ops._c10d_functional
    ops = [
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        funcol.all_gather_into_tensor.default,
        funcol.reduce_scatter_tensor.default,
        funcol.all_reduce.default,
        funcol.wait_tensor.default,
    ]
    return frozenset(ops)


class _State:
    # A plain class attribute, not a threading.local: torch.compile (Dynamo) cannot read a
    # threading.local's attribute and ran every selective block on tp > 1 eagerly instead. A
    # rank runs one forward at a time (recomputation happens inside backward, which the forward
    # waits for), so one flag serves.
    skip = False


@contextlib.contextmanager
def output_not_kept():
    """Around a matmul whose output only feeds a reduce-scatter (row-parallel o and down):
    backward needs neither, and the reduce-scatter's output is kept, so selective checkpointing
    recomputes this matmul rather than keeping a full-sequence [b, s, dim] tensor. Eager only:
    under torch.compile the policy runs when the graph is traced, after this flag is reset, so
    compiled blocks keep both matmul outputs (profiling/estimate.py counts them)."""
    _State.skip = True
    try:
        yield
    finally:
        _State.skip = False


def _policy(ctx, op, *args, **kwargs):
    if op in _saved_ops() and not _State.skip:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """context_fn for torch.utils.checkpoint: save matmul, attention and collective outputs."""
    return create_selective_checkpoint_contexts(_policy)


def apply_ac(model: nn.Module, mode: str) -> None:
    """Checkpoint every transformer block of `model.model.layers` (mode none: nothing)."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {MODES}")
    if mode == "none":
        return
    checkpointed = _selective if mode == "selective" else _full
    for block in model.model.layers:
        block.forward = functools.partial(checkpointed, block.forward)


# Full checkpointing passes no context_fn: under torch.compile (torch 2.13) an explicit
# `context_fn=noop_context_fn` that reaches checkpoint() as an argument stops Dynamo
# ("checkpoint not implemented for LazyVariableTracker context_fn"), so parallel.compile with
# full checkpointing failed on its first step.
def _full(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing to keep or recompute
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _selective(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=selective_context, **kwargs)
