"""Everything a training process needs from the data package, built once per job.

Only the main process trains the tokenizer and tokenizes the corpus; the others wait at the
barrier and then read its cached files. That keeps the expensive work to one process (the default
run puts 4 processes on 2 cores) and guarantees every rank uses byte-identical data.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

from tokenizers import Tokenizer

from hybrid2d.config import JobConfig
from hybrid2d.data.corpus import source_files
from hybrid2d.data.loader import GlobalBatchLoader
from hybrid2d.data.packing import PackedDataset
from hybrid2d.data.tokenizer import find_tokenizer
from hybrid2d.data.tokens import find_tokens

DEFAULT_CACHE_DIR = "~/.cache/hybrid2d"


def cache_dir_for(cfg: JobConfig) -> pathlib.Path:
    return pathlib.Path(cfg.data.cache_dir or DEFAULT_CACHE_DIR).expanduser()


def build_data(
    cfg: JobConfig, dp_rank: int, dp_size: int, is_main: bool, barrier: Callable[[], None]
) -> tuple[GlobalBatchLoader, Tokenizer]:
    """(loader for this dp rank, tokenizer). Every process must call it (it calls barrier())."""
    d, t = cfg.data, cfg.train
    cache_dir = cache_dir_for(cfg)
    # Cheap checks on every rank first, so a bad data.path fails everywhere at once instead of
    # leaving the other ranks waiting at the barrier for a main process that already died.
    source_files(d)
    if d.tokenizer:
        find_tokenizer(d, cfg.model.vocab_size, cache_dir, build=False)
    if is_main:
        tok = find_tokenizer(d, cfg.model.vocab_size, cache_dir, build=True)
        find_tokens(d, tok, cache_dir, build=True)
    barrier()
    tok = find_tokenizer(d, cfg.model.vocab_size, cache_dir, build=False)
    tokens = find_tokens(d, tok, cache_dir, build=False)
    dataset = PackedDataset(tokens, t.seq_len, source=d.path)
    loader = GlobalBatchLoader(dataset, t.global_batch, dp_rank, dp_size, t.micro_batch, t.seed)
    return loader, tok
