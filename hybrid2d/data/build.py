"""Everything a training process needs from the data package, built once per job.

Only the main process trains the tokenizer and tokenizes the corpus; the others wait at the
barrier and then read its cached files. That keeps the expensive work to one process (the default
run puts 4 processes on 2 cores) and guarantees every rank uses byte-identical data.

Text data is packed into windows (packing.py); instruction data (instruct.py: .jsonl of
prompt/completion or messages) is one padded sample per line with the loss on the completion.
Validation data (data.val_path, or a data.val_fraction of data.path's samples held out) is built
the same way and served by `EvalSet`, identically on every mesh. The data figures (RunData.stats,
summary.json's `data`) describe the training samples only, and the held-out ones under `val`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from hybrid2d.config import JobConfig
from hybrid2d.data.cache import atomic_path, cache_key, must_build, read_cached, save_npy
from hybrid2d.data.chat import load_chat_template
from hybrid2d.data.corpus import corpus_identity, source_files
from hybrid2d.data.instruct import (
    IGNORE_INDEX,
    InstructionDataset,
    InstructStats,
    build_instruction_arrays,
    is_instruction_file,
)
from hybrid2d.data.loader import GlobalBatchLoader
from hybrid2d.data.packing import PackedDataset
from hybrid2d.data.tokenizer import load_or_train_tokenizer, tokenizer_hash
from hybrid2d.data.tokens import tokenize_corpus
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout

DEFAULT_CACHE_DIR = "~/.cache/hybrid2d"
VAL_SPLIT_SEED = 1234  # the held-out part of data.path does not move with train.seed


def cache_dir_for(cfg: JobConfig) -> pathlib.Path:
    return pathlib.Path(cfg.data.cache_dir or DEFAULT_CACHE_DIR).expanduser()


class Subset:
    """Samples `indices` of a dataset, with the dataset's gather()."""

    def __init__(self, dataset, indices: np.ndarray):
        self.dataset = dataset
        self.indices = np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def gather(self, indices):
        return self.dataset.gather(self.indices[np.asarray(indices, dtype=np.int64)])


@dataclass(eq=False)
class EvalSet:
    """A fixed held-out set, split the same way on every mesh: the samples padded (with samples
    whose labels are all -100) to a multiple of dp x micro batch, rank r takes the r-th
    contiguous part. The loss is summed over loss tokens and divided by their total."""

    dataset: object
    source: str

    def __len__(self) -> int:
        return len(self.dataset)

    def batches(self, dp_rank: int, dp_size: int, micro_batch: int):
        n = len(self.dataset)
        per_rank = math.ceil(n / (dp_size * micro_batch)) * micro_batch
        for start in range(dp_rank * per_rank, (dp_rank + 1) * per_rank, micro_batch):
            real = np.arange(start, min(start + micro_batch, n))  # empty past the end
            inputs, labels = self.dataset.gather(real if len(real) else np.array([0]))
            pad = micro_batch - len(real)
            if pad:
                fill = torch.full((pad, labels.shape[1]), IGNORE_INDEX, dtype=labels.dtype)
                inputs = torch.cat([inputs[: len(real)], inputs[:1].expand(pad, -1)])
                labels = torch.cat([labels[: len(real)], fill])
            yield inputs, labels


@dataclass
class RunData:
    loader: GlobalBatchLoader
    tokenizer: Tokenizer
    val: EvalSet | None
    kind: str  # "text" | "instruct"
    stats: dict  # what the data summary says (instruction data: samples, truncated, ...)

    def describe(self) -> str:
        parts = [f"data: {self.kind}, {len(self.loader.dataset)} training samples"]
        if self.kind == "instruct":
            parts.append(InstructStats(**self.stats["train_stats"]).describe())
        if self.val is not None:
            parts.append(f"validation: {len(self.val)} samples from {self.val.source}")
        return "; ".join(parts)


def data_kind(cfg: JobConfig, files: list[pathlib.Path], setting: str = "data.path") -> str:
    fmt = cfg.data.format
    if fmt == "text":
        return "text"
    jsonl = bool(files) and all(p.suffix == ".jsonl" for p in files)
    if fmt == "instruct":
        if not jsonl:
            raise ConfigError(
                f"data.format=instruct needs .jsonl files, but {setting} holds "
                f"{sorted({p.suffix for p in files})}; use .jsonl or data.format text"
            )
        return "instruct"
    return "instruct" if jsonl and is_instruction_file(files[0]) else "text"


