"""A preprocessed corpus: token shards on disk plus an index, read memory-mapped.

tools/tokenize_corpus.py (through preprocess.py) writes a directory:

    token-index.json        written last: shards, token and document counts, dtype, tokenizer
                            hash, the source files (size, mtime) and the settings that read them
    token-plan.json         written first: what the shards are made from (a resumed run checks it)
    tokenizer.json          the tokenizer the shards were made with
    shard-000000.bin        the tokens of whole documents, raw ids of the index's dtype
    shard-000000.docs.npy   each document's end offset within the shard (int64)
    shard-000000.json       the shard's entry in the index (written after its two files)

The shards in order are exactly the flat stream the inline path builds (tokens.py: documents in
corpus order, each BOS + ids + EOS), so windows, document masks and batches do not depend on
where the tokens came from. Opening the index stats each shard (exists, right size) and maps it:
no shard is read, so start-up does not grow with the corpus, only with the number of shards.
"""

from __future__ import annotations

import collections
import json
import pathlib

import numpy as np
from tokenizers import Tokenizer

from hybrid2d.data.cache import atomic_path, save_npy
from hybrid2d.data.tokenizer import tokenizer_hash
from hybrid2d.errors import ConfigError

FORMAT = "hybrid2d-token-shards-v1"
INDEX = "token-index.json"
PLAN = "token-plan.json"
TOKENIZER = "tokenizer.json"
TOOL = "tools/tokenize_corpus.py"


def shard_name(i: int) -> str:
    return f"shard-{i:06d}"


def is_preprocessed(path: str) -> bool:
    """True if `path` is a directory the preprocessing tool wrote to (finished or not)."""
    folder = pathlib.Path(path).expanduser()
    return bool(path) and ((folder / INDEX).is_file() or (folder / PLAN).is_file())


def write_shard(
    folder: pathlib.Path, i: int, chunks, first_document: int, chars: int
) -> dict:  # fmt: skip
    """Shard i from `chunks` ((tokens, lengths) per chunk of documents, tokens.encode_chunks),
    streamed to disk one chunk at a time; each file appears whole or not at all, its entry last
    (a shard with an entry is complete). Returns the entry."""
    name = shard_name(i)
    lengths = []
    tokens = 0
    with atomic_path(folder / f"{name}.bin") as tmp, open(tmp, "wb") as f:
        for ids, lens in chunks:
            f.write(ids.tobytes())
            lengths.append(lens)
            tokens += len(ids)
    ends = np.cumsum(np.concatenate(lengths)) if lengths else np.empty(0, np.int64)
    save_npy(folder / f"{name}.docs.npy", ends.astype(np.int64))
    entry = {
        "name": name,
        "tokens": tokens,
        "documents": len(ends),
        "first_document": first_document,
        "chars": chars,
    }
    with atomic_path(folder / f"{name}.json") as tmp:
        tmp.write_text(json.dumps(entry))
    return entry


def finished_shard(folder: pathlib.Path, i: int, itemsize: int) -> dict | None:
    """Shard i's entry if an earlier run wrote it completely (entry, docs, tokens of the size the
    entry says), else None: it is written again."""
    name = shard_name(i)
    try:
        entry = json.loads((folder / f"{name}.json").read_text())
        size = (folder / f"{name}.bin").stat().st_size
    except (OSError, ValueError):
        return None
    if size != entry.get("tokens", -1) * itemsize or not (folder / f"{name}.docs.npy").is_file():
        return None
    return entry


