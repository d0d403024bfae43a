"""Tokenizing a text corpus once, with a pool of worker processes, into shards (shards.py): what
tools/tokenize_corpus.py runs.

The main process reads the documents in corpus order (corpus.py, the inline path's reader) and
cuts them into shards of about `shard_chars` characters; a worker encodes a shard
(tokens.encode_chunks, the inline path's encoding) and writes it chunk by chunk. At most two
shards per worker are in flight, so memory is bounded by the shard size and the worker count,
never by the corpus. Shard i is always the same documents (the cut depends on the documents and
shard_chars alone), so a run that was killed is resumed by running it again: shards whose files
are complete are kept, the rest are written, and the index is written last.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import pathlib
import resource
import shutil
import sys
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

from tokenizers import Tokenizer

from hybrid2d.config import DataConfig
from hybrid2d.data.cache import atomic_path
from hybrid2d.data.corpus import corpus_documents, is_hf_dataset, source_files, source_name
from hybrid2d.data.instruct import is_instruction_file
from hybrid2d.data.shards import (
    INDEX,
    PLAN,
    TOKENIZER,
    finished_shard,
    write_index,
    write_shard,
)
from hybrid2d.data.tokenizer import eos_id, leading_special_ids, tokenizer_hash
from hybrid2d.data.tokens import encode_chunks, token_dtype
from hybrid2d.errors import ConfigError
from hybrid2d.paths import tokenizer_file


@dataclass
class Report:
    """What one run of the tool did, for its summary line."""

    out: pathlib.Path
    documents: int
    tokens: int
    shards: int
    kept: int  # shards an earlier, interrupted run had written completely
    new_tokens: int  # tokens this run encoded
    seconds: float
    workers: int
    main_rss: int  # peak resident bytes of the main process
    worker_rss: int  # the largest peak resident bytes of a worker (0: none started)
    worker_cpu_s: float  # CPU seconds the workers used: the per-core rate, whatever the load

    def line(self) -> str:
        rate = self.new_tokens / max(self.seconds, 1e-9)
        per_core = self.new_tokens / max(self.worker_cpu_s, 1e-9)
        kept = f", {self.kept} kept from an earlier run" if self.kept else ""
        return (
            f"tokenized {self.documents:,} documents into {self.tokens:,} tokens in "
            f"{self.shards} shards{kept} -> {self.out} in {self.seconds:.1f} s: "
            f"{rate:,.0f} tokens/s with {self.workers} workers, {per_core:,.0f} per worker "
            f"CPU second (CPU: main {_own_cpu_s():.0f} s, workers {self.worker_cpu_s:.0f} s); "
            f"peak RSS main {self.main_rss / 2**20:.0f} MiB, worker "
            f"{self.worker_rss / 2**20:.0f} MiB"
        )


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def preprocess(
    d: DataConfig, out: pathlib.Path, workers: int, shard_chars: int, progress=None
) -> Report:  # fmt: skip
    """Tokenize data.path (d.path, d.text_field) with data.tokenizer into shards under `out`."""
    start = time.perf_counter()
    if not d.tokenizer:
        raise ConfigError(
            "data.tokenizer is empty: the shards are tokenized with a given tokenizer; pass "
            "--data.tokenizer tokenizer.json (or a Hugging Face model directory holding one)"
        )
    tok_path = tokenizer_file(d.tokenizer)
    tok = Tokenizer.from_file(str(tok_path))
    plan = plan_of(d, tok, shard_chars)
    if _prepare(out, plan, tok_path):
        index = json.loads((out / INDEX).read_text())
        return Report(out, index["documents"], index["tokens"], len(index["shards"]),
                      len(index["shards"]), 0, time.perf_counter() - start, workers,
                      _own_rss(), 0, 0.0)  # fmt: skip
    itemsize = token_dtype(tok).itemsize
    entries: list[dict] = []
    kept = new_tokens = worker_rss = 0
    pending: collections.deque = collections.deque()
    show = progress or (lambda *_: None)

    def collect(item) -> None:
        nonlocal new_tokens, worker_rss
        if isinstance(item, Future):
            entry, rss = item.result()
            new_tokens += entry["tokens"]
            worker_rss = max(worker_rss, rss)
        else:
            entry = item
        entries.append(entry)
        show(len(entries), new_tokens, time.perf_counter() - start)

    cpu_before = _children_cpu_s()
    methods = multiprocessing.get_all_start_methods()
    # fork: a worker starts in milliseconds with the tokenizer library already imported
    # (spawn would import torch again through hybrid2d.data, per worker).
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_start_worker, initargs=(tok.to_str(),)
    ) as pool:
        for i, (first, docs, chars) in enumerate(_shards(corpus_documents(d), shard_chars)):
            done = finished_shard(out, i, itemsize)
            if done and (done["first_document"], done["documents"], done["chars"]) == (
                first, len(docs), chars,
            ):  # fmt: skip
                pending.append(done)
                kept += 1
            else:
                pending.append(pool.submit(_encode_shard, out, i, docs, first, chars))
            del docs
            in_flight = sum(isinstance(p, Future) for p in pending)
            while pending and (
                not isinstance(pending[0], Future) or pending[0].done() or in_flight > 2 * workers
            ):
                in_flight -= isinstance(pending[0], Future)
                collect(pending.popleft())
        while pending:
            collect(pending.popleft())
    index = write_index(out, plan, entries)
    cpu = _children_cpu_s() - cpu_before  # the pool has joined its workers
    return Report(out, index["documents"], index["tokens"], len(entries), kept, new_tokens,
                  time.perf_counter() - start, workers, _own_rss(), worker_rss, cpu)  # fmt: skip


def plan_of(d: DataConfig, tok: Tokenizer, shard_chars: int) -> dict:
    """What the shards are made from: a resumed run must find the same (files' sizes and mtimes,
    the text field, the tokenizer, the shard size). A Hub dataset (hf:NAME) has no files here:
    its name, configuration, split and revision stand for them (pin #REVISION: shards of a
    dataset that changed on the Hub between two runs into one directory would not match)."""
    files = _source_files(d)
    return {
        "tokenizer_hash": tokenizer_hash(tok),
        "dtype": token_dtype(tok).name,
        "bos": leading_special_ids(tok),
        "eos": eos_id(tok),
        "text_field": d.text_field,
        "shard_chars": shard_chars,
        "path": source_name(d),
        "sources": [
            {"file": str(p), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
            for p in files
        ],
    }


def _prepare(out: pathlib.Path, plan: dict, tok_path: pathlib.Path) -> bool:
    """`out` ready for this plan (created, or an earlier run's of the same plan, its stale
    temporary files removed); True if that run finished (its index is there)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory for the shards")
    if (out / PLAN).is_file():
        before = json.loads((out / PLAN).read_text())
        if before != plan:
            changed = sorted(k for k in plan.keys() | before.keys() if plan.get(k) != before.get(k))
            raise ConfigError(
                f"--out {out} holds shards of other input (differs in {', '.join(changed)}); "
                "use a new directory, or delete it to tokenize again"
            )
        for stale in out.glob(".*.tmp"):  # a killed run's half-written files
            stale.unlink()
        return (out / INDEX).is_file()
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(
            f"--out {out} is not empty and holds no {PLAN}; use a new or empty directory"
        )
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / TOKENIZER) as tmp:
        shutil.copyfile(tok_path, tmp)
    with atomic_path(out / PLAN) as tmp:
        tmp.write_text(json.dumps(plan, indent=1))
    return False


