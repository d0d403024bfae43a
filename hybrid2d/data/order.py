"""The order in which an epoch's text windows are trained on, shared by every way of reading them.

An epoch of N windows is cut into consecutive blocks of `block` windows (the last one holds the
N mod block rest) and each block is permuted on its own: position q of the epoch is window
b*block + perm_{e,b}[q - b*block] with b = q // block, where perm_{e,b} = torch.randperm(size_b)
drawn from a generator seeded with seed + e + b * 2**32. Why blocks: a stream that tokenizes the
corpus as it trains can hold one block of windows, not the corpus, so a permutation of all N
windows (which would need every window, and N, before the first step) is out of its reach, while
a block's is not. The inline and preprocessed paths draw the same blocks, so the three serve the
same windows at every position. Block 0's seed is seed + e, so a corpus of at most `block`
windows keeps the whole-epoch permutation GlobalBatchLoader drew before blocks existed; block 0
(the setting's 0) means the whole epoch as one block.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK_SEED_STRIDE = 2**32  # block b's seed is seed + epoch + b * 2**32: apart from every epoch's


def block_permutation(seed: int, epoch: int, block: int, size: int) -> np.ndarray:
    """The order of block `block` of epoch `epoch`, `size` windows long: indices into it."""
    g = torch.Generator().manual_seed(seed + epoch + block * BLOCK_SEED_STRIDE)
    return torch.randperm(size, generator=g).numpy()


def effective_block(block: int, windows: int) -> int:
    """Windows per block over an epoch of `windows`: the setting, or the whole epoch when it is
    0 or at least the epoch (then the order is the whole-epoch permutation)."""
    return windows if block == 0 or block >= windows else block


class BlockOrder:
    """position -> sample index over epochs of `size` samples, permuted in blocks of `block`
    (0: the whole epoch). Keeps the few newest permutations (a step spans a few blocks)."""

    KEEP = 4

    def __init__(self, size: int, block: int, seed: int):
        self.size = size
        self.block = max(1, effective_block(block, size))
        self.seed = seed
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def _perm(self, epoch: int, b: int) -> np.ndarray:
        perm = self._perms.get((epoch, b))
        if perm is None:
            length = min(self.block, self.size - b * self.block)
            perm = block_permutation(self.seed, epoch, b, length)
            if len(self._perms) >= self.KEEP:
                self._perms.pop(min(self._perms))
            self._perms[(epoch, b)] = perm
        return perm

    def indices(self, start: int, count: int) -> np.ndarray:
        """Sample indices of global positions [start, start + count)."""
        pos = np.arange(start, start + count, dtype=np.int64)
        epochs, within = np.divmod(pos, self.size)
        blocks, offset = np.divmod(within, self.block)
        out = np.empty(count, dtype=np.int64)
        keys = np.unique(np.stack([epochs, blocks]), axis=1) if count else np.empty((2, 0))
        for e, b in keys.T.tolist():
            mask = (epochs == e) & (blocks == b)
            out[mask] = b * self.block + self._perm(int(e), int(b))[offset[mask]]
        return out
