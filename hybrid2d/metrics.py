"""What a run reports: TensorBoard scalars, throughput, MFU and memory figures (rank 0 logs)."""

from __future__ import annotations

import resource
import sys

import torch

from hybrid2d.config import ModelConfig


def peak_rss_bytes() -> int:
    """Peak resident set size of this process."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory allocated by tensors on CUDA; peak process RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_rss_bytes()


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (non-embedding) params plus attention's score/value matmuls."""
    params = m.num_params() - m.vocab_size * m.dim  # the embedding lookup costs no matmul
    attention = 12 * m.n_layers * m.dim * seq_len / 2  # causal: half the scores
    return 6 * params + attention


class MetricsWriter:
    """TensorBoard scalars on rank 0; a no-op elsewhere or when disabled."""

    def __init__(self, run_dir: str | None, enabled: bool):
        self.writer = None
        if run_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=f"{run_dir}/tensorboard")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
