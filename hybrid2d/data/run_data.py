"""What the data package hands the trainer: the loader, the tokenizer, the held-out set and the
figures that describe them (RunData), and the held-out set's fixed split over any mesh
(EvalSet). build.py builds them; this module holds no building, so the trainer and the run's
summary read one small surface.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from hybrid2d.data.batch import Batch
from hybrid2d.data.instruct import IGNORE_INDEX, InstructStats
from hybrid2d.data.loader import GlobalBatchLoader, PackingCounts
from hybrid2d.data.mixture import MixtureLoader
from hybrid2d.data.rows import first_fit_decreasing
from hybrid2d.data.stream import StreamingLoader, WindowStream

PREVIEW_STEPS = 16  # packed steps the data line's packing figures are measured on


class Subset:
    """Samples `indices` of a dataset, with the dataset's gather() (and sizes() and pack() where
    it has them)."""

    def __init__(self, dataset, indices: np.ndarray):
        self.dataset = dataset
        self.indices = np.asarray(indices, dtype=np.int64)
        self.seq_len = dataset.seq_len

    def __len__(self) -> int:
        return len(self.indices)

    def gather(self, indices) -> Batch:
        return self.dataset.gather(self.indices[np.asarray(indices, dtype=np.int64)])

    def sizes(self, indices) -> np.ndarray:
        return self.dataset.sizes(self.indices[np.asarray(indices, dtype=np.int64)])

    def pack(self, rows: list[np.ndarray]) -> Batch:
        return self.dataset.pack([self.indices[r] for r in rows])


class PackedRows:
    """A held-out set's samples packed once by first-fit decreasing; row i is gather([i])'s.
    The rows depend on the samples and seq_len alone, so every mesh evaluates the same rows."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.rows = first_fit_decreasing(dataset.sizes(np.arange(len(dataset))), dataset.seq_len)
        self.counts = PackingCounts()
        self.counts.add(self.rows, dataset)

    def __len__(self) -> int:
        return len(self.rows)

    def gather(self, indices) -> Batch:
        return self.dataset.pack([self.rows[i] for i in np.asarray(indices, dtype=np.int64)])


@dataclass(eq=False)
class EvalSet:
    """A fixed held-out set, split the same way on every mesh: the rows (samples, or packed rows
    of them) padded with rows whose labels are all -100 to a multiple of dp x micro batch, rank
    r takes the r-th contiguous part. The loss is summed over loss tokens and divided by their
    total."""

    dataset: object
    source: str

    def __len__(self) -> int:
        return len(self.dataset)

    def batches(self, dp_rank: int, dp_size: int, micro_batch: int):
        n = len(self.dataset)
        per_rank = math.ceil(n / (dp_size * micro_batch)) * micro_batch
        for start in range(dp_rank * per_rank, (dp_rank + 1) * per_rank, micro_batch):
            real = np.arange(start, min(start + micro_batch, n))  # empty past the end
            batch = Batch.of(self.dataset.gather(real if len(real) else np.array([0])))
            pad = micro_batch - len(real)
            if pad:
                batch = _with_empty_rows(batch.rows(0, len(real)), batch.rows(0, 1), pad)
            yield batch


def _with_empty_rows(batch: Batch, like: Batch, count: int) -> Batch:
    """`batch` and `count` copies of the row `like` with no loss token and no real token."""
    fill = like._replace(
        labels=torch.full_like(like.labels, IGNORE_INDEX),
        real_tokens=torch.zeros(1, dtype=torch.long),
    )
    fields = []
    for got, extra in zip(batch, fill, strict=True):
        if got is None and extra is None:
            fields.append(None)
        elif got is None:  # real_tokens None: every position of `batch` is real
            fields.append(torch.cat([torch.full((len(batch.inputs),), batch.inputs.shape[1]),
                                     extra.expand(count)]))  # fmt: skip
        else:
            fields.append(torch.cat([got, extra.expand(count, *extra.shape[1:])]))
    return Batch(*fields)


