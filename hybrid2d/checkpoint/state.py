"""The model's, the optimizer's and the RNG's state as objects the Checkpointer saves and loads.

Each has `state_dict`/`load_state_dict` (`torch.distributed.checkpoint.stateful.Stateful`), so
the Checkpointer saves a dict of them and reaches into no trainer. The model and optimizer go
through DCP's get/set_*_state_dict: HF parameter names, the FSDP/TP shards as DTensors, and
the optimizer's state keyed by the same names, so a checkpoint loads on any mesh.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


class ModelState:
    """A (parallelized) model's parameters and buffers, by HF name. `trainable_only` (LoRA):
    the adapters alone; the frozen base is read from its source again, never saved twice."""

    def __init__(self, model: nn.Module, trainable_only: bool = False):
        self.model = model
        # strict=False with trainable_only: the base is absent from the state by design.
        self.options = StateDictOptions(
            ignore_frozen_params=trainable_only, strict=not trainable_only
        )

    def state_dict(self) -> dict:
        state = get_model_state_dict(self.model, options=self.options)
        if self.options.ignore_frozen_params:
            # A tied head is not among named_parameters() (deduplicated), so DCP keeps its
            # frozen weight under lm_head.weight: only the trainable names stay.
            names = self.model.named_parameters(remove_duplicate=False)
            trainable = {n for n, p in names if p.requires_grad}
            state = {k: v for k, v in state.items() if k in trainable}
        return state

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state, options=self.options)


class OptimizerState:
    """The optimizer's state and param groups, keyed by the model's parameter names."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The CPU generator's state, and the device's where it is CUDA."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    """Restore the generators `state` has (a CPU checkpoint resumed on CUDA has no cuda one)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
