"""A resumable loader that hands each data-parallel rank its share of one global batch.

The order of samples depends only on (seed, epoch) and, for text windows, data.shuffle_block
(order.py: each epoch permuted in blocks, the order streaming can serve too); the loader's state
is the number of samples consumed globally. A step's global batch is therefore the same whatever
the dp size, which is what lets a run resume on a different mesh and still see exactly the
data a straight run would have, and what lets tests compare the union of the ranks' slices
with a single-process reference.

A step is global_batch rows. Unpacked, a row is one sample (a text window, or an instruction
sample padded); packed (instruction data, data.packing packed), the rows hold as many samples
from the stream as first-fit decreasing places in them (rows.py), so a step consumes a varying
number of samples, but which ones depends only on the position and never on the mesh.
"""

from __future__ import annotations

import numpy as np

from hybrid2d.data.batch import Batch
from hybrid2d.data.order import BlockOrder, effective_block
from hybrid2d.data.rows import fill_rows
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout


class GlobalBatchLoader:
    """Global step s covers global sample positions [consumed, consumed + k) (k = global_batch
    unpacked, the samples packed into global_batch rows packed).

    Position p belongs to epoch p // N (N = len(dataset)) and maps to the sample order.py's
    BlockOrder gives it: epoch e permuted in blocks of `shuffle_block` samples (0, what
    instruction data takes: the whole epoch by torch.randperm(N) seeded with seed + e). Rank r
    of dp_size takes the contiguous rows [r*B/dp, (r+1)*B/dp) of the step and splits them into micro
    batches of the layout's micro batch size.
    """

    def __init__(
        self, dataset, layout: RunLayout, dp_rank: int, seed: int = 0, packed: bool = False,
        shuffle_block: int = 0,
    ):  # fmt: skip
        if not 0 <= dp_rank < layout.dp:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, dp={layout.dp})")
        self.dataset = dataset
        self.global_batch = layout.global_batch
        self.dp_rank = dp_rank
        self.dp_size = layout.dp
        self.local_batch = layout.local_batch
        self.micro_batch = layout.micro_batch
        self.seed = seed
        self.packed = packed  # the dataset has sizes() and pack() (instruction samples)
        self.samples_consumed = 0
        self.served = PackingCounts()  # the global rows of this launch's steps
        self.shuffle_block = shuffle_block
        self.order = BlockOrder(len(dataset), shuffle_block, seed)

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from."""
        return self.samples_consumed // len(self.dataset)

    def sample_indices(self, start: int, count: int) -> np.ndarray:
        """Dataset indices of global positions [start, start + count)."""
        return self.order.indices(start, count)

    def step_rows(self, consumed: int) -> tuple[list[np.ndarray], int]:
        """Packed: the dataset indices of each of the step's global_batch rows, and how many
        samples of the stream from `consumed` on they hold."""
        capacity = self.dataset.seq_len
        need = self.global_batch * capacity
        chunk = 4 * self.global_batch
        indices = self.sample_indices(consumed, chunk)
        sizes = self.dataset.sizes(indices)
        while sizes.sum() <= need:  # enough of the stream to fill every row
            more = self.sample_indices(consumed + len(indices), chunk)
            indices = np.concatenate([indices, more])
            sizes = np.concatenate([sizes, self.dataset.sizes(more)])
        k, rows = fill_rows(sizes, capacity, self.global_batch)
        return [indices[r] for r in rows], k

    def global_batch_at(self, consumed: int) -> Batch:
        """All global_batch rows of the step starting at `consumed`."""
        if self.packed:
            return self.dataset.pack(self.step_rows(consumed)[0])
        return self.dataset.gather(self.sample_indices(consumed, self.global_batch))

    def next_batch(self) -> list[Batch]:
        """This rank's micro batches for the next step; advances state."""
        lo = self.dp_rank * self.local_batch
        if self.packed:
            rows, k = self.step_rows(self.samples_consumed)
            self.served.add(rows, self.dataset)
            batch = self.dataset.pack(rows[lo : lo + self.local_batch])
        else:
            k = self.global_batch
            start = self.samples_consumed + lo
            batch = self.dataset.gather(self.sample_indices(start, self.local_batch))
        self.samples_consumed += k
        return batch.micro_batches(self.micro_batch)

    def state_dict(self) -> dict:
        return {
            "samples_consumed": self.samples_consumed,
            "seed": self.seed,
            "shuffle_block": self.shuffle_block,
        }

    # A checkpoint written before data.shuffle_block existed lacks the key (the Checkpointer
    # then loads the state without it); its order was the whole-epoch permutation.
    optional_state_keys = ("shuffle_block",)

    def load_state_dict(self, state: dict) -> None:
        """Continue after state["samples_consumed"] global samples, on any dp size."""
        check_data_seed(self.seed, state)
        check_shuffle_block(self.shuffle_block, state, len(self.dataset))
        self.samples_consumed = int(state["samples_consumed"])


def check_data_seed(seed: int, state: dict) -> None:
    """A loader's checkpointed state was drawn with train.seed: another seed would continue
    with another order, so a resume with one is refused in one line."""
    if int(state["seed"]) != seed:
        raise ConfigError(
            f"train.seed={seed} differs from the checkpoint's data seed {state['seed']}; "
            f"resume with --train.seed {state['seed']} to keep the data order"
        )


def check_shuffle_block(block: int, state: dict, windows: int | None) -> None:
    """A loader's checkpointed order was drawn in blocks of the saved data.shuffle_block (absent:
    a checkpoint from before the setting, whose order was the whole epoch's, as block 0). A
    resume whose blocks differ over an epoch of `windows` (None: a stream, which does not know
    its epoch, so any other value differs) would continue in another order: refused in one line."""
    saved = int(state.get("shuffle_block", 0))
    if windows is None and saved == block:
        return
    if windows is not None and effective_block(saved, windows) == effective_block(block, windows):
        return
    was = (
        f"{saved}" if "shuffle_block" in state
        else "0 (it predates the setting: its order is the whole epoch's permutation)"
    )  # fmt: skip
    over = f" over {windows} windows an epoch" if windows is not None else ""
    raise ConfigError(
        f"data.shuffle_block={block} differs from the checkpoint's data.shuffle_block={was}"
        f"{over}; resume with --data.shuffle_block {saved} to keep the data order"
    )


class PackingCounts:
    """Rows, samples and the positions they fill, summed over packed steps (the same on every
    rank: each computes the global rows)."""

    def __init__(self):
        self.rows = self.samples = self.positions = 0
        self.capacity = 0  # positions per row

    def add(self, rows: list[np.ndarray], dataset) -> None:
        self.rows += len(rows)
        self.samples += sum(len(r) for r in rows)
        self.positions += int(sum(dataset.sizes(r).sum() for r in rows if len(r)))
        self.capacity = dataset.seq_len

    def to_dict(self) -> dict:
        """samples per row, padding fraction and packing efficiency (the fraction of positions
        holding tokens) of the rows counted."""
        total = max(self.rows * self.capacity, 1)
        return {
            "rows": self.rows,
            "samples": self.samples,
            "samples_per_row": round(self.samples / max(self.rows, 1), 4),
            "padding_fraction": round(1 - self.positions / total, 4),
            "packing_efficiency": round(self.positions / total, 4),
        }
