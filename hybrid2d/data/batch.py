"""One micro batch as the trainer takes it: inputs, labels and, for rows that hold several
documents, the document index of each position; and how many positions hold real tokens.

A plain (inputs, labels) pair is a batch whose rows are each one sequence, every position real:
what text windows without document masking, and callers written before packing, hand over.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Batch(NamedTuple):
    inputs: torch.Tensor  # [b, s] token ids
    labels: torch.Tensor  # [b, s] next-token targets, -100 where the loss does not count
    # [b, s] document index per position (attention within a document, RoPE positions
    # restarting at each); None: each row is one sequence
    documents: torch.Tensor | None = None
    # [b] positions of each row holding tokens rather than padding (tokens/s counts these);
    # None: all of them
    real_tokens: torch.Tensor | None = None

    @classmethod
    def of(cls, batch) -> Batch:
        """A Batch from a Batch or an (inputs, labels[, documents]) tuple."""
        return batch if isinstance(batch, Batch) else cls(*batch)

    @property
    def tokens(self) -> int:
        """Real (non-padding) positions of the batch."""
        return self.inputs.numel() if self.real_tokens is None else int(self.real_tokens.sum())

    def document_lengths(self) -> list[int]:
        """Lengths of every row's real documents, in order (attention stays inside each; the
        padding after a row's real tokens is none): a row without documents is one of its real
        tokens."""
        n, s = self.inputs.shape
        real = [s] * n if self.real_tokens is None else self.real_tokens.tolist()
        if self.documents is None:
            return [r for r in real if r]
        out = []
        for row, r in zip(self.documents, real, strict=True):
            if r:
                out += torch.unique_consecutive(row[:r], return_counts=True)[1].tolist()
        return out

    def to(self, device: torch.device) -> Batch:
        """inputs, labels and documents on `device` (the counts stay where they are)."""
        docs = None if self.documents is None else self.documents.to(device)
        return self._replace(
            inputs=self.inputs.to(device), labels=self.labels.to(device), documents=docs
        )

    def rows(self, lo: int, hi: int) -> Batch:
        """Rows [lo, hi), as contiguous copies."""
        return Batch(*(None if t is None else t[lo:hi].contiguous() for t in self))

    def micro_batches(self, size: int) -> list[Batch]:
        """The rows in consecutive micro batches of `size` (a loader's step for one rank)."""
        return [self.rows(i, i + size) for i in range(0, len(self.inputs), size)]
