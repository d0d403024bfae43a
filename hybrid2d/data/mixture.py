"""Several text sources trained on together, each global sample drawn from one by weight.

data.mixture reads `name=path:weight,...` (`web=/data/web-tok:0.7,code=/data/code-tok:0.3`);
each path is what data.path takes for text (a preprocessed shard directory, or files tokenized
inline). Global sample position p comes from source src(p), drawn with the source's weight from
a generator seeded by (train.seed, p // BLOCK): the choice of every position is fixed by the
seed alone, whatever the mesh. Within a source the samples follow that source's own epoch
order (GlobalBatchLoader's: permuted in blocks of data.shuffle_block, seeded per source), and
the k-th sample a source gives is its k-th in that order. The loader's state is the global
position plus each source's count of samples taken, so a resume, on any dp size, continues
with the samples a straight run sees.

A source may be streamed (data.streaming: a stream.WindowStream, tokenized on the fly and read
by every rank) beside sources read by index (shards, or tokenized inline). A stream cannot be
read at a position, only on: every rank takes each streamed source's windows of the step, all
of them and in source order (the counts come from the draw, the same on every rank, so every
rank issues the same all-gathers), keeps its own rows, and the state adds each stream's place.
The draw and each source's order are the same either way, so a streamed mixture serves
exactly the inline mixture's samples.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from hybrid2d.data.batch import Batch
from hybrid2d.data.loader import GlobalBatchLoader, check_data_seed, check_shuffle_block
from hybrid2d.data.packing import windows_batch
from hybrid2d.data.stream import WindowStream
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout

BLOCK = 4096  # positions whose sources one generator draws
SPELLING = "name=path:weight,... (e.g. web=/data/web-tok:0.7,code=/data/code-tok:0.3)"


@dataclass(frozen=True)
class Source:
    name: str
    path: str
    weight: float


def parse_mixture(value: str) -> list[Source]:
    """data.mixture's sources; each malformed part is one ConfigError line naming it."""
    sources: list[Source] = []
    for part in value.split(","):
        name, eq, rest = part.strip().partition("=")
        path, colon, weight_text = rest.rpartition(":")
        if not (eq and colon and name.strip() and path.strip()):
            raise ConfigError(
                f"data.mixture={value!r}: {part.strip()!r} is not name=path:weight; "
                f"write {SPELLING}"
            )
        try:
            weight = float(weight_text)
        except ValueError:
            weight = float("nan")
        if not weight > 0 or not np.isfinite(weight):
            raise ConfigError(
                f"data.mixture={value!r}: source {name.strip()!r} has weight {weight_text!r}; "
                "a weight must be a positive number (weights are normalized to sum to 1)"
            )
        sources.append(Source(name.strip(), path.strip(), weight))
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"data.mixture={value!r} names a source twice; give each its own name")
    return sources


def source_seed(seed: int, index: int) -> int:
    """The seed of the order of source `index`: apart from data.path's and the others'."""
    return seed + 7919 * (index + 1)


class _IndexedSource:
    """A source read at any position: a dataset in its own block order."""

    def __init__(self, dataset, layout: RunLayout, seed: int, block: int):
        self.dataset = dataset
        self.order = GlobalBatchLoader(dataset, layout, 0, seed=seed, shuffle_block=block)

    def rows(self, first: int, count: int, lo: int, n: int) -> Batch | None:
        """Rows [lo, lo + n) of the source's samples [first, first + count) (None: none)."""
        if not n:
            return None
        return self.dataset.gather(self.order.sample_indices(first + lo, n))


class _StreamedSource:
    """A source read only on: every rank takes all of a step's windows of it, in order."""

    def __init__(self, stream: WindowStream, eos: int | None):
        self.stream = stream
        self.eos = eos
        self.next = 0  # the source's sample the stream serves next

    def rows(self, first: int, count: int, lo: int, n: int) -> Batch | None:
        if first != self.next:  # global_batch_at, or a step skipped: a stream cannot seek
            raise RuntimeError(f"a streamed source is at sample {self.next}, not {first}")
        windows = self.stream.take(count)
        self.next += count
        if not n:
            return None
        mine = torch.from_numpy(np.stack(windows[lo : lo + n]).astype(np.int64))
        return windows_batch(mine, self.eos)


