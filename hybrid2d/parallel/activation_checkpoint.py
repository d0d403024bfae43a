"""Activation checkpointing per transformer block.

Done by the model's forward (torch.utils.checkpoint around each block) rather than by wrapping
modules, so parameter names stay those of HF `LlamaForCausalLM`.
"""

from __future__ import annotations

from torch import nn


def apply_ac(model: nn.Module, mode: str) -> None:
    model.activation_checkpoint = mode == "full"
