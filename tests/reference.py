"""Single-process references that the parallel runs are compared against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid2d.config import JobConfig, ModelConfig
from hybrid2d.models.llama import Llama
from hybrid2d.optim import lr_multiplier


def tiny_config(optimizer: str = "adamw", grad_clip: float = 1.0, steps: int = 10) -> JobConfig:
    """A model small enough for 4 CPU ranks, divisible by tp = 1, 2 and 4."""
    cfg = JobConfig(recipe="tiny")
    cfg.model = ModelConfig(
        dim=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=128,
        vocab_size=256,
        rope_theta=500000.0,
        rope_scaling_factor=8.0,
        rope_original_max_position=16,
    )
    t = cfg.train
    t.steps, t.global_batch, t.micro_batch, t.seq_len = steps, 8, 0, 16
    t.optimizer, t.grad_clip, t.seed = optimizer, grad_clip, 3
    t.lr = 0.5 if optimizer == "sgd" else 3e-3
    t.warmup_steps = 2
    cfg.metrics.tensorboard = False
    cfg.metrics.progress_bar = False
    return cfg


def global_batches(cfg: JobConfig, seed: int = 11):
    """The same global batches for every mesh: (inputs, labels) of global_batch samples."""
    gen = torch.Generator().manual_seed(seed)
    t = cfg.train
    for _ in range(t.steps):
        tokens = torch.randint(
            0, cfg.model.vocab_size, (t.global_batch, t.seq_len + 1), generator=gen
        )
        yield tokens[:, :-1], tokens[:, 1:]


def reference_optimizer(model, t):
    """torch.optim's SGD or AdamW (decay on matrices only) and the trainer's LR schedule."""
    if t.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=t.lr)
    else:
        matrices = [p for p in model.parameters() if p.ndim >= 2]
        vectors = [p for p in model.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW(
            [
                {"params": matrices, "weight_decay": t.weight_decay},
                {"params": vectors, "weight_decay": 0.0},
            ],
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=1e-8,
        )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, t))


def train_single_process(cfg: JobConfig) -> dict:
    """Plain PyTorch: one model, torch.optim, torch.nn.utils.clip_grad_norm_, on
    global_batches (no label is -100: every token counts)."""
    return train_single_process_masked(cfg, global_batches(cfg))


# ---- instruction data: labels -100 off the loss, uneven loss tokens per sample ---------------


def masked_global_batches(cfg: JobConfig, seed: int = 11, steps: int | None = None):
    """Global batches like instruction data: per sample a prompt (labels -100), a completion
    of uneven length (the loss tokens) and padding (labels -100); some samples have a single
    loss token, some dozens, so the normalisation by the global count matters."""
    gen = torch.Generator().manual_seed(seed)
    t = cfg.train
    out = []
    for _ in range(t.steps if steps is None else steps):
        tokens = torch.randint(
            0, cfg.model.vocab_size, (t.global_batch, t.seq_len + 1), generator=gen
        )
        inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        for i in range(t.global_batch):
            prompt = int(torch.randint(0, t.seq_len - 1, (1,), generator=gen))
            left = t.seq_len - prompt
            answer = int(torch.randint(1, left + 1, (1,), generator=gen))
            labels[i, :prompt] = -100
            labels[i, prompt + answer :] = -100
            inputs[i, prompt + answer + 1 :] = 0  # padding
        out.append((inputs, labels))
    return out


def train_single_process_masked(cfg: JobConfig, batches, val=None) -> dict:
    """Plain PyTorch on the given global batches: loss = summed token cross entropy over the
    labels other than -100, divided by their number in the global batch. `val`: (inputs,
    labels) of a held-out set, whose token-weighted mean loss is measured after training."""
    t = cfg.train
    model = Llama(cfg.model)
    model.init_weights(t.seed)
    opt, sched = reference_optimizer(model, t)
    losses, norms = [], []
    for inputs, labels in batches:
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    out = {"losses": losses, "norms": norms, "params": dict(model.named_parameters())}
    if val is not None:
        with torch.no_grad():
            inputs, labels = val
            out["val_loss"] = F.cross_entropy(
                model(inputs).flatten(0, 1).double(), labels.flatten(), ignore_index=-100
            ).item()
    return out