def _block_seed(seed: int, block: int) -> int:
    digest = hashlib.blake2b(f"mixture/{seed}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes a non-negative int64


class MixtureLoader:
    """GlobalBatchLoader's interface over several text datasets of one seq_len: step s covers
    global positions [consumed, consumed + global_batch); rank r takes rows
    [r*B/dp, (r+1)*B/dp) of it, each row the next unseen sample of the source drawn for it.
    A dataset may be a WindowStream (seeded with source_seed; `eos` its document masks')."""

    def __init__(
        self, sources: list[Source], datasets: list, layout: RunLayout, dp_rank: int, seed: int = 0,
        shuffle_block: int = 0, eos: int | None = None,
    ):  # fmt: skip
        if not 0 <= dp_rank < layout.dp:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, dp={layout.dp})")
        self.sources = sources
        self.names = [s.name for s in sources]
        weights = np.array([s.weight for s in sources], dtype=np.float64)
        self.weights = weights / weights.sum()
        self._cum = np.cumsum(self.weights)
        self.datasets = datasets
        self.seq_len = datasets[0].seq_len
        # Each source's order: its own epochs permuted in blocks, seeded apart from the others'.
        self.shuffle_block = block = shuffle_block
        self._reads = [  # how each source is read: by index, or on (a stream)
            _StreamedSource(ds, eos) if isinstance(ds, WindowStream)
            else _IndexedSource(ds, layout, source_seed(seed, i), block)
            for i, ds in enumerate(datasets)
        ]  # fmt: skip
        pairs = zip(self.names, datasets, strict=True)
        self.streams = {n: ds for n, ds in pairs if isinstance(ds, WindowStream)}
        for i, (name, ds) in enumerate(zip(self.names, datasets, strict=True)):
            if name in self.streams and ds.seed != source_seed(seed, i):
                raise ValueError(f"source {name!r}'s stream is not seeded with source_seed")
        self.global_batch = layout.global_batch
        self.dp_rank = dp_rank
        self.local_batch = layout.local_batch
        self.micro_batch = layout.micro_batch
        self.seed = seed
        self.samples_consumed = 0
        self.taken = np.zeros(len(sources), dtype=np.int64)  # samples of each source so far
        self._blocks: dict[int, np.ndarray] = {}
        self.data_wait_s = 0.0  # streamed sources: the step's waits for readers, summed
        self.data_wait_total_s = 0.0

    def choices(self, start: int, count: int) -> np.ndarray:
        """The source index of each global position in [start, start + count)."""
        out = np.empty(count, dtype=np.int64)
        pos = start
        while pos < start + count:
            block, within = divmod(pos, BLOCK)
            drawn = self._blocks.get(block)
            if drawn is None:
                g = torch.Generator().manual_seed(_block_seed(self.seed, block))
                u = torch.rand(BLOCK, generator=g, dtype=torch.float64).numpy()
                drawn = np.minimum(np.searchsorted(self._cum, u, side="right"), len(self._cum) - 1)
                self._blocks = {b: d for b, d in self._blocks.items() if b >= block - 1}
                self._blocks[block] = drawn
            n = min(BLOCK - within, start + count - pos)
            out[pos - start : pos - start + n] = drawn[within : within + n]
            pos += n
        return out

    def _rows(self, consumed: int, taken: np.ndarray, lo: int, count: int) -> Batch:
        """Rows [lo, lo + count) of the step at `consumed`, whose sources stood at `taken`."""
        src = self.choices(consumed, self.global_batch)
        parts, order = [], np.empty(count, dtype=np.int64)
        done = 0
        for s, reader in enumerate(self._reads):
            mine = np.flatnonzero(src == s)  # the step's rows from source s, in order
            before = int(np.searchsorted(mine, lo))  # of them, rows before this rank's
            rows = mine[(mine >= lo) & (mine < lo + count)]
            part = reader.rows(int(taken[s]), len(mine), before, len(rows))
            if part is None:
                continue
            parts.append(part)
            order[rows - lo] = np.arange(done, done + len(rows))
            done += len(rows)
        fields = []
        for got in zip(*parts, strict=True):
            fields.append(None if got[0] is None else torch.cat(got)[torch.from_numpy(order)])
        return Batch(*fields)

    def global_batch_at(self, consumed: int) -> Batch:
        """All rows of the step at `consumed` (counted from the start: for tests)."""
        taken = np.bincount(self.choices(0, consumed), minlength=len(self.datasets))
        return self._rows(consumed, taken, 0, self.global_batch)

    def next_batch(self) -> list[Batch]:
        """This rank's micro batches for the next step; advances state."""
        lo = self.dp_rank * self.local_batch
        batch = self._rows(self.samples_consumed, self.taken, lo, self.local_batch)
        self.data_wait_s = sum(stream.wait_s for stream in self.streams.values())
        self.data_wait_total_s += self.data_wait_s
        step = self.choices(self.samples_consumed, self.global_batch)
        self.taken = self.taken + np.bincount(step, minlength=len(self.datasets))
        self.samples_consumed += self.global_batch
        return batch.micro_batches(self.micro_batch)

    def tokens_seen(self) -> dict[str, int]:
        """Label tokens each source gave so far (global, every launch of the run)."""
        return {n: int(k) * self.seq_len for n, k in zip(self.names, self.taken, strict=True)}

    def summary(self) -> dict:
        total = max(int(self.taken.sum()), 1)
        return {
            n: {
                "weight": round(float(w), 6),
                "samples": int(k),
                "tokens": int(k) * self.seq_len,
                "fraction": round(int(k) / total, 6),
            }
            for n, w, k in zip(self.names, self.weights, self.taken, strict=True)
        }

    def state_dict(self) -> dict:
        state = {
            "samples_consumed": self.samples_consumed,
            "seed": self.seed,
            "shuffle_block": self.shuffle_block,
            "mixture": {n: int(k) for n, k in zip(self.names, self.taken, strict=True)},
        }
        if self.streams:  # where each streamed source's next window is
            state["streams"] = {n: stream.position() for n, stream in self.streams.items()}
        return state

    @property
    def optional_state_keys(self) -> tuple[str, ...]:
        """shuffle_block (older checkpoints lack it) and each stream's place (a checkpoint of
        the mixture read inline lacks it): load_state_dict says what is missing in one line."""
        places = ("epoch", "block", "served", "document", "skip")
        streamed = tuple(f"streams.{n}.{k}" for n in self.streams for k in places)
        return GlobalBatchLoader.optional_state_keys + streamed

    def load_state_dict(self, state: dict) -> None:
        """Continue after state["samples_consumed"] global samples, each source after its
        count (a streamed one at its saved place), on any dp size."""
        check_data_seed(self.seed, state)
        for ds in self.datasets:  # a stream does not know its epoch: None
            windows = None if isinstance(ds, WindowStream) else len(ds)
            check_shuffle_block(self.shuffle_block, state, windows)
        for name in self.streams:
            if len(state.get("streams", {}).get(name, {})) < 5:
                raise ConfigError(
                    f"data.mixture[{name}] is streamed, but the checkpoint holds no streamed "
                    "place of it (its mixture was read inline or from shards, which a stream "
                    "cannot seek to without reading it again); resume with --data.streaming "
                    "false, which continues with the same samples"
                )
        self.samples_consumed = int(state["samples_consumed"])
        self.taken = np.array([int(state["mixture"][n]) for n in self.names], dtype=np.int64)
        for i, (reader, name) in enumerate(zip(self._reads, self.names, strict=True)):
            if name in self.streams:
                self.streams[name].seek(state["streams"][name])
                reader.next = int(self.taken[i])

    def close(self) -> None:
        """Stop the streamed sources' reader threads."""
        for stream in self.streams.values():
            stream.close()
