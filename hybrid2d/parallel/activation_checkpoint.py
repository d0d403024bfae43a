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

import functools
import logging

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


def mark_output_not_kept(x: torch.Tensor) -> torch.Tensor:
    """`x`, through an alias: the next matmul (the one on `x`) is recomputed by selective
    checkpointing rather than kept. For a row-parallel matmul (o and down) whose output only
    feeds a reduce-scatter: backward needs neither, and the reduce-scatter's output is kept, so
    keeping the full-sequence [b, s, dim] product would be waste.

    The mark is an op (aten.alias, which nothing else in a block calls) rather than a Python
    flag around the matmul, because under torch.compile the policy runs while the graph is
    traced, where only ops are seen: a flag had been reset by then, and compiled blocks kept
    both products."""
    return torch.ops.aten.alias.default(x)


def selective_context():
    """context_fn for torch.utils.checkpoint: save matmul, attention and collective outputs,
    except a matmul marked by `mark_output_not_kept`. One policy per checkpointed call, so the
    mark never leaks between blocks; forward and recomputation see the same op sequence."""
    saved, marked = _saved_ops(), [False]
    not_kept = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)

    def policy(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.alias.default:
            marked[0] = True
        elif op in not_kept and marked[0]:
            marked[0] = False
        elif op in saved:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class _InPlaceAdvice(logging.Filter):
    """Drops torch.compile's once-per-rank advice that a checkpointed region with a context_fn
    must hold no in-place ops: our blocks hold none, and every compiled selective run printed it
    on every rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


def apply_ac(model: nn.Module, mode: str) -> None:
    """Checkpoint every transformer block of `model.model.layers` (mode none: nothing)."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {MODES}")
    if mode == "none":
        return
    if mode == "selective":
        # The module that warns (torch 2.13); no public switch for this one message.
        advice = logging.getLogger("torch._higher_order_ops.wrap")
        if not any(isinstance(f, _InPlaceAdvice) for f in advice.filters):
            advice.addFilter(_InPlaceAdvice())
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