@dataclass
class RunData:
    loader: GlobalBatchLoader
    tokenizer: Tokenizer
    val: EvalSet | None
    kind: str  # "text" | "instruct"
    stats: dict  # what the data summary says (instruction data: samples, truncated, ...)
    layout: str = "windows"  # "windows" (text) | "packed" | "padded" (instruction data)
    preview: dict | None = None  # packed: the figures of the first PREVIEW_STEPS steps' rows
    # The directory of the tokenizer's files (chat template, tokenizer_config.json), which
    # checkpoints keep: data.tokenizer's, or that of the BPE trained for instruction data.
    tokenizer_dir: str = ""

    def describe(self) -> str:
        if isinstance(self.loader, StreamingLoader):
            parts = [f"data: text from {self.loader.cfg.path or 'the built-in corpus'!r}, "
                     f"streamed: a reader thread on each of {self.loader.readers} ranks "
                     "tokenizes its share of the documents; windows shuffled in blocks of "
                     f"{self.loader.block:,}, as inline"]  # fmt: skip
        elif isinstance(self.loader, MixtureLoader):
            mix = ", ".join(
                f"{s.name} {w:.0%} "
                + ("(streamed)" if isinstance(ds, WindowStream) else f"({len(ds)} samples)")
                for s, w, ds in zip(self.loader.sources, self.loader.weights,
                                    self.loader.datasets, strict=True)
            )  # fmt: skip
            parts = [f"data: text, a mixture of {mix}, each sample drawn by weight"]
            if self.loader.streams:
                first = next(iter(self.loader.streams.values()))
                parts.append(
                    f"streamed sources: a reader thread per source on each of {first.readers}"
                    f" ranks; windows shuffled in blocks of {first.block:,}, as inline"
                )
        else:
            parts = [f"data: {self.kind}, {len(self.loader.dataset)} training samples"]
        if self.kind == "instruct":
            stats = InstructStats(**self.stats["train_stats"])
            parts.append(stats.describe(padded=self.layout == "padded"))
        if self.preview is not None:
            p = self.preview
            parts.append(
                f"packed by first-fit decreasing into rows of train.seq_len: "
                f"{p['samples_per_row']:.2f} samples per row, padding {p['padding_fraction']:.0%}"
                f", packing efficiency {p['packing_efficiency']:.0%} (first {PREVIEW_STEPS} "
                "steps; data.packing padded: one sample per row)"
            )
        if self.stats.get("document_mask") == "on":
            parts.append("document mask on: attention and positions within each document")
        if self.val is not None:
            rows = self.val.dataset
            packed = f" in {len(rows)} packed rows" if isinstance(rows, PackedRows) else ""
            parts.append(f"validation: {self.stats.get('val_samples', len(self.val))} samples"
                         f"{packed} from {self.val.source}")  # fmt: skip
        return "; ".join(parts)

    def summary(self) -> dict:
        """summary.json's `data`: the figures of the data, and of the rows this launch trained
        on (packed: rows, samples per row, padding fraction, packing efficiency)."""
        out = {"kind": self.kind, "layout": self.layout}
        out |= {k: v for k, v in self.stats.items() if k not in ("train_stats", "val_samples")}
        if self.layout == "packed":
            out["packing"] = self.loader.served.to_dict()
        if isinstance(self.loader, MixtureLoader):  # per source, over every launch of the run
            out["mixture"] = self.loader.summary()
        if self._streamed():  # this launch's steps
            out["data_wait_s_total"] = round(self.loader.data_wait_total_s, 4)
        return out

    def close(self) -> None:
        """Stop what reads in the background (streaming's reader threads)."""
        if isinstance(self.loader, (StreamingLoader, MixtureLoader)):
            self.loader.close()

    def _streamed(self) -> bool:
        """Whether a stream feeds the loader (data.path streamed, or a mixture's sources)."""
        loader = self.loader
        return isinstance(loader, StreamingLoader) or bool(getattr(loader, "streams", None))

    def scalars(self) -> dict[str, float]:
        """TensorBoard's data figures after a step: tokens seen per mixture source; streaming,
        the step's data wait (seconds the longest-waiting rank waited for its reader; a
        mixture's streamed sources summed)."""
        out = {"perf/data_wait_s": self.loader.data_wait_s} if self._streamed() else {}
        if isinstance(self.loader, MixtureLoader):
            out |= {f"data/tokens_{n}": float(v) for n, v in self.loader.tokens_seen().items()}
        return out