def _shards(docs, shard_chars: int):
    """(first document, documents, characters) of each shard: documents in order, a shard closed
    once it holds shard_chars characters."""
    batch, chars, first = [], 0, 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= shard_chars:
            yield first, batch, chars
            first += len(batch)
            batch, chars = [], 0
    if batch:
        yield first, batch, chars


def _source_files(d: DataConfig) -> list[pathlib.Path]:
    files = source_files(d, "data.path")
    if not is_hf_dataset(d.path) and files[0].suffix == ".jsonl" and is_instruction_file(files[0]):
        raise ConfigError(
            f"data.path={d.path!r}: {files[0]} is instruction data (prompt/completion or "
            "messages); the preprocessed path is for text: train on instruction data directly "
            "(it keeps its own cache)"
        )
    return files


_worker_tokenizer: Tokenizer | None = None


def _start_worker(tokenizer_json: str) -> None:
    global _worker_tokenizer
    # One core per worker: the pool is the parallelism (the library's threads would compete).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """A worker whose main process was killed (no shutdown reaches it) ends within a second
    instead of waiting for work forever; a shard it was writing is left as a temporary file,
    which the next run removes."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _encode_shard(out, i, docs, first, chars) -> tuple[dict, int]:
    entry = write_shard(out, i, encode_chunks(docs, _worker_tokenizer), first, chars)
    return entry, _own_rss()


def _children_cpu_s() -> float:
    """CPU seconds of this process's children that have ended (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _own_cpu_s() -> float:
    """CPU seconds of this process so far (user + system), imports included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _own_rss() -> int:
    """Peak resident bytes of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
