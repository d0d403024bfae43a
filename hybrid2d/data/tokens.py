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
import sys
from collections.abc import Iterator

import numpy as np
from tokenizers import Tokenizer

from hybrid2d.config import DataConfig
from hybrid2d.data.cache import cache_key, must_build, read_cached, save_npy
from hybrid2d.data.corpus import corpus_documents, corpus_identity, source_files
from hybrid2d.data.tokenizer import (
    eos_id,
    leading_special_ids,
    special_tokens_as_text,
    tokenizer_hash,
    vocab_extent,
)

# Documents per encode_batch call: big enough for the library's threads, small enough that one
# chunk's Python-side id lists stay modest on a large corpus. A chunk also closes at CHUNK_CHARS
# characters: the library's Encoding objects take about 100 bytes per token, so 256 long
# documents (source files of 20 KB) would hold 100+ MB at once.
CHUNK_DOCS = 256
CHUNK_CHARS = 1 << 18
# Input above this size is tokenized inline with a note that tools/tokenize_corpus.py is the way:
# inline, one process tokenizes (about 1M tokens/s on a core) while every other rank waits.
INLINE_NOTE_BYTES = 256 * 2**20


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
        _note_size(cfg, setting)
        save_npy(path, encode_documents(corpus_documents(cfg, setting), tok))
    return read_cached(path, lambda p: np.load(p, mmap_mode="r"))


def _note_size(cfg: DataConfig, setting: str) -> None:
    """One line (on stderr, from the process that tokenizes) when the input is large enough
    that preprocessing it once, in parallel, beats tokenizing it in the first launch."""
    if not cfg.path:
        return
    size = sum(p.stat().st_size for p in source_files(cfg, setting))
    if size > INLINE_NOTE_BYTES:
        print(
            f"note: {setting}={cfg.path!r} is {size / 2**20:,.0f} MiB of input, tokenized now by "
            "this one process while the other ranks wait; tools/tokenize_corpus.py tokenizes it "
            f"once with a worker per core into shards that {setting} then reads directly",
            file=sys.stderr,
            flush=True,
        )


def encode_documents(docs, tok: Tokenizer) -> np.ndarray:
    """Encode docs in batches with the library's fast path, each after the post-processor's
    leading ids (BOS), and join them with EOS."""
    parts = [tokens for tokens, _ in encode_chunks(docs, tok)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=token_dtype(tok))


def _next_chunk(docs) -> list[str]:
    """The next documents, up to CHUNK_DOCS of them or the first to reach CHUNK_CHARS."""
    chunk, chars = [], 0
    for doc in itertools.islice(docs, CHUNK_DOCS):
        chunk.append(doc)
        chars += len(doc)
        if chars >= CHUNK_CHARS:
            break
    return chunk


def token_dtype(tok: Tokenizer) -> np.dtype:
    """uint16 when every id fits: halves the cache and the page cache it occupies."""
    return np.dtype(np.uint16 if vocab_extent(tok) <= 1 << 16 else np.uint32)


def encode_chunks(docs, tok: Tokenizer) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens, lengths) per chunk of CHUNK_DOCS documents: each document as BOS (where the
    post-processor adds one) + its ids + EOS, and each document's length in tokens. The one
    encoding of a document, whether the whole corpus is held (encode_documents) or written
    shard by shard (preprocess.py), so both give the same tokens."""
    dtype = token_dtype(tok)
    sep = np.array([eos_id(tok)], dtype=dtype)
    bos = np.array(leading_special_ids(tok), dtype=dtype)
    docs = iter(docs)
    # encode_batch_fast (tokenizers >= 0.21) skips computing character offsets we never use.
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    with special_tokens_as_text(tok):
        while chunk := _next_chunk(docs):
            parts, lengths = [], []
            for enc in encode(chunk, add_special_tokens=False):
                if bos.size:
                    parts.append(bos)
                parts.append(np.asarray(enc.ids, dtype=dtype))
                parts.append(sep)
                lengths.append(bos.size + len(enc.ids) + 1)
            yield np.concatenate(parts), np.array(lengths, dtype=np.int64)
