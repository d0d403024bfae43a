"""The whole corpus as one flat array of token ids, documents separated by EOS, cached as .npy.

Tokenizing once and memory-mapping the result means every rank, and every later run on the same
corpus and tokenizer, starts in well under a second without holding a private copy in memory.
"""

from __future__ import annotations

import itertools
import pathlib

import numpy as np
from tokenizers import Tokenizer

from hybrid2d.config import ConfigError, DataConfig
from hybrid2d.data.cache import atomic_path, cache_key
from hybrid2d.data.corpus import corpus_documents, corpus_identity
from hybrid2d.data.tokenizer import eos_id, tokenizer_hash, vocab_extent

# Documents per encode_batch call: big enough for the library's threads, small enough that one
# chunk's Python-side id lists stay modest on a large corpus.
CHUNK_DOCS = 256


def tokenize_corpus(cfg: DataConfig, tok: Tokenizer, cache_dir: pathlib.Path) -> np.ndarray:
    """All documents encoded, each followed by EOS, as one 1-D array (read-only mmap if cached)."""
    return find_tokens(cfg, tok, pathlib.Path(cache_dir), build=True)


def token_cache_path(cfg: DataConfig, tok: Tokenizer, cache_dir: pathlib.Path) -> pathlib.Path:
    key = cache_key("tokens-v1", corpus_identity(cfg), tokenizer_hash(tok), cfg.max_chars)
    return pathlib.Path(cache_dir) / "tokens" / f"{key}.npy"


def find_tokens(
    cfg: DataConfig, tok: Tokenizer, cache_dir: pathlib.Path, build: bool
) -> np.ndarray:
    path = token_cache_path(cfg, tok, cache_dir)
    if not path.exists():
        if not build:
            raise ConfigError(
                f"data.cache_dir={str(cache_dir)!r} has no token cache {path.name} after the main "
                "process built it; use a cache_dir every process can see"
            )
        tokens = encode_documents(corpus_documents(cfg), tok)
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:  # a file object: np.save would append .npy to a name
                np.save(f, tokens)
    return np.load(path, mmap_mode="r")


def token_dtype(tok: Tokenizer) -> np.dtype:
    """uint16 when every id fits (halves the cache and the page cache it occupies)."""
    return np.dtype(np.uint16 if vocab_extent(tok) <= 1 << 16 else np.uint32)


def encode_documents(docs, tok: Tokenizer) -> np.ndarray:
    """Encode docs in batches with the library's fast path and join them with EOS."""
    eos = eos_id(tok)
    dtype = token_dtype(tok)
    sep = np.array([eos], dtype=dtype)
    parts = []
    docs = iter(docs)
    # encode_batch_fast (tokenizers >= 0.21) skips computing character offsets we never use.
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    # Text that happens to spell a special token ("<|endoftext|>" inside a document) must not
    # turn into a real document boundary; restore the caller's setting afterwards.
    before = tok.encode_special_tokens
    tok.encode_special_tokens = True
    try:
        while chunk := list(itertools.islice(docs, CHUNK_DOCS)):
            for enc in encode(chunk, add_special_tokens=False):
                parts.append(np.asarray(enc.ids, dtype=dtype))
                parts.append(sep)
    finally:
        tok.encode_special_tokens = before
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
