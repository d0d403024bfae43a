"""Streaming: text that is not preprocessed, tokenized on the fly by every dp rank for its part.

The stream is the inline path's flat stream (documents in corpus order, each BOS + ids + EOS,
tokens.encode_chunks) cut into the same windows (window i = tokens[i*L : i*L + L + 1]), taken in
order, not shuffled: a reader that has not tokenized the corpus cannot draw the inline path's
permutation of all windows. Global sample position p is the next window of the stream; at the
corpus's end the epoch ends (the tail shorter than a window is dropped, as inline) and the next
starts again at window 0.

Work is split by document: in each round, rank r of dp tokenizes document start + k*dp + r in a
background thread, and one all-gather over dp hands every rank the round's documents in order.
Every rank then holds the step's windows and keeps its rows, so the stream does not depend on the
dp size, and the position saved (document, tokens of it already behind, window of the epoch) lets
a resume on any dp size continue with exactly the windows a straight run takes.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
from tokenizers import Tokenizer

from hybrid2d.config import DataConfig
from hybrid2d.data.batch import Batch
from hybrid2d.data.corpus import corpus_documents
from hybrid2d.data.packing import windows_batch
from hybrid2d.data.tokens import encode_chunks
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout

ROUND_DOCS = 64  # documents each rank tokenizes per round (one all-gather)
AHEAD_ROUNDS = 8  # rounds a reader tokenizes ahead of the step that needs them
_END = "end"


class _Reader:
    """A thread that encodes this rank's groups of `per_round` documents (group g, counted from
    `start`, belongs to rank g % dp) into a bounded queue, a list of id arrays per group, then
    _END (or the exception reading raised)."""

    def __init__(
        self, cfg: DataConfig, tok: Tokenizer, start: int, dp_rank: int, dp: int, per_round: int
    ):  # fmt: skip
        self.per_round = per_round
        self.queue: queue.Queue = queue.Queue(maxsize=AHEAD_ROUNDS)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(cfg, tok, start, dp_rank, dp), daemon=True,
            name=f"stream-reader-{dp_rank}",
        )  # fmt: skip
        self.thread.start()

    def _mine(self, cfg: DataConfig, start: int, dp_rank: int, dp: int, groups: list):
        for d, doc in enumerate(corpus_documents(cfg)):
            if self.stop.is_set():
                return
            group = (d - start) // self.per_round
            if d >= start and group % dp == dp_rank:
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

    def _run(self, cfg, tok, start, dp_rank, dp) -> None:
        groups: list[int] = []  # the group of each document read, in order
        current, docs = None, []
        try:
            for ids, lengths in encode_chunks(self._mine(cfg, start, dp_rank, dp, groups), tok):
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


class StreamingLoader:
    """GlobalBatchLoader's interface (next_batch, state_dict, load_state_dict) over the stream.
    `all_gather(obj)` returns every dp rank's obj in rank order (one collective over dp)."""

    def __init__(
        self, cfg: DataConfig, tok: Tokenizer, layout: RunLayout, seq_len: int, dp_rank: int,
        all_gather: Callable[[object], list], eos: int | None = None,
    ):  # fmt: skip
        self.cfg = cfg
        self.tok = Tokenizer.from_str(tok.to_str())  # the reader's own: encoding toggles it
        self.seq_len = seq_len
        self.global_batch = layout.global_batch
        self.local_batch = layout.local_batch
        self.micro_batch = layout.micro_batch
        self.dp_rank, self.dp_size = dp_rank, layout.dp
        self.all_gather = all_gather
        self.eos = eos
        self.round_docs = ROUND_DOCS  # the stream does not depend on it (tests make it small)
        self.samples_consumed = 0
        self.epoch = 0
        self.window = 0  # windows of this epoch taken
        self.doc = 0  # the document the next window starts in ...
        self.skip = 0  # ... after this many of its tokens
        self.data_wait_s = 0.0  # the last step's longest wait for a reader, over dp
        self.data_wait_total_s = 0.0
        self._reader: _Reader | None = None
        self._docs: collections.deque = collections.deque()  # ids of self.doc on
        self._buffered = 0  # tokens in self._docs
        self._exhausted = False
        self._step_wait = 0.0  # this rank's seconds waiting for its reader in this step

    def _restart(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader = _Reader(
            self.cfg, self.tok, self.doc, self.dp_rank, self.dp_size, self.round_docs
        )
        self._docs.clear()
        self._buffered = 0
        self._exhausted = False

    def _round(self, waits: list[float]) -> None:
        """A group of documents from every rank, appended in order; `waits` becomes every
        rank's wait for its reader in this step so far. A reading error on any rank is raised
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

    def _take(self, count: int, waits: list[float]) -> list[np.ndarray]:
        """The next `count` windows of this epoch, fewer at its end."""
        L = self.seq_len
        while self._available() < count * L + 1 and not self._exhausted:
            self._round(waits)
        n = min(count, max(0, (self._available() - 1) // L))
        if n == 0:
            return []
        flat = np.concatenate(self._docs)[self.skip : self.skip + n * L + 1]
        self.window += n
        self.skip += n * L
        while self._docs and self.skip >= len(self._docs[0]):
            self.skip -= len(self._docs[0])
            self._buffered -= len(self._docs.popleft())
            self.doc += 1
        return [flat[i * L : i * L + L + 1] for i in range(n)]

    def next_batch(self) -> list[Batch]:
        """This rank's micro batches for the next step; advances state."""
        if self._reader is None:
            self._restart()
        self._step_wait = 0.0
        waits = [0.0]
        windows: list[np.ndarray] = []
        while len(windows) < self.global_batch:
            got = self._take(self.global_batch - len(windows), waits)
            if not got and self.window == 0:
                raise ConfigError(
                    f"data.path={self.cfg.path!r} holds fewer than train.seq_len+1="
                    f"{self.seq_len + 1} tokens; use more text or a smaller train.seq_len"
                )
            windows += got
            if len(windows) < self.global_batch:  # the corpus ended: the next epoch
                self.epoch, self.window, self.doc, self.skip = self.epoch + 1, 0, 0, 0
                self._restart()
        self.samples_consumed += self.global_batch
        # The last round carried every rank's wait in this step: the step's longest over dp.
        self.data_wait_s = max(waits)
        self.data_wait_total_s += self.data_wait_s
        lo = self.dp_rank * self.local_batch
        mine = torch.from_numpy(np.stack(windows[lo : lo + self.local_batch]).astype(np.int64))
        batch = windows_batch(mine, self.eos)
        mb = self.micro_batch
        return [batch.rows(i, i + mb) for i in range(0, self.local_batch, mb)]

    def state_dict(self) -> dict:
        return {
            "samples_consumed": self.samples_consumed,
            "stream": {"epoch": self.epoch, "window": self.window, "document": self.doc,
                       "skip": self.skip},
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved window, on any dp size: the reader restarts at its document."""
        s = state["stream"]
        self.samples_consumed = int(state["samples_consumed"])
        self.epoch, self.window = int(s["epoch"]), int(s["window"])
        self.doc, self.skip = int(s["document"]), int(s["skip"])
        self._restart()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