def _instruct_cache(
    cfg: JobConfig, d, tok: Tokenizer, template, cache_dir: pathlib.Path, setting: str,
    build: bool,
) -> InstructionDataset:  # fmt: skip
    key = cache_key(
        "instruct-v3",  # v3: prompt/completion samples start with the tokenizer's BOS
        corpus_identity(d),
        tokenizer_hash(tok),
        template.source if template is not None else "",
        json.dumps(template.special if template is not None else {}, sort_keys=True),
        cfg.train.seq_len,
    )
    folder = cache_dir / "instruct" / key
    meta_path = folder / "meta.json"  # written last: its presence means the entry is complete
    names = ("tokens", "targets", "offsets", "sample_loss_tokens", "sample_truncated")
    if must_build(meta_path, build, cache_dir, f"instruction cache {key}"):
        files = source_files(d, setting)
        ds = build_instruction_arrays(files, tok, template, cfg.train.seq_len, setting)
        arrays = (
            ds.tokens,
            ds.targets_flat,
            ds.offsets,
            ds.sample_loss_tokens,
            ds.sample_truncated,
        )
        for name, array in zip(names, arrays, strict=True):
            save_npy(folder / f"{name}.npy", array)
        meta = {"pad_id": ds.pad_id, "seq_len": ds.seq_len, "stats": dataclasses.asdict(ds.stats)}
        with atomic_path(meta_path) as tmp:
            tmp.write_text(json.dumps(meta))
    meta = read_cached(meta_path, lambda p: json.loads(p.read_text()))
    arrays = [read_cached(folder / f"{n}.npy", lambda p: np.load(p, mmap_mode="r")) for n in names]
    stats = InstructStats(**meta["stats"])
    return InstructionDataset(*arrays[:3], meta["seq_len"], meta["pad_id"], stats, *arrays[3:])


def _dataset(cfg: JobConfig, d, tok: Tokenizer, cache_dir, setting: str, build: bool):
    """(dataset, kind) for the data config d (data.path's, or val_path's in its place)."""
    kind = data_kind(cfg, source_files(d, setting), setting)
    if kind == "instruct":
        template = load_chat_template(d.tokenizer)
        return _instruct_cache(cfg, d, tok, template, cache_dir, setting, build), kind
    tokens = tokenize_corpus(d, tok, cache_dir, build=build, setting=setting)
    return PackedDataset(tokens, cfg.train.seq_len, source=d.path), kind


def _val_config(data):
    """data.val_path as a DataConfig (its path in data.path's place) whose files exist, or None."""
    if not data.val_path:
        return None
    d = dataclasses.replace(data, path=data.val_path, val_path="", val_fraction=0.0)
    source_files(d, "data.val_path")
    return d


def build_run_data(
    cfg: JobConfig, layout: RunLayout, dp_rank: int, is_main: bool, barrier: Callable[[], None]
) -> RunData:
    """Loader for this dp rank, tokenizer, validation set; the tokenizer, the vocabulary size
    and the batch split are the layout's. Every process must call it (it calls barrier())."""
    d, t = dataclasses.replace(cfg.data, tokenizer=layout.tokenizer), cfg.train
    vocab_size = layout.model.vocab_size
    cache_dir = cache_dir_for(cfg)
    # Cheap checks on every rank first, so a bad data.path fails everywhere at once instead of
    # leaving the other ranks waiting at the barrier for a main process that already died.
    source_files(d)
    val_cfg = _val_config(d)
    if d.tokenizer:
        load_or_train_tokenizer(d, vocab_size, cache_dir, build=False)
    if is_main:
        tok = load_or_train_tokenizer(d, vocab_size, cache_dir)
        _dataset(cfg, d, tok, cache_dir, "data.path", build=True)
        if val_cfg is not None:
            _dataset(cfg, val_cfg, tok, cache_dir, "data.val_path", build=True)
    barrier()
    tok = load_or_train_tokenizer(d, vocab_size, cache_dir, build=False)
    dataset, kind = _dataset(cfg, d, tok, cache_dir, "data.path", build=False)
    train_stats = dataset.stats if kind == "instruct" else None
    val_stats = None
    val = None
    if val_cfg is not None:
        val_ds, _ = _dataset(cfg, val_cfg, tok, cache_dir, "data.val_path", build=False)
        val = EvalSet(val_ds, repr(d.val_path))
        if isinstance(val_ds, InstructionDataset):
            val_stats = val_ds.stats
    elif d.val_fraction:
        n = len(dataset)
        n_val = max(1, round(n * d.val_fraction))
        if n - n_val < 1:
            raise ConfigError(
                f"data.val_fraction={d.val_fraction} of {n} samples leaves none to train on; "
                "use a smaller fraction or more data"
            )
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(VAL_SPLIT_SEED))
        held = np.sort(perm[:n_val].numpy())
        kept = np.sort(perm[n_val:].numpy())
        val = EvalSet(Subset(dataset, held), f"{d.val_fraction:g} of data.path")
        if train_stats is not None:  # the held-out samples are not training data
            train_stats = dataset.stats_of(kept, dropped=dataset.stats.dropped)
            val_stats = dataset.stats_of(held)
        dataset = Subset(dataset, kept)
    stats: dict = {}
    if train_stats is not None:
        stats["train_stats"] = dataclasses.asdict(train_stats)
        stats["train"] = train_stats.to_dict()
    if val_stats is not None:
        stats["val"] = val_stats.to_dict()
    loader = GlobalBatchLoader(dataset, layout, dp_rank, t.seed)
    return RunData(loader, tok, val, kind, stats)


def build_data(
    cfg: JobConfig, layout: RunLayout, dp_rank: int, is_main: bool, barrier: Callable[[], None]
) -> tuple[GlobalBatchLoader, Tokenizer]:
    """(loader for this dp rank, tokenizer). Every process must call it (it calls barrier())."""
    data = build_run_data(cfg, layout, dp_rank, is_main, barrier)
    return data.loader, data.tokenizer
