"""Streaming: text that is not preprocessed, tokenized on the fly, each rank its part.

The stream is the inline path's flat stream (documents in corpus order, each BOS + ids + EOS,
tokens.encode_chunks) cut into the same windows (window i = tokens[i*L : i*L + L + 1]), served
in the inline path's order (order.py): each block of data.shuffle_block windows is read whole,
then permuted with the block's generator, so global position p is the same window inline,
preprocessed and streamed. At the corpus's end the epoch ends (the tail shorter than a window is
dropped, as inline; the last block is short) and the next starts again at window 0. While a
block is served, the next is read ahead in proportion to how much of this one is gone, so the
windows held stay about one block (shuffle_block x (seq_len + 1) tokens per rank), and only the
first step waits for a whole block to be tokenized.

Work is split by document over every rank of the job (dp x tp, the readers): in each round,
reader r of R tokenizes its group of documents in a background thread, and one all-gather over
the world hands every rank the round's R groups in order. Every rank then holds the step's
windows and keeps its dp rank's rows, so the stream depends on neither the dp size nor the
mesh, and the position saved (the block being served, where it starts in the corpus: document
and tokens of it behind, and how many of its windows are served) lets a resume on any mesh
read that block again and continue with exactly the windows a straight run takes.

WindowStream is one source's windows in that order (take the next n, its position, seek to a
saved one); StreamingLoader serves data.path's as global batches, and a streamed mixture
(mixture.py) drives one per text source.
"""

from __future__ import annotations

import collections
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from tokenizers import Tokenizer

from hybrid2d.config import DataConfig
from hybrid2d.data.batch import Batch
from hybrid2d.data.corpus import corpus_documents
from hybrid2d.data.loader import check_data_seed, check_shuffle_block
from hybrid2d.data.order import block_permutation
from hybrid2d.data.packing import windows_batch
from hybrid2d.data.tokens import encode_chunks
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout

ROUND_DOCS = 64  # documents each rank tokenizes per round (one all-gather)
AHEAD_ROUNDS = 8  # rounds a reader tokenizes ahead of the step that needs them
_END = "end"


class _Reader:
    """A thread that encodes this rank's groups of `per_round` documents (group g, counted from
    `start`, belongs to reader g % readers) into a bounded queue, a list of id arrays per
    group, then _END (or the exception reading raised)."""

    def __init__(
        self, cfg: DataConfig, tok: Tokenizer, start: int, reader: int, readers: int,
        per_round: int,
    ):  # fmt: skip
        self.per_round = per_round
        self.queue: queue.Queue = queue.Queue(maxsize=AHEAD_ROUNDS)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(cfg, tok, start, reader, readers), daemon=True,
            name=f"stream-reader-{reader}",
        )  # fmt: skip
        self.thread.start()

    def _mine(self, cfg: DataConfig, start: int, reader: int, readers: int, groups: list):
        for d, doc in enumerate(corpus_documents(cfg)):
            if self.stop.is_set():
                return
            group = (d - start) // self.per_round
            if d >= start and group % readers == reader:
                groups.append(group)
                yield doc

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, cfg, tok, start, reader, readers) -> None:
        groups: list[int] = []  # the group of each document read, in order
        current, docs = None, []
        try:
            for ids, lengths in encode_chunks(self._mine(cfg, start, reader, readers, groups), tok):
                for doc_ids in np.split(ids, np.cumsum(lengths)[:-1]):
                    group = groups.pop(0)
                    if group != current and docs:
                        if not self._put(docs):
                            return
                        docs = []
                    current = group
                    docs.append(doc_ids)
            if (not docs or self._put(docs)) and self._put(_END):
                return
        except Exception as e:  # handed to the training thread, which raises it
            self._put(e)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


@dataclass
class _Block:
    """Windows [index*B, index*B + B) of an epoch of the stream, the first starting `skip`
    tokens into document `doc`; once read whole, in the order they are served."""

    epoch: int
    index: int
    doc: int
    skip: int
    windows: list = field(default_factory=list)
    last: bool = False  # the corpus ended in it: the epoch's last block (short, or empty)


