"""What a run reports: TensorBoard scalars, throughput, MFU and memory figures (rank 0 logs)."""

from __future__ import annotations

import resource
import sys
from collections import Counter

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


def attended_keys(m: ModelConfig, seq_len: int) -> int:
    """(query, key) pairs one sequence of `seq_len` attends to, summed over the layers: the query
    at position i (1-based) sees i keys, or min(window, i) on a sliding-window layer."""
    full = seq_len * (seq_len + 1) // 2
    total = 0
    for layer in range(m.n_layers):
        w = m.layer_window(layer)
        total += full if not w or w >= seq_len else w * (w + 1) // 2 + (seq_len - w) * w
    return total


def attended_pairs(m: ModelConfig, lengths) -> int:
    """(query, key) pairs, summed over the layers, of documents of these lengths each attending
    only within itself (packed rows with document masks; a row without documents is one of its
    real tokens): `attended_keys` of each document."""
    return sum(n * attended_keys(m, length) for length, n in Counter(lengths).items())


def step_flops(m: ModelConfig, tokens: int, pairs: int) -> float:
    """Model FLOPs (forward + backward) of `tokens` training tokens whose attention masks let
    `pairs` (query, key) pairs through (summed over the layers: `attended_pairs`); see
    `flops_per_token`."""
    return 6 * _matmul_weights(m) * tokens + 12 * m.n_heads * m.head_dim * pairs


def _matmul_weights(m: ModelConfig) -> int:
    hd = m.head_dim
    projections = m.dim * hd * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.dim * m.ffn_dim
    return m.n_layers * projections + m.vocab_size * m.dim


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward) of rows of `seq_len` tokens, one
    sequence each, the numerator of MFU.

    A weight used in a matmul costs 2 FLOPs per token forward and 4 backward (input and weight
    gradients). The weights that do matmuls are the block projections (of `head_dim`-sized heads,
    which need not be dim / heads) and the output head (also when tied to the embedding: the
    lookup is free, the head matmul is not). Biases, norms (the per-head q/k norms too), the
    activation (SiLU or GELU) and the embedding scale are elementwise and count none, as in every
    MFU figure. Attention's scores and weighted sum cost 4 x head_dim x heads per (query, key)
    pair forward, 12 with backward, over the pairs the mask lets through (`attended_keys`:
    causal, and the window on sliding layers). Rows packed with several documents attend to
    fewer pairs: `step_flops` with `attended_pairs` counts those.
    """
    if not seq_len:
        return 6 * _matmul_weights(m)
    return (
        6 * _matmul_weights(m) + 12 * m.n_heads * m.head_dim * attended_keys(m, seq_len) / seq_len
    )


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