class ShardedTokens:
    """The shards of a preprocessed corpus as one flat, read-only 1-D token array: what
    PackedDataset takes in place of the inline path's mmap (len, ndim, integer-array indexing).
    A window that crosses shard edges is read from each shard it touches. Shards are mapped when
    first read, the newest MAPPED of them kept: each map holds a file descriptor, and a corpus
    of terabytes has tens of thousands of shards."""

    ndim = 1
    MAPPED = 64

    def __init__(self, folder: pathlib.Path, index: dict):
        self.folder = folder
        self.index = index
        self.dtype = np.dtype(index["dtype"])
        counts = np.array([e["tokens"] for e in index["shards"]], dtype=np.int64)
        self.ends = np.cumsum(counts)
        self.starts = self.ends - counts
        self._maps: collections.OrderedDict[int, np.memmap] = collections.OrderedDict()

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def num_shards(self) -> int:
        return len(self.ends)

    def shard(self, i: int) -> np.ndarray:
        """Shard i's tokens, memory-mapped."""
        if i in self._maps:
            self._maps.move_to_end(i)
            return self._maps[i]
        name = self.index["shards"][i]["name"]
        n = int(self.ends[i] - self.starts[i])
        # numpy refuses to map an empty file; a shard of no tokens holds no documents.
        tokens = (np.memmap(self.folder / f"{name}.bin", dtype=self.dtype, mode="r", shape=(n,))
                  if n else np.empty(0, dtype=self.dtype))  # fmt: skip
        self._maps[i] = tokens
        if len(self._maps) > self.MAPPED:
            self._maps.popitem(last=False)
        return tokens

    def __getitem__(self, key) -> np.ndarray:
        if isinstance(key, slice):
            key = np.arange(*key.indices(len(self)))
        pos = np.asarray(key, dtype=np.int64)
        flat = pos.ravel()
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"token positions outside [0, {len(self)})")
        which = np.searchsorted(self.ends, flat, side="right")
        out = np.empty(flat.shape, dtype=self.dtype)
        for s in np.unique(which):
            mask = which == s
            out[mask] = self.shard(int(s))[flat[mask] - self.starts[s]]
        return out.reshape(pos.shape)

    def document_ends(self, shard: int) -> np.ndarray:
        """End offsets of shard `shard`'s documents within the flat stream."""
        name = self.index["shards"][shard]["name"]
        return np.load(self.folder / f"{name}.docs.npy") + self.starts[shard]

    def check_tokenizer(self, tok: Tokenizer, tokenizer_setting: str, setting: str) -> None:
        """The run's tokenizer must be the one the shards were made with (ids mean tokens)."""
        got, want = tokenizer_hash(tok), self.index["tokenizer_hash"]
        if got != want:
            raise ConfigError(
                f"data.tokenizer={tokenizer_setting!r} is not the tokenizer {setting}="
                f"{str(self.folder)!r} was tokenized with (hash {got}, the index says {want}); "
                f"set data.tokenizer to {self.folder / TOKENIZER}, or tokenize the corpus again "
                f"with {TOOL} and this tokenizer"
            )


def open_shards(value: str, setting: str = "data.path", check_files: bool = True) -> ShardedTokens:
    """The preprocessed corpus at `value` (the option `setting` gave it), checked with the file
    system alone: the index is complete and of this format and, with `check_files`, every shard
    exists and has the size the index says (one stat per shard: on a shared file system with
    tens of thousands of shards that is the cost of opening, so a caller that checked this
    corpus already in this start-up passes False). Each problem is one ConfigError line naming
    the file."""
    folder = pathlib.Path(value).expanduser()
    where = f"{setting}={value!r}"
    index_path = folder / INDEX
    if not index_path.is_file():
        raise ConfigError(
            f"{where} is an unfinished {TOOL} output (no {INDEX}): run the tool again with "
            f"--out {value} to finish it (the shards written so far are kept)"
        )
    try:
        index = json.loads(index_path.read_text())
        if index.get("format") != FORMAT:
            raise ValueError(f"format {index.get('format')!r}, expected {FORMAT!r}")
        itemsize = np.dtype(index["dtype"]).itemsize
        shards = index["shards"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(
            f"{where}: {index_path} is not a {TOOL} index ({e}); tokenize the corpus again"
        ) from None
    if check_files:
        for entry in shards:
            _check_shard_file(folder / f"{entry['name']}.bin", entry, index, itemsize, where, value)
    return ShardedTokens(folder, index)


def _check_shard_file(
    path: pathlib.Path, entry: dict, index: dict, itemsize: int, where: str, value: str
) -> None:
    """One stat: the shard exists and holds the bytes its entry says."""
    want = entry["tokens"] * itemsize
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ConfigError(
            f"{where}: shard {path} is missing ({INDEX} lists {len(index['shards'])} shards); "
            f"copy it back, or run {TOOL} again with --out {value} to rewrite it"
        ) from None
    if size != want:
        raise ConfigError(
            f"{where}: shard {path} holds {size} bytes but {INDEX} says {want} "
            f"({entry['tokens']} tokens of {index['dtype']}): it is truncated or from "
            f"another run; copy it again, or delete it and run {TOOL} again with --out {value}"
        )


def write_index(folder: pathlib.Path, plan: dict, entries: list[dict]) -> dict:
    """token-index.json from the plan and the shards' entries, written atomically (last)."""
    index = {
        "format": FORMAT,
        **plan,
        "tokens": sum(e["tokens"] for e in entries),
        "documents": sum(e["documents"] for e in entries),
        "shards": [
            {k: e[k] for k in ("name", "tokens", "documents", "first_document", "chars")}
            for e in entries
        ],
    }
    with atomic_path(folder / INDEX) as tmp:
        tmp.write_text(json.dumps(index, indent=1))
    return index
