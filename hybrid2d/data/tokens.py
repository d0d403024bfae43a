"""The whole corpus as one flat array of token ids, documents separated by EOS, cached as .npy.
Each document starts as the tokenizer's post-processor starts a text (Llama's, Mistral's and
Gemma's BOS; nothing for Qwen), as transformers' tokenizer encodes it: a model scores a text
without its BOS badly (Gemma loses about 2 nats per token).

Tokenizing once and memory-mapping the result means every rank, and every later run on the same
corpus and tokenizer, starts in well under a second without holding a private copy in memory.
"""

from __future__ import annotations

import itertools
import pathlib

import numpy as np
from tokenizers import Tokenizer

from hybrid2d.config import DataConfig
from hybrid2d.data.cache import cache_key, must_build, read_cached, save_npy
from hybrid2d.data.corpus import corpus_documents, corpus_identity
from hybrid2d.data.tokenizer import (
    eos_id,
    leading_special_ids,
    special_tokens_as_text,
    tokenizer_hash,
    vocab_extent,
)

# Documents per encode_batch call: big enough for the library's threads, small enough that one
# chunk's Python-side id lists stay modest on a large corpus.
CHUNK_DOCS = 256


def tokenize_corpus(
    cfg: DataConfig,
    tok: Tokenizer,
    cache_dir: pathlib.Path,
    build: bool = True,
    setting: str = "data.path",
) -> np.ndarray:
    """All documents encoded, each after the tokenizer's BOS (if any) and followed by EOS, as one
    1-D array (a read-only mmap of the cache); with build=False a missing cache entry is an
    error, not a job. Errors in the data name `setting` (data.val_path when cfg is the
    validation data's)."""
    key = cache_key("tokens-v2", corpus_identity(cfg), tokenizer_hash(tok), cfg.max_chars)
    path = pathlib.Path(cache_dir) / "tokens" / f"{key}.npy"
    if must_build(path, build, cache_dir, f"token cache {path.name}"):
        save_npy(path, encode_documents(corpus_documents(cfg, setting), tok))
    return read_cached(path, lambda p: np.load(p, mmap_mode="r"))


def encode_documents(docs, tok: Tokenizer) -> np.ndarray:
    """Encode docs in batches with the library's fast path, each after the post-processor's
    leading ids (BOS), and join them with EOS."""
    # uint16 when every id fits: halves the cache and the page cache it occupies.
    dtype = np.dtype(np.uint16 if vocab_extent(tok) <= 1 << 16 else np.uint32)
    sep = np.array([eos_id(tok)], dtype=dtype)
    bos = np.array(leading_special_ids(tok), dtype=dtype)
    parts = []
    docs = iter(docs)
    # encode_batch_fast (tokenizers >= 0.21) skips computing character offsets we never use.
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    with special_tokens_as_text(tok):
        while chunk := list(itertools.islice(docs, CHUNK_DOCS)):
            for enc in encode(chunk, add_special_tokens=False):
                if bos.size:
                    parts.append(bos)
                parts.append(np.asarray(enc.ids, dtype=dtype))
                parts.append(sep)
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