class WindowStream:
    """One text source's windows in order.py's block order, read by every rank: `take(n)`
    gives the next n windows of the source (the same on every rank, after the same rounds of
    `all_gather`, so every rank must ask for the same counts in the same order). This rank is
    reader `reader` of `readers`; `setting` names the source in errors."""

    def __init__(
        self, cfg: DataConfig, tok: Tokenizer, seq_len: int, seed: int,
        all_gather: Callable[[object], list], reader: int, readers: int,
        setting: str = "data.path",
    ):  # fmt: skip
        if cfg.shuffle_block < 1:
            raise ValueError("streaming needs data.shuffle_block >= 1 (config.py refuses 0)")
        self.cfg = cfg
        self.tok = Tokenizer.from_str(tok.to_str())  # the reader's own: encoding toggles it
        self.seq_len = seq_len
        self.block = cfg.shuffle_block
        self.seed = seed
        self.reader, self.readers = reader, readers
        self.all_gather = all_gather
        self.setting = setting
        self.round_docs = ROUND_DOCS  # the stream does not depend on it (tests make it small)
        self.wait_s = 0.0  # the last take's longest wait for a reader, over the readers
        self._start = _Block(0, 0, 0, 0)  # the block to serve first, and `_served` of it
        self._current: _Block | None = None  # read whole and permuted: being served
        self._served = 0  # windows of _current served
        self._next: _Block | None = None  # being read ahead
        self.doc = 0  # the reader's head: the document its next window starts in ...
        self.skip = 0  # ... after this many of its tokens
        self._reader: _Reader | None = None
        self._docs: collections.deque = collections.deque()  # ids of self.doc on
        self._buffered = 0  # tokens in self._docs
        self._exhausted = False
        self._step_wait = 0.0  # this rank's seconds waiting for its reader in this take

    def _restart(self, doc: int, skip: int) -> None:
        """The reader from window `skip` tokens into document `doc` on."""
        if self._reader is not None:
            self._reader.close()
        self.doc, self.skip = doc, skip
        self._reader = _Reader(self.cfg, self.tok, doc, self.reader, self.readers, self.round_docs)
        self._docs.clear()
        self._buffered = 0
        self._exhausted = False

    def _round(self, waits: list[float]) -> None:
        """A group of documents from every rank, appended in order; `waits` becomes every
        rank's wait for its reader in this take so far. A reading error on any rank is raised
        on all."""
        t0 = time.perf_counter()
        item = self._reader.queue.get()
        self._step_wait += time.perf_counter() - t0
        got = self.all_gather((item, self._step_wait))
        for item, _ in got:
            if isinstance(item, Exception):
                raise item
        for item, _ in got:
            if isinstance(item, str):
                self._exhausted = True
            else:
                self._docs.extend(item)
                self._buffered += sum(len(ids) for ids in item)
        waits[:] = [w for _, w in got]

    def _available(self) -> int:
        return self._buffered - self.skip

    def _windows(self, count: int, waits: list[float]) -> list[np.ndarray]:
        """The reader's next `count` windows (each its own copy, so a served one is freed),
        fewer at the corpus's end."""
        L = self.seq_len
        while self._available() < count * L + 1 and not self._exhausted:
            self._round(waits)
        n = min(count, max(0, (self._available() - 1) // L))
        if n == 0:
            return []
        flat = np.concatenate(self._docs)[self.skip : self.skip + n * L + 1]
        self.skip += n * L
        while self._docs and self.skip >= len(self._docs[0]):
            self.skip -= len(self._docs[0])
            self._buffered -= len(self._docs.popleft())
            self.doc += 1
        return [flat[i * L : i * L + L + 1].copy() for i in range(n)]

    def _fill(self, blk: _Block, want: int, waits: list[float]) -> None:
        """Read `blk` (the block at the reader's head) up to `want` windows, or its end."""
        missing = want - len(blk.windows)
        if missing > 0 and not blk.last:
            got = self._windows(missing, waits)
            blk.windows += got
            blk.last = len(got) < missing

    def _following(self, blk: _Block) -> _Block:
        """The block after `blk`, which is read whole: the next of its epoch, where the reader
        stands, or after the epoch's last the next epoch's first (the reader starts over)."""
        if blk.last:
            self._restart(0, 0)
            return _Block(blk.epoch + 1, 0, 0, 0)
        return _Block(blk.epoch, blk.index + 1, self.doc, self.skip)

    def _ready(self, blk: _Block, waits: list[float]) -> _Block:
        """`blk` read whole and permuted, the order.py block the other paths serve; an empty
        block (the epoch ended at a block's edge) gives the next epoch's first instead."""
        self._fill(blk, self.block, waits)
        if not blk.windows:
            if blk.index == 0:
                raise ConfigError(
                    f"{self.setting}={self.cfg.path!r} holds fewer than train.seq_len+1="
                    f"{self.seq_len + 1} tokens; use more text or a smaller train.seq_len"
                )
            return self._ready(self._following(blk), waits)
        perm = block_permutation(self.seed, blk.epoch, blk.index, len(blk.windows))
        blk.windows = [blk.windows[i] for i in perm]
        return blk

    def take(self, count: int) -> list[np.ndarray]:
        """The source's next `count` windows (seq_len + 1 ids each), across blocks and epochs;
        then the next block is read ahead in proportion to the current one served."""
        self._step_wait = 0.0
        waits = [0.0]
        if self._current is None:  # the first take, or the first after a resume
            s = self._start
            self._restart(s.doc, s.skip)
            self._current = self._ready(_Block(s.epoch, s.index, s.doc, s.skip), waits)
            self._next = self._following(self._current)
        rows: list[np.ndarray] = []
        while len(rows) < count:
            cur = self._current
            if self._served == len(cur.windows):
                cur = self._current = self._ready(self._next, waits)
                self._next = self._following(cur)
                self._served = 0
            n = min(count - len(rows), len(cur.windows) - self._served)
            rows += cur.windows[self._served : self._served + n]
            cur.windows[self._served : self._served + n] = [None] * n  # served: freed
            self._served += n
        # Read the next block ahead in proportion to this one served: one block held in all.
        ahead = math.ceil(self._served * self.block / len(self._current.windows))
        self._fill(self._next, ahead, waits)
        # The last round carried every reader's wait in this take: the take's longest.
        self.wait_s = max(waits)
        return rows

    def position(self) -> dict:
        """The block being served (where it starts in the corpus) and the windows of it
        served; a block served to its end is saved as the next, none of it served."""
        blk, served = self._start, self._served
        if self._current is not None:
            blk = self._current
            if served == len(blk.windows):
                blk, served = self._next, 0
        return {"epoch": blk.epoch, "block": blk.index, "served": served, "document": blk.doc,
                "skip": blk.skip}  # fmt: skip

    def seek(self, position: dict) -> None:
        """Continue at a saved position: the next take reads the block again from its first
        document and serves it from the saved window on."""
        s = position
        self._start = _Block(int(s["epoch"]), int(s["block"]), int(s["document"]), int(s["skip"]))
        self._served = int(s["served"])
        self._current = self._next = None
        self.close()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


class StreamingLoader:
    """GlobalBatchLoader's interface (next_batch, state_dict, load_state_dict) over the stream.
    This rank is reader `readers[0]` of `readers[1]` (default: its dp rank of dp), and
    `all_gather(obj)` returns every reader's obj in reader order (one collective over them)."""

    def __init__(
        self, cfg: DataConfig, tok: Tokenizer, layout: RunLayout, seq_len: int, dp_rank: int,
        all_gather: Callable[[object], list], eos: int | None = None, seed: int = 0,
        readers: tuple[int, int] | None = None,
    ):  # fmt: skip
        self.cfg = cfg
        self.seq_len = seq_len
        self.seed = seed
        self.global_batch = layout.global_batch
        self.local_batch = layout.local_batch
        self.micro_batch = layout.micro_batch
        self.dp_rank, self.dp_size = dp_rank, layout.dp
        self.reader, self.readers = readers or (dp_rank, layout.dp)
        self.stream = WindowStream(cfg, tok, seq_len, seed, all_gather, self.reader, self.readers)
        self.block = self.stream.block
        self.eos = eos
        self.samples_consumed = 0
        self.data_wait_s = 0.0  # the last step's longest wait for a reader, over the readers
        self.data_wait_total_s = 0.0

    @property
    def round_docs(self) -> int:
        return self.stream.round_docs

    @round_docs.setter
    def round_docs(self, value: int) -> None:
        self.stream.round_docs = value

    def next_batch(self) -> list[Batch]:
        """This rank's micro batches for the next step; advances state."""
        rows = self.stream.take(self.global_batch)
        self.samples_consumed += self.global_batch
        self.data_wait_s = self.stream.wait_s
        self.data_wait_total_s += self.data_wait_s
        lo = self.dp_rank * self.local_batch
        mine = torch.from_numpy(np.stack(rows[lo : lo + self.local_batch]).astype(np.int64))
        batch = windows_batch(mine, self.eos)
        return batch.micro_batches(self.micro_batch)

    def state_dict(self) -> dict:
        """The position: the global samples, and the stream's (WindowStream.position)."""
        return {
            "samples_consumed": self.samples_consumed,
            "seed": self.seed,
            "shuffle_block": self.block,
            "stream": self.stream.position(),
        }

    # Keys a checkpoint from before blocks lacks (its stream was served unshuffled): loaded
    # without them, they are missing from the state load_state_dict refuses in one line.
    optional_state_keys = ("seed", "shuffle_block", "stream.block", "stream.served")

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved block and window, on any dp size: the next step reads the
        block again from its first document and serves it from the saved window on."""
        if "shuffle_block" not in state:
            raise ConfigError(
                "the checkpoint's streamed position was saved before streaming served windows "
                "in data.shuffle_block blocks (its windows came in corpus order, which this "
                "version does not serve); start a new run, with --checkpoint.init_from dcp:PATH "
                "to keep its weights"
            )
        check_data_seed(self.seed, state)
        check_shuffle_block(self.block, state, None)
        self.samples_consumed = int(state["samples_consumed"])
        self.stream.seek(state["stream"])

    def close(self) -> None:
        self.stream.close()
