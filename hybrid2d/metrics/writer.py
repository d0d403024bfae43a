"""What a run reports: TensorBoard scalars, throughput, MFU and memory figures (rank 0 logs)."""

from __future__ import annotations

import resource
import sys

import psutil
import torch

from hybrid2d.config import ModelConfig


def peak_rss_bytes() -> int:
    """Peak resident set size of this process."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return psutil.Process().memory_info().rss


def device_peaks(device: torch.device) -> tuple[int, int]:
    """(peak allocated by tensors, peak reserved by the caching allocator) on a CUDA device
    since the last torch.cuda.reset_peak_memory_stats; (0, 0) on other devices."""
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def peak_memory_bytes(device: torch.device) -> int:
    """The one peak-memory figure of a run: peak memory allocated by tensors on CUDA, peak
    process RSS elsewhere."""
    return device_peaks(device)[0] if device.type == "cuda" else peak_rss_bytes()


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward), the numerator of MFU.

    A weight used in a matmul costs 2 FLOPs per token forward and 4 backward (input and weight
    gradients). The weights that do matmuls are the block projections and the output head (also
    when tied to the embedding: the lookup is free, the head matmul is not); norm weights do
    none. Attention's scores and weighted sum cost 4 x seq x (heads x head_dim) per layer
    forward, 12 with backward; causal masking leaves half of that useful.
    """
    hd = m.head_dim
    projections = m.dim * hd * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.dim * m.ffn_dim
    matmul_weights = m.n_layers * projections + m.vocab_size * m.dim
    attention = 12 * m.n_layers * m.n_heads * hd * seq_len / 2
    return 6 * matmul_weights + attention


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
