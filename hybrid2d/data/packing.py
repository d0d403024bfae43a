"""Fixed-length training samples cut from the flat token stream.

Sample i is the window tokens[i*seq_len : i*seq_len + seq_len + 1]: its first seq_len tokens are
the inputs and its last seq_len the labels (next-token targets). Neighbouring windows share one
token, so every token of the stream except the very first is a label exactly once. Documents run
across window edges, separated only by EOS, so no compute is spent on padding.

With document masking (data.document_mask on, `eos` given) a window's positions carry the index
of their document within the window: a document ends with its EOS, so a position's index is the
number of EOS tokens before it in the window. Attention then stays inside each document and RoPE
positions restart at each (the first document of a window is the tail of one that began in an
earlier window: it starts at position 0 there too, as it would in any window-based trainer).
"""

from __future__ import annotations

import numpy as np
import torch

from hybrid2d.data.batch import Batch
from hybrid2d.errors import ConfigError


class PackedDataset:
    """Windows of seq_len + 1 tokens over a 1-D token array (which may be a read-only mmap)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, source: str = "", eos: int | None = None):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_samples = max(0, (len(tokens) - 1) // seq_len)
        if self.num_samples == 0:
            raise ConfigError(
                f"data.path={source!r}{'' if source else ' (the built-in corpus)'} holds "
                f"{len(tokens)} tokens, fewer than train.seq_len+1="
                f"{seq_len + 1}; use more text (a larger data.max_chars for the built-in corpus) "
                "or a smaller train.seq_len"
            )
        self._offsets = np.arange(seq_len + 1)
        self.eos = eos  # None: no document masking

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of sample i, each LongTensor[seq_len]."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        batch = self.gather(np.array([i]))
        return batch.inputs[0], batch.labels[0]

    def gather(self, indices) -> Batch:
        """The given samples as a Batch of [len(indices), seq_len] inputs and labels (and
        documents with document masking); every position is a real token.

        One vectorized read: on an mmap only the touched pages are loaded.
        """
        idx = np.asarray(indices, dtype=np.int64)
        windows = self.tokens[idx[:, None] * self.seq_len + self._offsets]
        return windows_batch(torch.from_numpy(windows.astype(np.int64)), self.eos)


def windows_batch(windows: torch.Tensor, eos: int | None) -> Batch:
    """Windows [b, seq_len + 1] as a Batch: inputs, next-token labels and, with `eos` (document
    masking), each position's document within its window."""
    inputs, labels = windows[:, :-1], windows[:, 1:]
    documents = None
    if eos is not None:
        ends = (inputs == eos).long()
        documents = ends.cumsum(1) - ends  # an EOS belongs to the document it ends
    return Batch(inputs, labels, documents)
