"""A resumable loader that hands each data-parallel rank its share of one global batch.

The order of samples depends only on (seed, epoch), and the loader's state is the number of
samples consumed globally. A step's global batch is therefore the same whatever the dp size,
which is what lets a run resume on a different mesh and still see exactly the data a straight
run would have, and what lets tests compare the union of the ranks' slices with a
single-process reference.
"""

from __future__ import annotations

import numpy as np
import torch

from hybrid2d.data.packing import PackedDataset
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout


class GlobalBatchLoader:
    """Global step s covers global sample positions [consumed, consumed + global_batch).

    Position p belongs to epoch p // N (N = len(dataset)) and maps to sample perm_e[p % N], where
    perm_e = torch.randperm(N) drawn from a generator seeded with seed + epoch. Rank r of dp_size
    takes the contiguous slice [r*B/dp, (r+1)*B/dp) of the step's positions and splits it into
    micro batches of the layout's micro batch size.
    """

    def __init__(self, dataset: PackedDataset, layout: RunLayout, dp_rank: int, seed: int = 0):
        if not 0 <= dp_rank < layout.dp:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, dp={layout.dp})")
        self.dataset = dataset
        self.global_batch = layout.global_batch
        self.dp_rank = dp_rank
        self.dp_size = layout.dp
        self.local_batch = layout.local_batch
        self.micro_batch = layout.micro_batch
        self.seed = seed
        self.samples_consumed = 0
        self._perms: dict[int, np.ndarray] = {}

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from."""
        return self.samples_consumed // len(self.dataset)

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            g = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(len(self.dataset), generator=g).numpy()
            # A step spans at most a few epochs; keep only the newest two permutations.
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = perm
        return perm

    def sample_indices(self, start: int, count: int) -> np.ndarray:
        """Dataset indices of global positions [start, start + count)."""
        n = len(self.dataset)
        pos = np.arange(start, start + count, dtype=np.int64)
        epochs, within = np.divmod(pos, n)
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._perm(int(e))[within[mask]]
        return out

    def global_batch_at(self, consumed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of all global_batch samples of the step starting at `consumed`."""
        return self.dataset.gather(self.sample_indices(consumed, self.global_batch))

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro batches [(inputs, labels), ...] for the next step; advances state."""
        start = self.samples_consumed + self.dp_rank * self.local_batch
        inputs, labels = self.dataset.gather(self.sample_indices(start, self.local_batch))
        self.samples_consumed += self.global_batch
        mb = self.micro_batch
        return [
            (inputs[i : i + mb].contiguous(), labels[i : i + mb].contiguous())
            for i in range(0, self.local_batch, mb)
        ]

    def state_dict(self) -> dict:
        return {"samples_consumed": self.samples_consumed, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue after state["samples_consumed"] global samples, on any dp size."""
        if int(state["seed"]) != self.seed:
            raise ConfigError(
                f"train.seed={self.seed} differs from the checkpoint's data seed "
                f"{state['seed']}; resume with --train.seed {state['seed']} to keep "
                "the data order"
            )
        self.samples_consumed = int(state["samples_consumed"])
